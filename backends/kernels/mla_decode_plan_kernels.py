"""The decode work plan written out once per call, for the Gluon (wgmma) stage 1 and the merge.

The Triton stage 1 and merge recompute the plan of :mod:`backends.kernels.mla_decode_kernels` in every program
(a pass over ``seq_lens``). The wgmma path computes it once, in ``num_programs`` small programs, into ``WORK``:

* rows ``p < num_programs`` (8 int32 each): first request overlapping chunk ``p``, its global start, its first
  split slot, end of the request range (exclusive), the chunk, the chunk's end (global tokens) -- what stage-1
  program ``p`` walks;
* then 2 int32 per request ``b`` (at ``8 * num_programs + 2 * b``): its first slot and its piece count (1: finished
  by stage 1), written by the program whose chunk the request starts in. Empty requests get no entry; the merge
  checks the length first (it writes zeros for them);
* then ``head_blocks`` int32 per request (at ``8 * num_programs + 2 * num_reqs + head_blocks * b``): the count of
  its split pieces that stage 1 has finished, per head block, set to 0 here. A request of at most ``MERGE_MAX``
  pieces is merged by the stage 1 (the program that finishes its last piece), so its row says 1 piece: the merge
  kernel has nothing to do for it.

Measured on an H100 (128 heads; the merge's programs read their request's row instead of recomputing the plan):
the merge went from 21.7 to 7.9 us at 64 x 4096 tokens and from 41.4 to 14.3 us at 128 x 8192, for a 2.5 us plan
kernel (bench/TRITON_NOTES.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.mla_decode_kernels import _chunk_len, _lengths_total, _requests_before, _span
from backends.kernels.pdl import pdl_enter


@triton.jit(do_not_specialize=["num_reqs", "num_programs", "min_chunk", "snap", "head_blocks"])
def _mla_decode_plan_kernel(
    SL, WORK, num_reqs, num_programs, min_chunk, snap, head_blocks,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, MERGE_MAX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """grid (num_programs,): program p writes work row p, the merge rows and piece counters of the requests
    starting in chunk p."""
    pdl_enter(PDL)
    pid_p = tl.program_id(0)
    lens0, total, equal_pad = _lengths_total(SL, num_reqs, BLOCK_N, BLOCK_B)
    chunk = _chunk_len(total, num_programs, min_chunk, snap, equal_pad, BLOCK_N)
    lo_g = pid_p * chunk
    hi_g = tl.minimum(lo_g + chunk, total)
    b0, s_b, slot0, b_end = _requests_before(lens0, SL, num_reqs, num_reqs, lo_g, hi_g, chunk, BLOCK_N, BLOCK_B)
    b_end = tl.where(lo_g < total, b_end, b0)
    row = WORK + pid_p * 8
    tl.store(row, b0)
    tl.store(row + 1, s_b)
    tl.store(row + 2, slot0)
    tl.store(row + 3, b_end)
    tl.store(row + 4, chunk)
    tl.store(row + 5, hi_g)
    REQ = WORK + num_programs * 8
    CNT = REQ + 2 * num_reqs
    for b in range(b0, b_end):
        seq_len = tl.load(SL + b)
        e_b, p0, _, pieces = _span(s_b, seq_len, chunk, BLOCK_N)
        if p0 == pid_p:
            tl.store(REQ + 2 * b, slot0)
            tl.store(REQ + 2 * b + 1, tl.where(pieces <= MERGE_MAX, 1, pieces))  # 1: no merge kernel work
            for hb in range(head_blocks):
                tl.store(CNT + b * head_blocks + hb, 0)
        slot0 += pieces
        s_b = e_b


def plan_ints(num_programs: int, num_reqs: int, head_blocks: int) -> int:
    """int32 elements of WORK for ``num_programs`` stage-1 programs, ``num_reqs`` requests and ``head_blocks``
    head blocks."""
    return 8 * int(num_programs) + (2 + int(head_blocks)) * int(num_reqs)

