"""Gluon stage-1 kernel of the absorbed-MLA decode over an fp8 (e4m3) cache, 16 heads per program (Hopper).

The tensor cores cannot read an fp8 tile with a 16-bit q (both wgmma operands share one type, and the ``P @ V``
product reads V transposed, which wgmma allows for 16-bit types only), so each tile is widened to fp16 in shared
memory first (``cvt.rn.f16x2.e4m3x2``). Widening costs about as much as the products themselves; run in the
warps that multiply, even overlapped with the tile before's ``P @ V``, it made the kernel 1.47x slower than
without it (663 against 450 us at 64 x 32768, 16 heads, H100). Here it runs in warps of its own, beside the
products:

* **the widener** (a worker partition of 8 warps): waits for a tile to land, waits for one of two fp16 buffers to
  be free, widens the latent halves into it and the rope part into the tile's own stage (its fp8 latent bytes are
  read by then), and signals the buffer full;
* **the multiplier** (the default partition, one warpgroup): the tokens-as-rows products of
  :mod:`backends.kernels.mla_decode_wgmma_tokens_kernels` (``S^T = K q^T``, softmax down the tokens,
  ``O^T += V^T P^T``) over the widened buffer, then signals it free; each tile's scores are queued on the tensor
  cores behind the previous tile's ``P @ V``. It also issues the TMA loads (a stage is refilled once its tile's
  scores are done) and writes the outputs.

Both walk the same plan rows and pieces, so they count the same tiles: tile ``it`` lands in stage ``it % 2`` and is
widened into buffer ``it % 2``. The widened values are exact (every e4m3 value is an fp16 value); rows past a
request's end are zeroed there (never-written pool memory may hold NaN bit patterns). Shared memory: 2 x 36 KiB of
fp8 stages + 2 x 64 KiB of widened latent + 18 KiB of q + 2 KiB of ``P^T``: 220 KiB. 32 heads of q do not fit
beside the two widened buffers: 32-head blocks run :mod:`backends.kernels.mla_decode_wgmma_fp8_regs_kernels`, whose
widener loads the tile into its registers (no fp8 stage); that design was slower here at 16 heads (597.8 against
503.0 us at 64 x 32768).

Measured on an H100 (CUDA-graph replays, bench/TRITON_NOTES.md): 16 heads, 64 x 32768 tokens: 499 us, 1.67x
faster than the bf16 cache through the tokens kernel (832) and 1.78x faster than the Triton fp8 kernel (887); 32
heads (two 16-head programs) 944 against 1180. Tried and slower: four widener warps (512 us), 32-row half tiles in three stages with the
widener issuing the loads and the rope part widened into buffers of its own, so that a stage is free as soon as it
is widened (610 us).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from backends.kernels.mla_decode_wgmma_kernels import (
    _issue_next,
    _pdl_enter,
    _request_span,
    _widen,
    _work_row,
)
from backends.kernels.mla_decode_wgmma_tokens_kernels import _finish_t, _scores_t, _softmax_t, _start_piece_t

#: Registers per thread of the widener's warps (the multiplier takes the rest of the register file).
WIDEN_REGS = gl.constexpr(128)
#: Warps of the widener.
WIDEN_WARPS = gl.constexpr(8)


@gluon.jit
def _rope_buffer(kv_lo, stage, BLOCK_N: gl.constexpr, D_PE: gl.constexpr):
    """The widened rope part of a stage's fp8 tile: fp16 [BLOCK_N, D_PE] over the first 8 KiB of kv_lo[stage]."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_PE], gl.float16)
    return kv_lo.index(stage)._reinterpret(gl.float16, [BLOCK_N, D_PE], layout)


