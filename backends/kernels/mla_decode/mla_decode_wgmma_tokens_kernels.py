"""Gluon stage-1 kernel of the absorbed-MLA decode for 16 or 32 heads per GPU (Hopper), bf16 / fp16 cache.

Why tokens as the matrix dimension: a wgmma instruction multiplies 64 rows, and 16 or 32 heads are too few rows
for it (the Triton kernel falls back to ``mma.sync`` there). Transposed, both products have 64-row operands taken
straight from the KV tile in shared memory, and the heads are the narrow ``N`` side (16 or 32):

* scores ``S^T [64 tokens, H] = K [64, 576] . q^T [576, H]`` (A = the tile, B = q in shared memory);
* output ``O^T [512, H] += V^T [512, 64] . P^T [64, H]`` (A = the same tile read transposed, B = ``P^T`` written
  to shared memory after the softmax, which runs down the token axis).

One warpgroup per program (the accumulators are small: ``O^T`` is 2 x [256, H] floats). The plan (which requests
and token ranges a program handles) comes from the plan kernel, as for the 64-head kernel
(:mod:`backends.kernels.mla_decode.mla_decode_wgmma_kernels`), and the outputs are the same (finished requests to
``out``, split pieces to workspace slots), so the Triton merge combines them.

The products' helpers (scores, softmax down the tokens, the output write) are shared with the fp8 kernel
(:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_kernels`), which widens each fp8 tile to fp16 in warps of its
own. Shared memory at 16 heads: 18 KiB of q + 2 x 72 KiB of KV tiles.

Measured on an H100 (docs/kernels.md, "Tokens as the matrix rows"): bf16 at 16 / 32 heads 1.07-1.22x the
Triton stage 1's speed, 93-97% of copy bandwidth at long contexts (173 registers at 16 heads, no spills).
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

from backends.kernels.mla_decode.mla_decode_wgmma_kernels import (
    _issue_next,
    _load_q_piece,
    _merge_chunk_ends,
    _pdl_enter,
    _ready,
    _request_span,
    _work_row,
)


@gluon.constexpr_function
def _tokens_acc_layout(heads, num_warps):
    """The tokens-as-rows kernels' accumulator layout, one for S^T [64 tokens, H] and O^T [256, H]: per-head vectors
    (its dim-0 slice) need no conversion between them."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, heads, 16])


