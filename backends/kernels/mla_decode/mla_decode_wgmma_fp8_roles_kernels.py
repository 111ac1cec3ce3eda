"""Gluon stage-1 kernel of the absorbed-MLA decode over an fp8 (e4m3) cache, 32 heads per program (Hopper), with a
tile's work split by role between two warpgroups instead of by heads.

The fp8 kernel (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_kernels`) runs one multiplier warpgroup per 16
heads, each doing a tile's scores, softmax and ``P @ V`` for its heads, with tokens as the matrix rows. At 32 heads that
reads each tile's operands twice from shared memory in products half as wide (``m64n32`` scores, ``m64n16``
``P @ V``, bound by reading their A operand), and its softmax reduces down the token rows, across the warpgroup's
four warps. Here:

* **the scorer** (the default partition, 4 warps): per piece, q split into two e4m3 parts per head (``q s = hi +
  lo / 16``, as the fp8 kernel), written as the 64 rows of the scores' A operand with each head's two parts 8 rows
  apart, so that one accumulator thread holds both; per tile, ``S2 = [hi | lo] K^T`` (``m64n64k32`` fp8 products
  straight from the landed stage, the heads as the rows), the next tile's scores issued before this tile's softmax
  (they run on the tensor cores under it), the two parts added in fp32 without moving data, the softmax along each
  head's row (a quad's shuffles, no cross-warp reduction); ``P^T`` and the per-head rescale factor go to the
  accumulator through a ring of ``PB`` slots; at a piece's end its running max and sum;
* **the accumulator** (a worker, 4 warps): ``O^T [512, 32]`` in its registers (tokens as the rows of ``P @ V``, as
  the fp8 kernel); per tile ``O^T *= alpha``, then ``O^T += V^T P^T`` over the widened tile's parts
  (``m64n32k16``), handing each widened buffer and the ``P`` slot back as its products finish; at a piece's end the
  outputs (as the other kernels: finished requests to ``out``, split pieces to workspace slots for the merge
  kernel);
* **the widener** (a worker, 4 warps): the fp8 kernel's :func:`_widener` (TMA loads of the fp8 stages, each tile's
  latent halves widened to fp16 in ``PARTS`` row parts into a ring of ``WIDENED`` buffers).

All three walk the same plan rows and pieces, so they count the same tiles. Shared memory: 36 KiB of split q +
``STAGES`` x 36 KiB of fp8 stages + ``WIDENED`` x 64 / ``PARTS`` KiB of widened latent + ``PB`` x 4 KiB of ``P^T``
(3 stages, 2 half-tile buffers, 2 slots: 217 KiB).

H100, graph replays, fp8 at 32 heads (docs/kernels.md), us against the fp8 kernel's two multipliers: 64 x
32768 497-512 against 630.5 (1.66-1.71x the bf16 cache's 848.4), 128 x varied 8192 280-287 against 345.4, 64 x
4096 118-119 against 126.5, 16 x 16384 93.8 against 103.2, 8 x 32768 92.3 against 101.1; 1-1.5 us slower where a
program has few tiles (8 x 2048 31.7 against 30.3, 16 x 4096 49.4 against 48.2): the default from
``FP8_ROLES_MIN_BATCH`` requests (the launcher knows no lengths). Error against float32 1.9-2.2e-3 (bf16: 1.7e-3).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

from backends.kernels.mla_decode.mla_decode_wgmma_fp8_kernels import (
    LO_SCALE,
    _done_with,
    _load_q_scaled,
    _release_parts,
    _wait_scores,
    _widener,
    _widener_barriers,
    _widener_rings,
)
from backends.kernels.mla_decode.mla_decode_wgmma_kernels import _hand_over, _pdl_enter, _request_span, _work_row
from backends.kernels.mla_decode.mla_decode_wgmma_tokens_kernels import _finish_t, _tokens_acc_layout

#: Warps of the widener and registers per thread of the widener's and the accumulator's warps (the scorer, the
#: default partition, takes the rest of the register file).
WIDEN_WARPS = gl.constexpr(4)
WIDEN_REGS = gl.constexpr(56)
ACC_REGS = gl.constexpr(232)


@gluon.constexpr_function
def _heads_layout(heads, tokens):
    """The scores [H heads, 64 tokens] as the scorer holds them once the two parts of each head are added: warp w,
    lane l holds head 8 w + l // 4 and tokens 2 (l % 4) + {0, 1} + 8 j (the wgmma accumulator's layout without its
    ``row + 8`` register bit, which held the other part)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1]] + [[0, 8 << j] for j in range((tokens // 8).bit_length() - 1)],
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[8 << j, 0] for j in range((heads // 8).bit_length() - 1)],
        block_bases=[],
        shape=[heads, tokens],
    )


@gluon.jit
def _load_q_rows(
    QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi, q_pe, row_l: gl.constexpr,
    BLOCK_H: gl.constexpr, D_HALF: gl.constexpr, D_PE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A piece's q split into two e4m3 parts per head (``q s = hi + lo / 16``, as the fp8 kernel's
    ``_load_q_split``), written as the 2H rows of the scores' A operand: row 16 w + 8 p + i holds part p (0: hi, 1:
    lo) of head 8 w + i, so that one thread of the wgmma accumulator holds both parts of a head (its rows r and
    r + 8). Returns each row's weight in ``row_l``: 1 / s for ``hi``, 1 / (16 s) for ``lo``."""
    x_lo, x_hi, x_pe, s = _load_q_scaled(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
                                         BLOCK_H, D_HALF, D_PE, num_warps)  # fmt: skip
    s2 = gl.expand_dims(s, 1)
    gl.thread_barrier()  # the previous piece's scores have read q
    _store_parts(x_lo, s2, q_lo, BLOCK_H, D_HALF)
    _store_parts(x_hi, s2, q_hi, BLOCK_H, D_HALF)
    _store_parts(x_pe, s2, q_pe, BLOCK_H, D_PE)
    fence_async_shared()
    gl.thread_barrier()
    w = gl.join(gl.reshape(1.0 / s, [BLOCK_H // 8, 8]), gl.reshape(1.0 / (LO_SCALE * s), [BLOCK_H // 8, 8]))
    return gl.convert_layout(gl.reshape(gl.permute(w, (0, 2, 1)), [2 * BLOCK_H]), row_l)


@gluon.jit
def _store_parts(xf, s, q_smem, BLOCK_H: gl.constexpr, C: gl.constexpr):
    """xf [H, C] (fp32) times s [H, 1] split into ``hi`` = e4m3(x s) and ``lo`` = e4m3(16 (x s - hi)), stored as
    the rows of q_smem [2H, C] that :func:`_load_q_rows` gives them."""
    xs = xf * s
    hi = xs.to(gl.float8e4nv).to(gl.float32)  # exact in fp32, where the rows are interleaved (not in 8-bit registers)
    lo = (xs - hi) * LO_SCALE
    both = gl.join(gl.reshape(hi, [BLOCK_H // 8, 8, C]), gl.reshape(lo, [BLOCK_H // 8, 8, C]))  # [H / 8, 8, C, 2]
    q_smem.store(gl.reshape(gl.permute(both, (0, 3, 1, 2)), [2 * BLOCK_H, C]).to(gl.float8e4nv))


@gluon.jit
def _scores(q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, stage, s_zero):
    """S2 [2H, 64 tokens] = [hi | lo] . K^T over the fp8 stage: three fp8 wgmma chains (the latent halves and the rope
    part), each into an accumulator of its own, issued (not waited for)."""
    a = warpgroup_mma(q_lo, kv_lo.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    b = warpgroup_mma(q_hi, kv_hi.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    c = warpgroup_mma(q_pe, kv_pe.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    return (a, b, c)


@gluon.jit
def _publish(
    s, w_row, m_i, l_i, valid, qk_scale, p_smem, a_smem, pfull, pempty, it, BLOCK_N: gl.constexpr,
    BLOCK_H: gl.constexpr, PB: gl.constexpr,
):  # fmt: skip
    """Tile ``it``'s softmax along its tokens (its split scores ``s`` [2H, 64] done; ``w_row`` each row's weight)
    into P slot ``it % PB`` once the accumulator has freed it: ``P^T`` and the rescale factor, handed over. Returns
    the running max and sum."""
    heads_l: gl.constexpr = _heads_layout(BLOCK_H, BLOCK_N)
    pb = it % PB
    s = s * gl.expand_dims(w_row, 1)
    hi, lo = gl.split(gl.permute(gl.reshape(s, [BLOCK_H // 8, 2, 8, BLOCK_N]), (0, 2, 3, 1)))
    s = gl.convert_layout(gl.reshape(hi + lo, [BLOCK_H, BLOCK_N]), heads_l)  # no data moves
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, heads_l))
    s = gl.where(gl.expand_dims(cols < valid, 0), s * qk_scale, gl.full_like(s, float("-inf")))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    mbarrier.wait(pempty.index(pb), ((it // PB) & 1) ^ 1)
    p_smem.index(pb).store(gl.permute(p.to(p_smem.dtype), (1, 0)))
    a_smem.index(pb).store(alpha)
    _hand_over(pfull, pb)
    return m_new, l_i


@gluon.jit
def _scorer(
    QN, QP, SL, WORK, qk_scale, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi, q_pe, kv_lo, kv_hi,
    kv_pe, p_smem, a_smem, ml_smem, bars, read, pfull, pempty, fin, fin_empty, D_CKV: gl.constexpr,
    D_PE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PB: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """The default partition: every tile's scores and softmax (see the module docstring)."""
    D_HALF: gl.constexpr = D_CKV // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
    )
    vec_l: gl.constexpr = gl.SliceLayout(1, _heads_layout(BLOCK_H, BLOCK_N))
    s_zero = gl.zeros([2 * BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    h0 = gl.program_id(0) * BLOCK_H
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, gl.program_id(1))
    it = 0
    f = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            w_row = _load_q_rows(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi,
                                 q_pe, gl.SliceLayout(1, s_layout), BLOCK_H, D_HALF, D_PE, num_warps)  # fmt: skip
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=vec_l)
            l_i = gl.zeros([BLOCK_H], gl.float32, layout=vec_l)
            nt = gl.cdiv(end - start, BLOCK_N)
            mbarrier.wait(bars.index(it % STAGES), (it // STAGES) & 1)
            s = _wait_scores(_scores(q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, it % STAGES, s_zero), 0)
            _done_with(read, it % STAGES)
            for i in range(nt):  # s: tile i's scores, done
                valid = end - start - i * BLOCK_N
                if i + 1 < nt:  # the next tile's scores run under this tile's softmax
                    nxt = (it + 1) % STAGES
                    mbarrier.wait(bars.index(nxt), ((it + 1) // STAGES) & 1)
                    s_next = _scores(q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, nxt, s_zero)
                    m_i, l_i = _publish(s, w_row, m_i, l_i, valid, qk_scale, p_smem, a_smem, pfull, pempty, it,
                                        BLOCK_N, BLOCK_H, PB)  # fmt: skip
                    s = _wait_scores(s_next, 0)
                    _done_with(read, nxt)
                else:
                    m_i, l_i = _publish(s, w_row, m_i, l_i, valid, qk_scale, p_smem, a_smem, pfull, pempty, it,
                                        BLOCK_N, BLOCK_H, PB)  # fmt: skip
                it += 1
            mbarrier.wait(fin_empty.index(0), (f & 1) ^ 1)  # the accumulator has read the last piece's max and sum
            ml_smem.index(0).store(m_i)
            ml_smem.index(1).store(l_i)
            _done_with(fin, 0)
            f += 1
        s_b = e_b


@gluon.jit
def _accumulator(
    SL, WORK, PO, PL, OUT, out_scale, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s,
    stride_o_b, stride_o_h, slot_div, w_lo, w_hi, p_smem, a_smem, ml_smem, full, empty, pfull, pempty, fin,
    fin_empty, D_CKV: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, WIDENED: gl.constexpr,
    PARTS: gl.constexpr, PB: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A worker partition: every tile's ``P @ V`` and the outputs (see the module docstring)."""
    _pdl_enter(PDL)
    D_HALF: gl.constexpr = D_CKV // 2
    R: gl.constexpr = BLOCK_N // PARTS
    acc_layout: gl.constexpr = _tokens_acc_layout(BLOCK_H, num_warps)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    h0 = gl.program_id(0) * BLOCK_H
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)
    it = 0
    f = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            o_lo = gl.zeros([D_HALF, BLOCK_H], gl.float32, layout=acc_layout)
            o_hi = gl.zeros([D_HALF, BLOCK_H], gl.float32, layout=acc_layout)
            for _ in range(gl.cdiv(end - start, BLOCK_N)):
                pb = it % PB
                mbarrier.wait(pfull.index(pb), (it // PB) & 1)
                alpha = gl.expand_dims(a_smem.index(pb).load(col_l), 0)
                o_lo = o_lo * alpha
                o_hi = o_hi * alpha
                for h in gl.static_range(PARTS):
                    wt = it * PARTS + h
                    buf = wt % WIDENED
                    mbarrier.wait(full.index(buf), (wt // WIDENED) & 1)
                    p_h = p_smem.index(pb).slice(h * R, R, dim=0)
                    o_lo = warpgroup_mma(w_lo.index(buf).permute((1, 0)), p_h, o_lo, is_async=True)
                    o_hi = warpgroup_mma(w_hi.index(buf).permute((1, 0)), p_h, o_hi, is_async=True)
                o_lo, o_hi = _release_parts(o_lo, o_hi, empty, it, 0, WIDENED, PARTS)
                _done_with(pempty, pb)
                it += 1
            mbarrier.wait(fin.index(0), f & 1)
            m_i = ml_smem.index(0).load(col_l)
            l_i = ml_smem.index(1).load(col_l)
            _done_with(fin_empty, 0)
            b64 = (s_b * 0 + b).to(gl.int64)
            _finish_t(o_lo, o_hi, m_i, l_i, out_scale, b64, split, slot0 + (pid_p - p0), slot_div, h0, PO, PL, OUT,
                      stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b,
                      stride_o_h, D_HALF, BLOCK_H, num_warps)  # fmt: skip
            f += 1
        slot0 += pieces
        s_b = e_b


@gluon.jit(do_not_specialize=["slot_div", "num_reqs"])
def _mla_decode_wgmma_fp8_roles_kernel(
    QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, num_reqs,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WIDENED: gl.constexpr, PARTS: gl.constexpr, PB: gl.constexpr,
    MERGE: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """grid (H // 32, programs), the tokens kernel's arguments over an fp8 cache: the scorer's ``num_warps`` = 4
    warps, then the widener's :data:`WIDEN_WARPS`, then the accumulator's 4; ``STAGES`` fp8 stages, ``WIDENED``
    widened buffers of ``BLOCK_N / PARTS`` rows, ``PB`` slots of ``P^T``. Split requests are all merged by the merge
    kernel (``MERGE`` = 0)."""
    gl.static_assert(MERGE == 0, "the fp8 kernel leaves every split request to the merge kernel")
    gl.static_assert(BLOCK_H == 32, "32 heads per program: the two parts of each are the scores' 64 rows")
    _pdl_enter(PDL)  # the worker warps start at the partition below, after this wait (and wait again themselves)
    D_HALF: gl.constexpr = D_CKV // 2
    F8: gl.constexpr = gl.float8e4nv
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_HALF], F8)
    qpe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, D_PE], F8)
    q_lo = gl.allocate_shared_memory(F8, [2 * BLOCK_H, D_HALF], q_layout)
    q_hi = gl.allocate_shared_memory(F8, [2 * BLOCK_H, D_HALF], q_layout)
    q_pe = gl.allocate_shared_memory(F8, [2 * BLOCK_H, D_PE], qpe_layout)
    kv_lo, kv_hi, kv_pe, w_lo, w_hi = _widener_rings(desc_c, desc_pe, BLOCK_N, STAGES, WIDENED, BLOCK_N // PARTS,
                                                     D_CKV, D_PE)  # fmt: skip
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.float16)
    p_smem = gl.allocate_shared_memory(gl.float16, [PB, BLOCK_N, BLOCK_H], p_layout)
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a row per index
    a_smem = gl.allocate_shared_memory(gl.float32, [PB, BLOCK_H], vec_layout)
    ml_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec_layout)
    bars, read, full, empty = _widener_barriers(STAGES, WIDENED, 1)  # the scorer reads stages, the accumulator buffers
    pfull = gl.allocate_shared_memory(gl.int64, [PB, 1], mbarrier.MBarrierLayout())
    pempty = gl.allocate_shared_memory(gl.int64, [PB, 1], mbarrier.MBarrierLayout())
    fin = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    fin_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(PB):
        mbarrier.init(pfull.index(s), count=1)
        mbarrier.init(pempty.index(s), count=1)
    mbarrier.init(fin.index(0), count=1)
    mbarrier.init(fin_empty.index(0), count=1)

    gl.warp_specialize(
        [
            (_scorer, (
                QN, QP, SL, WORK, qk_scale, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi, q_pe,
                kv_lo, kv_hi, kv_pe, p_smem, a_smem, ml_smem, bars, read, pfull, pempty, fin, fin_empty, D_CKV, D_PE,
                BLOCK_H, BLOCK_N, STAGES, PB, num_warps,
            )),
            (_widener, (desc_c, desc_pe, PT, SL, WORK, stride_pt_b, kv_lo, kv_hi, kv_pe, w_lo, w_hi, bars, read, full,
                        empty, PAGE_SIZE, D_CKV, BLOCK_N, STAGES, WIDENED, PARTS, WIDEN_WARPS, PDL)),
            (_accumulator, (
                SL, WORK, PO, PL, OUT, out_scale, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h,
                stride_pl_s, stride_o_b, stride_o_h, slot_div, w_lo, w_hi, p_smem, a_smem, ml_smem, full, empty,
                pfull, pempty, fin, fin_empty, D_CKV, BLOCK_H, BLOCK_N, WIDENED, PARTS, PB, PDL, num_warps,
            )),
        ],
        [WIDEN_WARPS, num_warps],
        [WIDEN_REGS, ACC_REGS],
    )  # fmt: skip
