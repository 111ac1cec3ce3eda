"""Gluon stage-1 kernel of the absorbed-MLA decode over an fp8 (e4m3) cache, 64 heads per program (Hopper): the
scores as fp8 products straight from the landed tile, ``P @ V`` over the tile widened to fp16 by warps of their
own.

Why: the lock-step kernel (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_kernels`) widens each fp8 tile (latent and
rope part) to fp16 with the same 8 warps that then multiply it, so the tensor cores wait for every widening: 0.63-0.72x
the bf16 cache's speed at 128 heads, 0.97-1.01x at 64. Here, as in the 16 / 32-head fp8 kernel
(:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_kernels`, which explains the split of q):

* **the widener** (that kernel's ``_widener``, a worker partition of 4 warps) issues the TMA loads of the fp8 tiles
  into ``STAGES`` stages, widens each landed tile's latent halves (not the rope part: only the scores read it) into
  the next of ``WIDENED`` fp16 tiles once ``P @ V`` is done with it, zeroing the rows past the request's end, and
  refills a stage once the scores are done with it;
* **the multiplier** (the default partition, 8 warps laid out as in the lock-step kernel: each warpgroup the scores
  of its 32 tokens of the tile, the softmax statistics combined across the two, then half the output columns from
  the whole probability tile) computes the scores ``S [64 heads, 64 tokens] = q . K^T`` from the fp8 stage itself
  (K-major, the one form an fp8 wgmma takes) with q split into two e4m3 parts per head (``q s = hi + lo / 16``:
  every bit of a bf16 q), two fp8 products that cost one fp16 product, and ``P @ V`` over the widened tile once it
  is full; the next tile's scores are queued behind each ``P @ V``.

Shared memory: 72 KiB of split q + 2 x 36 KiB of fp8 stages + 64 KiB of one widened tile and the multiplier's scratch
to hand ``P`` between layouts: 217,148 bytes. Registers: the multiplier 224 per thread (44 bytes spilled, in a
piece's setup, none in the tile loop), the widener 56.

Measured on an H100 (CUDA-graph replays, plan reused, docs/kernels.md), us, lock-step -> this kernel (bf16
cache): 64 heads 64 x 32768 872.2 -> 722.5 (868.7), 64 x 4096 142.4 -> 125.2 (140.7), 128 x varied 8192 455.0 ->
398.7; 128 heads 64 x 32768 1712.0 -> 1364.1, 64 x 4096 239.1 -> 198.6 (151.8), 128 x varied 8192 881.8 -> 725.7;
error against float32 1.9-2.2e-3 (lock-step: 1.7e-3). Two tiles of widened latent (or two half tiles) do not fit
beside two stages; half tiles, one each, measured 2-5% slower (an H200). What bounds it: each warpgroup's ``m64n32``
score products read all of q from shared memory for 32 tokens (the lock-step kernel's docstring), 55-63% of the
matmul peak at 128 heads where the bf16 seesaw kernel reaches 80%.

The default for fp8 at 64 / 128 heads (``FP8_HEADS_KERNEL`` in :mod:`backends.kernels.mla_decode.mla_decode_wgmma`;
False runs the lock-step kernel). What fp8 scores cost: an fp8 wgmma accumulates in less than fp32 precision, about 6e-4
of the largest product sum over 256 columns whichever operand q is (H100, either orientation), so a head whose
scores reach the thousands (q 1000x the others') with near-tied maxima can come out percents off: 16% on one
problem of 64 heads (the q x1000 head of the test's seed 5), while 8 other random problems gave at most 4.5e-3
here and 1.6e-2 with the 16-head fp8 kernel (fp16 products: under 1e-3). ``hi`` in five chains of 128 columns gave
11% on that problem (818 us), ``lo`` in three chains changed nothing; promoting ``hi``'s accumulation to fp32 every
32 or 64 products (``max_num_imprecise_acc``) gives 1.9-2.2e-3 but takes 855-876 us at 64 heads 64 x 32768 and
1635-1674 at 128, the lock-step kernel's time; every 128 products left 11%.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from backends.kernels.mla_decode.mla_decode_wgmma_fp8_kernels import (
    LO_SCALE,
    WIDEN_WARPS_2,
    _done_with,
    _load_q_split,
    _widener,
    _widener_barriers,
    _widener_rings,
)
from backends.kernels.mla_decode.mla_decode_wgmma_kernels import (
    _column_split_layout,
    _finish_piece,
    _merge_chunk_ends,
    _opaque_zero,
    _request_span,
    _softmax,
    _token_split_layout,
    _work_row,
)

#: The widener's arguments: whole tiles (one part each), and no programmatic dependent launch (the 64-head kernels
#: are launched without it).
_WHOLE_TILES = gl.constexpr(1)
_NO_PDL = gl.constexpr(False)
#: Registers per thread of the widener's warps (the multiplier's 8 warps take the rest of the register file).
WIDEN_REGS_H = gl.constexpr(56)


@gluon.jit
def _chain(qs, ks, r0: gl.constexpr, j0: gl.constexpr, j1: gl.constexpr, s_zero, BLOCK_H: gl.constexpr):
    """Rows [r0, r0 + BLOCK_H) of the split q (``hi`` at 0, ``lo`` at BLOCK_H) against boxes j0 .. j1 - 1 of the
    stage (``ks``: the latent halves and the rope part; ``qs`` q's), into one accumulator: j1 - j0 wgmma groups,
    issued."""
    acc = warpgroup_mma(qs[j0].slice(r0, BLOCK_H, dim=0), ks[j0].permute((1, 0)), s_zero, use_acc=False,
                        is_async=True)  # fmt: skip
    for j in gl.static_range(j0 + 1, j1):
        acc = warpgroup_mma(qs[j].slice(r0, BLOCK_H, dim=0), ks[j].permute((1, 0)), acc, is_async=True)
    return acc


#: wgmma groups :func:`_issue_scores` leaves in flight: ``hi``'s first chain and ``lo``'s three boxes.
SCORE_GROUPS = gl.constexpr(4)


@gluon.jit
def _issue_scores(qs, ks, s_zero, BLOCK_H: gl.constexpr):
    """A tile's scores, first part, issued (:data:`SCORE_GROUPS` wgmma groups): ``hi`` against the low latent half,
    and ``lo`` against the whole tile in one chain (its rounding weighs 1 / 16 of ``hi``'s)."""
    return _chain(qs, ks, 0, 0, 1, s_zero, BLOCK_H), _chain(qs, ks, BLOCK_H, 0, 3, s_zero, BLOCK_H)


@gluon.jit
def _finish_scores(t, qs, ks, s_zero, BLOCK_H: gl.constexpr):
    """S s [BLOCK_H, BLOCK_N] = S_hi + S_lo / 16 (the 1 / s is in the softmax's per-head scale) from
    :func:`_issue_scores`'s accumulators, waited for, then ``hi`` against the high latent half and the rope part, one
    chain at a time, each added in fp32 once done. An fp8 wgmma accumulates in less than fp32 precision (see
    ``_wait_scores`` of the 16 / 32-head kernel): one chain per part of q measured the same time at 3.1-4.1e-3 error
    against 1.9-2.1e-3 (H100); six accumulators in flight at once spilled beside the output's. Not precise enough
    for scores in the thousands (see the module's docstring)."""
    h, lo = warpgroup_mma_wait(num_outstanding=0, deps=t)
    s = h + lo * (1.0 / LO_SCALE)
    for j in gl.static_range(1, 3):
        s = s + warpgroup_mma_wait(num_outstanding=0, deps=(_chain(qs, ks, 0, j, j + 1, s_zero, BLOCK_H),))
    return s


@gluon.jit
def _multiplier_heads(
    QN, QP, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, num_reqs,
    q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, w_lo, w_hi, bars, read, full, empty,
    D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    WIDENED: gl.constexpr, MERGE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Default partition (8 warps): per piece, q split into shared memory; per tile, the softmax of its scores,
    ``P @ V`` over the widened tile once it is full, the next tile's scores queued behind it (their stage then handed
    back), the widened tile handed back once its product is done; the outputs; at the end the split requests of at
    most ``MERGE`` pieces this program finished last."""
    D_HALF: gl.constexpr = D_CKV // 2
    s_layout: gl.constexpr = _token_split_layout(BLOCK_N, 32)
    o_layout: gl.constexpr = _column_split_layout(D_HALF)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    h0 = gl.program_id(0) * BLOCK_H
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)
    it = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            inv_s = _load_q_split(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo.index(0),
                                  q_hi.index(0), q_pe.index(0), row_s, BLOCK_H, D_HALF, D_PE, num_warps)  # fmt: skip
            qk_h = gl.expand_dims(inv_s * qk_scale, 1)  # the softmax's scale per head [BLOCK_H, 1], 1 / s folded in
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
            o_lo = gl.zeros([BLOCK_H, D_HALF], gl.float32, layout=o_layout)
            o_hi = gl.zeros([BLOCK_H, D_HALF], gl.float32, layout=o_layout)
            nt = gl.cdiv(end - start, BLOCK_N)
            # q, the stage and the widened tile at an index the compiler cannot fold: fixed operand descriptors are
            # hoisted out of the loop and kept live (spilled) across it
            z = _opaque_zero()
            qs = (q_lo.index(z), q_hi.index(z), q_pe.index(z))
            stage = it % STAGES + z
            ks = (kv_lo.index(stage), kv_hi.index(stage), kv_pe.index(stage))
            mbarrier.wait(bars.index(it % STAGES), (it // STAGES) & 1)  # landed
            s = _finish_scores(_issue_scores(qs, ks, s_zero, BLOCK_H), qs, ks, s_zero, BLOCK_H)
            _done_with(read, it % STAGES)
            for i in range(nt):  # s: tile i's scores, done
                keep = cols_n < end - start - i * BLOCK_N
                p_op, alpha_o, m_i, l_i = _softmax(s, m_i, l_i, keep, qk_h, gl.float16, row_o, p_layout)
                z = _opaque_zero()
                buf = it % WIDENED
                mbarrier.wait(full.index(buf), (it // WIDENED) & 1)  # widened
                pv_lo = warpgroup_mma(p_op, w_lo.index(buf + z), o_lo * alpha_o, is_async=True)
                pv_hi = warpgroup_mma(p_op, w_hi.index(buf + z), o_hi * alpha_o, is_async=True)
                if i + 1 < nt:  # the next tile's scores queued behind P @ V
                    nxt = (it + 1) % STAGES
                    qs = (q_lo.index(z), q_hi.index(z), q_pe.index(z))
                    ks = (kv_lo.index(nxt + z), kv_hi.index(nxt + z), kv_pe.index(nxt + z))
                    mbarrier.wait(bars.index(nxt), ((it + 1) // STAGES) & 1)
                    t = _issue_scores(qs, ks, s_zero, BLOCK_H)
                    # P, registers the async P @ V reads, kept live until it is done (not reused by the scores)
                    o_lo, o_hi, p_op = warpgroup_mma_wait(num_outstanding=SCORE_GROUPS, deps=(pv_lo, pv_hi, p_op))
                    _done_with(empty, buf)
                    s = _finish_scores(t, qs, ks, s_zero, BLOCK_H)
                    _done_with(read, nxt)
                else:
                    o_lo, o_hi, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(pv_lo, pv_hi, p_op))
                    _done_with(empty, buf)
                it += 1
            _finish_piece(o_lo, o_hi, m_i, l_i, out_scale, b64, split, slot0 + (pid_p - p0), slot_div, h0, PO, PL, OUT,
                          stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b,
                          stride_o_h, BLOCK_H, D_HALF, o_layout, s_layout)  # fmt: skip
        slot0 += pieces
        s_b = e_b
    if MERGE > 0:  # the last program to finish a split request's pieces merges them
        _merge_chunk_ends(WORK, SL, PO, PL, OUT, s_b, slot0, h0, slot_div, num_reqs, stride_po_b, stride_po_h,
                          stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, BLOCK_H, BLOCK_N,
                          D_CKV, MERGE, num_warps)  # fmt: skip


@gluon.jit(do_not_specialize=["slot_div", "num_reqs"])
def _mla_decode_wgmma_fp8_heads_kernel(
    QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, num_reqs,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WIDENED: gl.constexpr, MERGE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """grid (H // BLOCK_H, programs), the 64-head kernel's arguments over an fp8 cache: the kernel's ``num_warps``
    (8) warps multiply, :data:`WIDEN_WARPS_2` (4) more widen; ``STAGES`` fp8 stages, ``WIDENED`` widened tiles;
    split requests of at most ``MERGE`` pieces merged here."""
    gl.static_assert(BLOCK_H == 64, "64 heads per program (one wgmma row block)")
    D_HALF: gl.constexpr = D_CKV // 2
    F8: gl.constexpr = gl.float8e4nv
    q_lo = gl.allocate_shared_memory(F8, [1, 2 * BLOCK_H, D_HALF],
                                     gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_HALF], F8))  # fmt: skip
    q_hi = gl.allocate_shared_memory(F8, [1, 2 * BLOCK_H, D_HALF],
                                     gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_HALF], F8))  # fmt: skip
    q_pe = gl.allocate_shared_memory(F8, [1, 2 * BLOCK_H, D_PE],
                                     gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_PE], F8))  # fmt: skip
    kv_lo, kv_hi, kv_pe, w_lo, w_hi = _widener_rings(desc_c, desc_pe, BLOCK_N, STAGES, WIDENED, BLOCK_N, D_CKV, D_PE)
    bars, read, full, empty = _widener_barriers(STAGES, WIDENED, 1)  # one partition multiplies
    gl.warp_specialize(
        [
            (_multiplier_heads, (
                QN, QP, SL, WORK, PO, PL, OUT, qk_scale, out_scale, stride_qn_b, stride_qn_h, stride_qp_b,
                stride_qp_h, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s,
                stride_o_b, stride_o_h, slot_div, num_reqs, q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, w_lo, w_hi,
                bars, read, full, empty, D_CKV, D_PE, BLOCK_H, BLOCK_N, STAGES, WIDENED, MERGE, num_warps,
            )),
            (_widener, (desc_c, desc_pe, PT, SL, WORK, stride_pt_b, kv_lo, kv_hi, kv_pe, w_lo, w_hi, bars, read,
                        full, empty, PAGE_SIZE, D_CKV, BLOCK_N, STAGES, WIDENED, _WHOLE_TILES, WIDEN_WARPS_2, _NO_PDL)),
        ],
        [WIDEN_WARPS_2],
        [WIDEN_REGS_H],
    )  # fmt: skip
