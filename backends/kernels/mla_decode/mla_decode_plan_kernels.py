"""The decode work plan written out once per call, for the Gluon (wgmma) stage 1 and the merge.

The Triton stage 1 and merge recompute the plan of :mod:`backends.kernels.mla_decode.mla_decode_kernels` in every
program (a pass over ``seq_lens``). The wgmma path computes it once, in ``num_programs`` small programs, into ``WORK``:

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
kernel (docs/kernels.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.mla_decode.mla_decode_kernels import (
    _chunk_len,
    _lengths_total,
    _merge_pieces,
    _requests_before,
    _span,
)
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


@triton.jit
def _merge_needs(SL, REQ, bs, num_reqs):
    """1 for the requests ``bs`` the merge kernel has work for (split into more pieces than the stage 1 merged, or
    empty: zeros to write), read through L2 (``.cg``: they may be read before the PDL wait, see below)."""
    in_b = bs < num_reqs
    lens = tl.load(SL + bs, mask=in_b, other=1, cache_modifier=".cg")
    pieces = tl.load(REQ + 2 * bs + 1, mask=in_b & (lens > 0), other=1, cache_modifier=".cg")
    return (in_b & ((lens <= 0) | (pieces > 1))).to(tl.int32)


@triton.jit(do_not_specialize=["H", "num_reqs", "slot_div"])
def _mla_decode_merge_rows_kernel(
    PO, PL, SL, REQ, OUT, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b,
    stride_o_h, H, num_reqs, slot_div, D_CKV: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_HM: tl.constexpr, BLOCK_DV: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The wgmma path's merge, from the plan's per-request rows (``REQ``: first slot, piece count): grid (G,), a
    fixed number of programs that share the jobs (request needing work x head block x column block) out in turn, so
    the grid's size does not grow with the batch. Split requests are merged as the Triton merge does; empty ones
    get zeros; the others (finished by the stage 1) cost nothing.

    The rows are read before the PDL wait: the plan kernel that wrote them finished before the stage 1 passed its
    own wait, which is before this grid could launch, and the lengths are older still. So with PDL the programs
    are resident beside the stage 1's (G = 2 per SM fits beside them), know whether there is anything to merge when
    the stage 1 ends, and end at once when there is not."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    CB: tl.constexpr = D_CKV // BLOCK_DV
    tiles = tl.cdiv(H, BLOCK_HM) * CB
    offs = tl.arange(0, BLOCK_B)
    need = _merge_needs(SL, REQ, offs, num_reqs)
    pdl_enter(PDL)
    done = 0  # jobs of the requests before this chunk
    for c0 in range(0, num_reqs, BLOCK_B):
        if c0 > 0:
            need = _merge_needs(SL, REQ, c0 + offs, num_reqs)
        rank = tl.cumsum(need, 0) - need  # among this chunk's requests that need work
        n_jobs = tl.sum(need, 0) * tiles
        for j in range((pid - done % G + G) % G, n_jobs, G):  # job done + j is this program's when = pid mod G
            k = j // tiles
            t = j % tiles
            b = c0 + tl.sum(tl.where((rank == k) & (need > 0), offs, 0), 0)
            offs_h = (t // CB) * BLOCK_HM + tl.arange(0, BLOCK_HM)
            mask_h = offs_h < H
            offs_d = (t % CB) * BLOCK_DV + tl.arange(0, BLOCK_DV)
            o_ptrs = OUT + b.to(tl.int64) * stride_o_b + offs_h[:, None] * stride_o_h + offs_d[None, :]
            if tl.load(SL + b) <= 0:
                tl.store(o_ptrs, tl.zeros([BLOCK_HM, BLOCK_DV], dtype=OUT.dtype.element_ty), mask=mask_h[:, None])
            else:
                _merge_pieces(PO, PL, o_ptrs, tl.load(REQ + 2 * b), tl.load(REQ + 2 * b + 1), offs_h, mask_h, offs_d,
                              stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, slot_div,
                              BLOCK_S, BLOCK_HM, BLOCK_DV)  # fmt: skip
        done += n_jobs


def plan_ints(num_programs: int, num_reqs: int, head_blocks: int) -> int:
    """int32 elements of WORK for ``num_programs`` stage-1 programs, ``num_reqs`` requests and ``head_blocks``
    head blocks."""
    return 8 * int(num_programs) + (2 + int(head_blocks)) * int(num_reqs)