@gluon.jit
def _store_t(
    o, cols0, b64, split, slot, slot_div, h0, PO, OUT, stride_po_b, stride_po_h, stride_po_s, stride_o_b,
    stride_o_h, ROWS: gl.constexpr, BLOCK_H: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """o^T [ROWS latent columns, BLOCK_H heads] (normalized) -> OUT (a finished request) or a workspace slot (a
    split piece), straight from the accumulator layout (8 lanes write 8 consecutive columns of a head; a layout
    conversion would take 16 KiB of shared memory, which the fp8 kernel's buffers leave no room for)."""
    layout: gl.constexpr = o.type.layout
    cols = cols0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, layout))
    if split:
        base = PO + (slot // slot_div).to(gl.int64) * stride_po_b + (slot % slot_div) * stride_po_s
        gl.store(base + gl.expand_dims(heads, 0) * stride_po_h + gl.expand_dims(cols, 1), o)
    else:
        ptrs = OUT + b64 * stride_o_b + gl.expand_dims(heads, 0) * stride_o_h + gl.expand_dims(cols, 1)
        gl.store(ptrs, o.to(OUT.dtype.element_ty))


@gluon.jit
def _scores_t(a_lo, a_hi, a_pe, q_lo, q_hi, q_pe, s_zero):
    """S^T = K . q^T over the latent halves and the rope part of a tile: three wgmma groups, issued (not waited
    for)."""
    s = warpgroup_mma(a_lo, q_lo.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma(a_hi, q_hi.permute((1, 0)), s, is_async=True)
    return warpgroup_mma(a_pe, q_pe.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_t(s, m_i, l_i, rows_n, valid, qk_scale, p_smem):
    """Online softmax down the token axis of one tile's S^T (rows >= valid masked; ``qk_scale`` a scalar or [1, H]
    per head): P^T into p_smem (fenced, every warp done), the output rescale factor [1, H] and the new running max
    and sum."""
    s = gl.where(gl.expand_dims(rows_n < valid, 1), s * qk_scale, gl.full_like(s, float("-inf")))
    m_new = gl.maximum(m_i, gl.max(s, 0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 0))
    l_i = l_i * alpha + gl.sum(p, 0)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    gl.thread_barrier()
    return gl.expand_dims(alpha, 0), m_new, l_i


@gluon.jit
def _finish_t(
    o_lo, o_hi, m_i, l_i, out_scale, b64, split, slot, slot_div, h0, PO, PL, OUT, stride_po_b, stride_po_h,
    stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, D_HALF: gl.constexpr,
    BLOCK_H: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A piece's normalized output (and, for a split piece, its log-sum-exp) written out."""
    inv = gl.expand_dims(out_scale / l_i, 0)
    _store_t(o_lo * inv, 0, b64, split, slot, slot_div, h0, PO, OUT, stride_po_b, stride_po_h, stride_po_s,
             stride_o_b, stride_o_h, D_HALF, BLOCK_H, num_warps)  # fmt: skip
    _store_t(o_hi * inv, D_HALF, b64, split, slot, slot_div, h0, PO, OUT, stride_po_b, stride_po_h, stride_po_s,
             stride_o_b, stride_o_h, D_HALF, BLOCK_H, num_warps)  # fmt: skip
    if split:
        lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
        heads = h0 + gl.arange(0, BLOCK_H, layout=m_i.type.layout)
        gl.store(PL + (slot // slot_div).to(gl.int64) * stride_pl_b + heads * stride_pl_h
                 + (slot % slot_div) * stride_pl_s, lse)  # fmt: skip


@gluon.jit
def _start_piece_t(
    QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi, q_pe, acc_layout: gl.constexpr,
    BLOCK_H: gl.constexpr, D_HALF: gl.constexpr, D_PE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A piece's start in the tokens-as-rows kernels: request b64's q for heads h0 .. h0 + BLOCK_H into shared
    memory, and fresh per-head running max and sum and output accumulators O^T [D_HALF, BLOCK_H] in ``acc_layout``
    (the layout of S^T). Returns (m_i, l_i, o_lo, o_hi)."""
    _load_q_piece(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi, q_pe, BLOCK_H,
                  D_HALF, D_PE, num_warps)  # fmt: skip
    return _fresh_state_t(acc_layout, BLOCK_H, D_HALF)


@gluon.jit
def _fresh_state_t(acc_layout: gl.constexpr, BLOCK_H: gl.constexpr, D_HALF: gl.constexpr):
    """A piece's fresh per-head running max and sum and output accumulators O^T [D_HALF, BLOCK_H] in ``acc_layout``
    (the layout of S^T): (m_i, l_i, o_lo, o_hi)."""
    col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=col_l)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=col_l)
    o_lo = gl.zeros([D_HALF, BLOCK_H], gl.float32, layout=acc_layout)
    o_hi = gl.zeros([D_HALF, BLOCK_H], gl.float32, layout=acc_layout)
    return m_i, l_i, o_lo, o_hi


@gluon.jit
def _decode_piece_tokens(
    QN, QP, desc_c, desc_pe, PT_row, PO, PL, OUT, q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, p_smem, bars, it,
    qk_scale, out_scale, b64, start, end, split, slot, slot_div, h0,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Tokens [start, end) of request b64 for heads h0 .. h0 + BLOCK_H. ``it`` counts the tiles this program has
    consumed so far (tile k of the piece lives in stage (it0 + k) % STAGES); returns the updated count."""
    D_HALF: gl.constexpr = D_CKV // 2
    acc_layout: gl.constexpr = _tokens_acc_layout(BLOCK_H, num_warps)
    m_i, l_i, o_lo, o_hi = _start_piece_t(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo,
                                          q_hi, q_pe, acc_layout, BLOCK_H, D_HALF, D_PE, num_warps)  # fmt: skip
    s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=acc_layout)
    rows_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))

    nt = gl.cdiv(end - start, BLOCK_N)
    for j in gl.static_range(STAGES - 1):  # the first tiles in flight
        _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, (it + j) % STAGES, PT_row, start + j * BLOCK_N,
                    end, j < nt, PAGE_SIZE, D_HALF)  # fmt: skip
    for i in range(nt):
        stage = it % STAGES
        n0 = start + i * BLOCK_N
        mbarrier.wait(bars.index(stage), (it // STAGES) & 1)
        gl.thread_barrier()  # every warp is done with the previous tile: its stage can be refilled
        _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, (it + STAGES - 1) % STAGES, PT_row,
                    n0 + (STAGES - 1) * BLOCK_N, end, i + STAGES - 1 < nt, PAGE_SIZE, D_HALF)  # fmt: skip
        a_lo = kv_lo.index(stage)
        a_hi = kv_hi.index(stage)
        _ready(a_lo, a_hi, end - n0, BLOCK_N, D_HALF, num_warps)
        s = _scores_t(a_lo, a_hi, kv_pe.index(stage), q_lo, q_hi, q_pe, s_zero)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        alpha_o, m_i, l_i = _softmax_t(s, m_i, l_i, rows_n, end - n0, qk_scale, p_smem)
        o_lo = warpgroup_mma(a_lo.permute((1, 0)), p_smem, o_lo * alpha_o, is_async=True)
        o_hi = warpgroup_mma(a_hi.permute((1, 0)), p_smem, o_hi * alpha_o, is_async=True)
        o_lo, o_hi = warpgroup_mma_wait(num_outstanding=0, deps=(o_lo, o_hi))
        it += 1

    _finish_t(o_lo, o_hi, m_i, l_i, out_scale, b64, split, slot, slot_div, h0, PO, PL, OUT, stride_po_b,
              stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, D_HALF,
              BLOCK_H, num_warps)  # fmt: skip
    return it


@gluon.jit(do_not_specialize=["slot_div", "num_reqs"])
def _mla_decode_wgmma_tokens_kernel(
    QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, num_reqs,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MERGE: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """grid (H // BLOCK_H, programs): program (h, p) runs the pieces of work row p for heads h * BLOCK_H .. +
    BLOCK_H (see the 64-head kernel: same plan rows, same outputs)."""
    _pdl_enter(PDL)
    D_HALF: gl.constexpr = D_CKV // 2
    h0 = gl.program_id(0) * BLOCK_H
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)

    CDT: gl.constexpr = desc_c.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_HALF], CDT)
    q_lo = gl.allocate_shared_memory(CDT, [BLOCK_H, D_HALF], q_layout)
    q_hi = gl.allocate_shared_memory(CDT, [BLOCK_H, D_HALF], q_layout)
    q_pe = gl.allocate_shared_memory(CDT, [BLOCK_H, D_PE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_PE], CDT))
    kv_lo = gl.allocate_shared_memory(CDT, [STAGES, BLOCK_N, D_HALF], desc_c.layout)
    kv_hi = gl.allocate_shared_memory(CDT, [STAGES, BLOCK_N, D_HALF], desc_c.layout)
    kv_pe = gl.allocate_shared_memory(CDT, [STAGES, BLOCK_N, D_PE], desc_pe.layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], CDT)
    p_smem = gl.allocate_shared_memory(CDT, [BLOCK_N, BLOCK_H], p_layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)

    it = 0
    for b in range(b0, b_end):  # the requests that overlap this program's chunk
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            it = _decode_piece_tokens(
                QN, QP, desc_c, desc_pe, PT + b64 * stride_pt_b, PO, PL, OUT, q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe,
                p_smem, bars, it, qk_scale, out_scale, b64, start, end, split,
                slot0 + (pid_p - p0), slot_div, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_po_b,
                stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, PAGE_SIZE,
                D_CKV, D_PE, BLOCK_H, BLOCK_N, STAGES, num_warps,
            )  # fmt: skip
        slot0 += pieces
        s_b = e_b
    if MERGE > 0:  # the last program to finish a split request's pieces merges them
        _merge_chunk_ends(WORK, SL, PO, PL, OUT, s_b, slot0, h0, slot_div, num_reqs, stride_po_b, stride_po_h,
                          stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, BLOCK_H, BLOCK_N,
                          D_CKV, MERGE, num_warps)  # fmt: skip
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
