"""Gluon stage-1 kernel of the absorbed-MLA decode over an fp8 (e4m3) cache, 16 heads per program (Hopper): the
scores as fp8 products straight from the landed tile, ``P @ V`` over the tile widened to fp16.

The scores ``S^T [64 tokens, H] = K [64, 576] . q^T`` have both operands K-major (the tile's rows, q's rows), the
one form an fp8 wgmma takes, so they need no widening: q is split into two e4m3 parts per head,
``q * s = hi + lo / 16`` (``s`` the power of two that puts the head's largest value in (224, 448]; ``hi`` =
e4m3(q s), ``lo`` = e4m3(16 (q s - hi))), stacked as the 2H columns of ``m64n32k32`` products: the tile is read
once, and ``S = (S_hi + S_lo / 16) / s``. Two e4m3 parts hold 8 significant bits, all of a bf16 q (values under
2^-14 of their head's largest excepted, where ``lo`` goes subnormal), and the cache's values are exact operands, so
the scores lose nothing but the fp8 accumulation's precision (see :func:`_wait_scores`). ``P @ V`` reads V along
the tokens (not K-major) and stays an fp16 product over the tile widened in shared memory:

* **the widener** (a worker partition of 8 warps): waits for a tile to land and for one of two fp16 buffers to be
  free, widens the latent halves into it (the rope part is only read by the scores) and signals it full;
* **the multiplier** (the default partition, one warpgroup): issues the TMA loads, the scores of each tile as soon
  as it lands (not waiting for its widening), the softmax down the tokens, ``O^T += V^T P^T`` over the widened
  buffer once it is full (then hands it back), and writes the outputs.

Both walk the same plan rows and pieces, so they count the same tiles: tile ``it`` lands in stage ``it % 2`` and is
widened into buffer ``it % 2``; a stage is refilled once its scores are done and its buffer is full (the widener
has read it). Rows past a request's end are masked out of the scores (never-written pool memory may hold NaN bit
patterns) and zeroed in the widened buffer. Shared memory: 2 x 36 KiB of fp8 stages + 2 x 64 KiB of widened latent
+ 18 KiB of split q + 2 KiB of ``P^T``: 220 KiB.

Measured on an H100 (CUDA-graph replays, plan reused, bench/TRITON_NOTES.md), 16 heads, us: 64 x 32768 466-467
(1.76x the bf16 cache's 819.9; the kernel before, which widened the whole tile and ran fp16 scores: 500), 128 x
varied 8192 260-263 (278), 64 x 4096 95.0 (97.7); error against float32 1.9-2.2e-3 (bf16: 1.7e-3). 32 heads run
:mod:`backends.kernels.mla_decode_wgmma_fp8_regs_kernels` (32 heads of split q, two fp8 stages and two widened
tiles do not fit in shared memory).
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
from backends.kernels.mla_decode_wgmma_tokens_kernels import _finish_t, _fresh_state_t, _softmax_t

#: Registers per thread of the widener's warps (the multiplier takes the rest of the register file).
WIDEN_REGS = gl.constexpr(128)
#: Warps of the widener.
WIDEN_WARPS = gl.constexpr(8)
#: The split's scale: ``lo`` holds 16 x the remainder of ``hi`` (e4m3 keeps 3 fraction bits, so the remainder is at
#: most 1/16 of ``hi``'s magnitude and stays in e4m3's normal range for the values that matter).
LO_SCALE = gl.constexpr(16.0)


@gluon.jit
def _split_rows(x, s, hi_smem, lo_smem):
    """x * s (fp32 [H, C], s: [H, 1] powers of two) -> hi = e4m3(x s) into hi_smem, lo = e4m3(16 (x s - hi)) into
    lo_smem."""
    xs = x * s
    hi = xs.to(gl.float8e4nv)
    hi_smem.store(hi)
    lo_smem.store(((xs - hi.to(gl.float32)) * LO_SCALE).to(gl.float8e4nv))


@gluon.jit
def _load_q_split(
    QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi, q_pe, col_l: gl.constexpr,
    BLOCK_H: gl.constexpr, D_HALF: gl.constexpr, D_PE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A piece's q (heads h0 .. h0 + BLOCK_H) split into two e4m3 parts per head: rows [0, BLOCK_H) of q_lo / q_hi /
    q_pe (the latent halves and the rope part) take ``hi``, rows [BLOCK_H, 2 BLOCK_H) take ``lo``. Returns 1 / s per
    head ([BLOCK_H] fp32 in ``col_l``)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.expand_dims(gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout)), 1)
    c_half = gl.expand_dims(gl.arange(0, D_HALF, layout=gl.SliceLayout(0, layout)), 0)
    c_pe = gl.expand_dims(gl.arange(0, D_PE, layout=gl.SliceLayout(0, layout)), 0)
    qn = QN + b64 * stride_qn_b + (h0 + rows) * stride_qn_h
    x_lo = gl.load(qn + c_half).to(gl.float32)
    x_hi = gl.load(qn + D_HALF + c_half).to(gl.float32)
    x_pe = gl.load(QP + b64 * stride_qp_b + (h0 + rows) * stride_qp_h + c_pe).to(gl.float32)
    amax = gl.maximum(gl.maximum(gl.max(gl.abs(x_lo), 1), gl.max(gl.abs(x_hi), 1)), gl.max(gl.abs(x_pe), 1))
    # s = 2^floor(log2(448 / amax)): exact, so x s is exact in fp32 (a zero or non-finite row keeps s = 1)
    e = gl.floor(gl.log2(448.0 / amax))
    s = gl.where((amax > 0) & (e == e) & (gl.abs(e) < 126), gl.exp2(e), gl.full_like(amax, 1.0))
    s2 = gl.expand_dims(s, 1)
    gl.thread_barrier()  # the previous piece's scores have read q
    _split_rows(x_lo, s2, q_lo.slice(0, BLOCK_H, dim=0), q_lo.slice(BLOCK_H, BLOCK_H, dim=0))
    _split_rows(x_hi, s2, q_hi.slice(0, BLOCK_H, dim=0), q_hi.slice(BLOCK_H, BLOCK_H, dim=0))
    _split_rows(x_pe, s2, q_pe.slice(0, BLOCK_H, dim=0), q_pe.slice(BLOCK_H, BLOCK_H, dim=0))
    fence_async_shared()
    gl.thread_barrier()
    return gl.convert_layout(1.0 / s, col_l)


@gluon.jit
def _scores8(kv_lo, kv_hi, kv_pe, stage, q_lo, q_hi, q_pe, s_zero):
    """S2^T [BLOCK_N, 2H] = K . [hi | lo]^T over the fp8 stage's latent halves and rope part: three fp8 wgmma
    groups, issued (not waited for), each into an accumulator of its own (see :func:`_wait_scores`)."""
    a = warpgroup_mma(kv_lo.index(stage), q_lo.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    b = warpgroup_mma(kv_hi.index(stage), q_hi.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    c = warpgroup_mma(kv_pe.index(stage), q_pe.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return a, b, c


@gluon.jit
def _wait_scores(s, n: gl.constexpr):
    """The three parts of :func:`_scores8` once at most ``n`` wgmma groups are in flight, added in fp32. An fp8
    wgmma accumulates in less than fp32 precision on Hopper; one chain over the 576 columns doubled the decode's
    error (3.4-3.6e-3 against 1.7e-3, H100), three chains of 256 / 256 / 64 columns keep it at 1.9-2.2e-3 for 1%
    of the time (promoting after every instruction, ``max_num_imprecise_acc=32``, gave 1.7e-3 at 1.6x the time)."""
    a, b, c = warpgroup_mma_wait(num_outstanding=n, deps=s)
    return a + b + c


@gluon.jit
def _combine(s2, acc_layout: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr):
    """S^T s [BLOCK_N, H] = S_hi + S_lo / 16 from S2^T [BLOCK_N, 2H] (columns: H ``hi`` then H ``lo``; the 1 / s is
    in the softmax's per-head scale). Each thread holds column c and c + H of a row, so the split moves no data: its
    halves are ``acc_layout``."""
    parts = gl.permute(gl.reshape(s2, [BLOCK_N, 2, BLOCK_H]), (0, 2, 1))
    s_hi, s_lo = gl.split(parts)
    return gl.convert_layout(s_hi, acc_layout) + gl.convert_layout(s_lo, acc_layout) * (1.0 / LO_SCALE)


@gluon.jit
def _widener(
    SL, WORK, kv_lo, kv_hi, w_lo, w_hi, bars, full, empty,
    D_CKV: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """Worker partition: every tile of this program's pieces, as it lands, its latent halves widened into buffer
    ``it % 2`` once the multiplier has freed it (``empty``), then handed over (``full``)."""
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
            mbarrier.wait(empty.index(buf), ((it // 2) & 1) ^ 1)  # the P @ V of tile it - 2 is done
            valid = end - start - i * BLOCK_N
            _widen(kv_lo.index(stage), w_lo.index(buf), valid, BLOCK_N, D_HALF, NW)
            _widen(kv_hi.index(stage), w_hi.index(buf), valid, BLOCK_N, D_HALF, NW)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(full.index(buf), count=1)
            it += 1
        s_b = e_b


@gluon.jit
def _tile(
    s, m_i, l_i, o_lo, o_hi, rows_n, valid, qk_h, p_smem, w_lo, w_hi, kv_lo, kv_hi, kv_pe, q_lo, q_hi,
    q_pe, s_zero, bars, full, empty, it, refill, has_next, desc_c, desc_pe, PT_row, n_next, end,
    acc_layout: gl.constexpr, PAGE_SIZE: gl.constexpr, D_HALF: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_H: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One tile of the multiplier (its scores ``s`` done): softmax, its stage refilled with the tile at ``n_next``
    (when ``refill``) once the widener has read it, ``P @ V`` over widened buffer ``it % 2``, the next tile's scores
    queued behind it (when ``has_next``), the buffer handed back once ``P @ V`` is done. Returns the next tile's
    scores (done), the running max and sum and the output accumulators."""
    buf = it % 2
    alpha_o, m_i, l_i = _softmax_t(_combine(s, acc_layout, BLOCK_N, BLOCK_H), m_i, l_i, rows_n, valid, qk_h,
                                   p_smem)  # fmt: skip
    mbarrier.wait(full.index(buf), (it // 2) & 1)  # widened: the widener is done with the stage too
    _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, it % STAGES, PT_row, n_next, end, refill, PAGE_SIZE,
                D_HALF)  # fmt: skip
    pv_lo = warpgroup_mma(w_lo.index(buf).permute((1, 0)), p_smem, o_lo * alpha_o, is_async=True)
    pv_hi = warpgroup_mma(w_hi.index(buf).permute((1, 0)), p_smem, o_hi * alpha_o, is_async=True)
    if has_next:
        nxt = (it + 1) % STAGES
        mbarrier.wait(bars.index(nxt), ((it + 1) // STAGES) & 1)
        s = _scores8(kv_lo, kv_hi, kv_pe, nxt, q_lo, q_hi, q_pe, s_zero)
        o_lo, o_hi = warpgroup_mma_wait(num_outstanding=3, deps=(pv_lo, pv_hi))
        gl.thread_barrier()  # every multiplier warp's P @ V is done: the buffer is free
        mbarrier.arrive(empty.index(buf), count=1)
        s = _wait_scores(s, 0)
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
    """Default partition: the plan walk, TMA issue, the products, the outputs."""
    D_HALF: gl.constexpr = D_CKV // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_H, 16]
    )
    s2_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 2 * BLOCK_H, 32]
    )
    col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    rows_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    s_zero = gl.zeros([BLOCK_N, 2 * BLOCK_H], gl.float32, layout=s2_layout)
    h0 = gl.program_id(0) * BLOCK_H
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)
    it = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            PT_row = PT + b64 * stride_pt_b
            inv_s = _load_q_split(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi,
                                  q_pe, col_l, BLOCK_H, D_HALF, D_PE, num_warps)  # fmt: skip
            qk_h = gl.expand_dims(inv_s * qk_scale, 0)  # the softmax's scale per head [1, H], 1 / s folded in
            m_i, l_i, o_lo, o_hi = _fresh_state_t(acc_layout, BLOCK_H, D_HALF)
            nt = gl.cdiv(end - start, BLOCK_N)
            for j in gl.static_range(STAGES):  # every stage in flight
                _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, (it + j) % STAGES, PT_row,
                            start + j * BLOCK_N, end, j < nt, PAGE_SIZE, D_HALF)  # fmt: skip
            mbarrier.wait(bars.index(it % STAGES), (it // STAGES) & 1)
            s = _scores8(kv_lo, kv_hi, kv_pe, it % STAGES, q_lo, q_hi, q_pe, s_zero)
            s = _wait_scores(s, 0)
            for i in range(nt):  # s: tile i's scores, done
                n0 = start + i * BLOCK_N
                s, m_i, l_i, o_lo, o_hi = _tile(
                    s, m_i, l_i, o_lo, o_hi, rows_n, end - n0, qk_h, p_smem, w_lo, w_hi, kv_lo, kv_hi,
                    kv_pe, q_lo, q_hi, q_pe, s_zero, bars, full, empty, it, i + STAGES < nt, i + 1 < nt, desc_c,
                    desc_pe, PT_row, n0 + STAGES * BLOCK_N, end, acc_layout, PAGE_SIZE, D_HALF, BLOCK_N, BLOCK_H,
                    STAGES,
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
    ``num_reqs`` unused)."""
    gl.static_assert(MERGE == 0, "the fp8 kernel leaves every split request to the merge kernel")
    _pdl_enter(PDL)  # the widener warps start at the partition below, after this wait (and wait again themselves)
    D_HALF: gl.constexpr = D_CKV // 2
    F8: gl.constexpr = gl.float8e4nv
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_HALF], F8)
    q_lo = gl.allocate_shared_memory(F8, [2 * BLOCK_H, D_HALF], q_layout)
    q_hi = gl.allocate_shared_memory(F8, [2 * BLOCK_H, D_HALF], q_layout)
    q_pe = gl.allocate_shared_memory(F8, [2 * BLOCK_H, D_PE], gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_PE], F8))
    kv_lo = gl.allocate_shared_memory(desc_c.dtype, [STAGES, BLOCK_N, D_HALF], desc_c.layout)
    kv_hi = gl.allocate_shared_memory(desc_c.dtype, [STAGES, BLOCK_N, D_HALF], desc_c.layout)
    kv_pe = gl.allocate_shared_memory(desc_c.dtype, [STAGES, BLOCK_N, D_PE], desc_pe.layout)
    CDT: gl.constexpr = gl.float16
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
            (_widener, (SL, WORK, kv_lo, kv_hi, w_lo, w_hi, bars, full, empty, D_CKV, BLOCK_N, STAGES, PDL)),
        ],
        [WIDEN_WARPS],
        [WIDEN_REGS],
    )  # fmt: skip