@gluon.jit
def _widener(
    SL, WORK, kv_lo, kv_hi, kv_pe, w_lo, w_hi, bars, full, empty,
    D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """Worker partition: every tile of this program's pieces, as it lands, widened into buffer ``it % 2`` once the
    multiplier has freed it (``empty``), then handed over (``full``)."""
    _pdl_enter(PDL)
    NW: gl.constexpr = WIDEN_WARPS
    D_HALF: gl.constexpr = D_CKV // 2
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, gl.program_id(1))
    it = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        for i in range(gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)):
            stage = it % STAGES
            buf = it % 2
            mbarrier.wait(bars.index(stage), (it // STAGES) & 1)  # landed
            mbarrier.wait(empty.index(buf), ((it // 2) & 1) ^ 1)  # the products of tile it - 2 are done
            valid = end - start - i * BLOCK_N
            _widen(kv_lo.index(stage), w_lo.index(buf), valid, BLOCK_N, D_HALF, NW)
            _widen(kv_hi.index(stage), w_hi.index(buf), valid, BLOCK_N, D_HALF, NW)
            gl.thread_barrier()  # every widener warp has read kv_lo[stage]: the rope part goes there
            _widen(kv_pe.index(stage), _rope_buffer(kv_lo, stage, BLOCK_N, D_PE), valid, BLOCK_N, D_PE, NW)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(full.index(buf), count=1)
            it += 1
        s_b = e_b


@gluon.jit
def _scores_when_widened(full, it, w_lo, w_hi, pe_src, q_lo, q_hi, q_pe, s_zero, STAGES: gl.constexpr):
    """Tile ``it``'s scores over widened buffer ``it % 2``, issued once the widener has filled it (not waited for).
    Its rope part: ``pe_src[it % 2]`` where the widened buffers have one (fp16 ``pe_src``, the 32-head kernel), else
    the first 8 KiB of its fp8 stage ``pe_src[it % STAGES]`` (fp8 ``pe_src``: kv_lo, this kernel)."""
    mbarrier.wait(full.index(it % 2), (it // 2) & 1)
    if pe_src.dtype == gl.float16:
        a_pe = pe_src.index(it % 2)
    else:
        a_pe = _rope_buffer(pe_src, it % STAGES, w_lo.shape[1], q_pe.shape[1])
    return _scores_t(w_lo.index(it % 2), w_hi.index(it % 2), a_pe, q_lo, q_hi, q_pe, s_zero)


@gluon.jit
def _widened_tile_products(
    s, m_i, l_i, o_lo, o_hi, rows_n, valid, qk_scale, p_smem, w_lo, w_hi, pe_src, q_lo, q_hi, q_pe, s_zero, full,
    empty, it, has_next, STAGES: gl.constexpr,
):  # fmt: skip
    """One tile of the fp8 kernels' multiplier: tile ``it``'s softmax (its scores ``s`` done) and ``P @ V`` over
    widened buffer ``it % 2``, the next tile's scores (rope part from ``pe_src``, see :func:`_scores_when_widened`)
    queued behind it on the tensor cores when ``has_next`` (three groups), the buffer handed back to the widener
    once ``P @ V`` is done. Returns the next tile's scores (done), the running max and sum and the output
    accumulators."""
    buf = it % 2
    alpha_o, m_i, l_i = _softmax_t(s, m_i, l_i, rows_n, valid, qk_scale, p_smem)
    pv_lo = warpgroup_mma(w_lo.index(buf).permute((1, 0)), p_smem, o_lo * alpha_o, is_async=True)
    pv_hi = warpgroup_mma(w_hi.index(buf).permute((1, 0)), p_smem, o_hi * alpha_o, is_async=True)
    if has_next:
        s = _scores_when_widened(full, it + 1, w_lo, w_hi, pe_src, q_lo, q_hi, q_pe, s_zero, STAGES)
        o_lo, o_hi = warpgroup_mma_wait(num_outstanding=3, deps=(pv_lo, pv_hi))
        gl.thread_barrier()  # every multiplier warp's P @ V is done: the buffer is free
        mbarrier.arrive(empty.index(buf), count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    else:
        o_lo, o_hi = warpgroup_mma_wait(num_outstanding=0, deps=(pv_lo, pv_hi))
        gl.thread_barrier()
        mbarrier.arrive(empty.index(buf), count=1)
    return s, m_i, l_i, o_lo, o_hi


@gluon.jit
def _multiplier(
    QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div,
    q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, w_lo, w_hi, p_smem, bars, full, empty,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Default partition: the plan walk, TMA issue, the products over the widened buffers, the outputs."""
    D_HALF: gl.constexpr = D_CKV // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_H, 16]
    )
    rows_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=acc_layout)
    h0 = gl.program_id(0) * BLOCK_H
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)
    it = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            PT_row = PT + b64 * stride_pt_b
            m_i, l_i, o_lo, o_hi = _start_piece_t(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
                                                  q_lo, q_hi, q_pe, acc_layout, BLOCK_H, D_HALF, D_PE, num_warps)
            nt = gl.cdiv(end - start, BLOCK_N)
            for j in gl.static_range(STAGES):  # every stage in flight
                _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, (it + j) % STAGES, PT_row,
                            start + j * BLOCK_N, end, j < nt, PAGE_SIZE, D_HALF)  # fmt: skip
            s = _scores_when_widened(full, it, w_lo, w_hi, kv_lo, q_lo, q_hi, q_pe, s_zero, STAGES)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            for i in range(nt):  # s: tile i's scores, done
                n0 = start + i * BLOCK_N
                gl.thread_barrier()  # every multiplier warp is done with this stage: refill it
                _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, it % STAGES, PT_row, n0 + STAGES * BLOCK_N,
                            end, i + STAGES < nt, PAGE_SIZE, D_HALF)  # fmt: skip
                s, m_i, l_i, o_lo, o_hi = _widened_tile_products(
                    s, m_i, l_i, o_lo, o_hi, rows_n, end - n0, qk_scale, p_smem, w_lo, w_hi, kv_lo, q_lo, q_hi, q_pe,
                    s_zero, full, empty, it, i + 1 < nt, STAGES,
                )  # fmt: skip
                it += 1
            _finish_t(o_lo, o_hi, m_i, l_i, out_scale, b64, split, slot0 + (pid_p - p0), slot_div, h0, PO, PL, OUT,
                      stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b,
                      stride_o_h, D_HALF, BLOCK_H, num_warps)  # fmt: skip
        slot0 += pieces
        s_b = e_b


@gluon.jit(do_not_specialize=["slot_div", "num_reqs"])
def _mla_decode_wgmma_fp8_kernel(
    QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, num_reqs,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MERGE: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """grid (H // BLOCK_H, programs), the tokens kernel's arguments over an fp8 cache: ``num_warps`` (4) warps
    multiply, :data:`WIDEN_WARPS` (8) more widen. Split requests are all merged by the merge kernel (``MERGE`` = 0,
    ``num_reqs`` unused: with the stage-1 merge in this kernel, 16 heads 64 x 32768 took 531.9 us against 499.7)."""
    gl.static_assert(MERGE == 0, "the fp8 kernel leaves every split request to the merge kernel")
    _pdl_enter(PDL)  # the widener warps start at the partition below, after this wait (and wait again themselves)
    D_HALF: gl.constexpr = D_CKV // 2
    CDT: gl.constexpr = gl.float16
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_HALF], CDT)
    q_lo = gl.allocate_shared_memory(CDT, [BLOCK_H, D_HALF], q_layout)
    q_hi = gl.allocate_shared_memory(CDT, [BLOCK_H, D_HALF], q_layout)
    q_pe = gl.allocate_shared_memory(CDT, [BLOCK_H, D_PE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_PE], CDT))
    kv_lo = gl.allocate_shared_memory(desc_c.dtype, [STAGES, BLOCK_N, D_HALF], desc_c.layout)
    kv_hi = gl.allocate_shared_memory(desc_c.dtype, [STAGES, BLOCK_N, D_HALF], desc_c.layout)
    kv_pe = gl.allocate_shared_memory(desc_c.dtype, [STAGES, BLOCK_N, D_PE], desc_pe.layout)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_HALF], CDT)
    w_lo = gl.allocate_shared_memory(CDT, [2, BLOCK_N, D_HALF], w_layout)
    w_hi = gl.allocate_shared_memory(CDT, [2, BLOCK_N, D_HALF], w_layout)
    p_smem = gl.allocate_shared_memory(CDT, [BLOCK_N, BLOCK_H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], CDT))
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(2):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    gl.warp_specialize(
        [
            (_multiplier, (
                QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale, stride_qn_b, stride_qn_h,
                stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s, stride_pl_b,
                stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe,
                w_lo, w_hi, p_smem, bars, full, empty, PAGE_SIZE, D_CKV, D_PE, BLOCK_H, BLOCK_N, STAGES, num_warps,
            )),
            (_widener, (SL, WORK, kv_lo, kv_hi, kv_pe, w_lo, w_hi, bars, full, empty, D_CKV, D_PE, BLOCK_N, STAGES,
                         PDL)),
        ],
        [WIDEN_WARPS],
        [WIDEN_REGS],
    )  # fmt: skip
