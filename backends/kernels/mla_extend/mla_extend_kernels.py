"""Triton kernel for absorbed-MLA extend / prefill over a paged latent KV cache (causal, bottom-right).

Only ``@triton.jit`` code lives here; the launcher is :mod:`backends.kernels.mla_extend.mla_extend`.

A tile holds ``BLOCK_M`` query rows = ``BLOCK_M // BLOCK_H`` consecutive new tokens of one request times
``BLOCK_H`` heads (head fastest), so every KV tile loaded serves all the heads of the group; with few new
tokens per request (speculative verify, short chunks) the rows are still filled by heads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.mla_decode.mla_decode_kernels import _mla_attn_loop


@triton.jit(do_not_specialize=["H", "num_m_tiles"])
def _mla_extend_kernel(
    QN,
    QP,
    KV,
    PT,
    QO,
    SL,
    OUT,
    qk_scale,
    out_scale,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_kv_p,
    stride_kv_t,
    stride_pt_b,
    stride_o_t,
    stride_o_h,
    H,
    num_m_tiles,
    PAGE_SIZE: tl.constexpr,
    D_CKV: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """grid (cdiv(H, BLOCK_H), num_m_tiles, B). Head groups vary fastest, then query tiles, so programs that
    read the same KV run together (L2 hits); a request's tiles are visited last-first (longest first).
    KV_FP8: an fp8 cache, widened to q's dtype per tile; ``out_scale`` (its scale) rescales the output."""
    if KV_FP8:
        CDT: tl.constexpr = QN.dtype.element_ty
    else:
        CDT: tl.constexpr = KV.dtype.element_ty
    TOK: tl.constexpr = BLOCK_M // BLOCK_H
    pid_h = tl.program_id(0)
    pid_m = num_m_tiles - 1 - tl.program_id(1)
    pid_b = tl.program_id(2)

    q_start = tl.load(QO + pid_b)
    n_q = tl.load(QO + pid_b + 1) - q_start
    seq_len = tl.load(SL + pid_b)
    prefix = tl.maximum(seq_len - n_q, 0)
    tok0 = pid_m * TOK

    if tok0 < n_q:
        rows = tl.arange(0, BLOCK_M)
        tok = tok0 + rows // BLOCK_H
        head = pid_h * BLOCK_H + rows % BLOCK_H
        row_mask = (tok < n_q) & (head < H)
        t_abs = (q_start + tok).to(tl.int64)
        offs_d = tl.arange(0, D_CKV)
        offs_pe = tl.arange(0, D_PE)
        q = tl.load(
            QN + t_abs[:, None] * stride_qn_t + head[:, None] * stride_qn_h + offs_d[None, :],
            mask=row_mask[:, None],
            other=0.0,
        ).to(CDT)
        qpe = tl.load(
            QP + t_abs[:, None] * stride_qp_t + head[:, None] * stride_qp_h + offs_pe[None, :],
            mask=row_mask[:, None],
            other=0.0,
        ).to(CDT)

        limit = prefix + tok  # inclusive causal limit of each row
        tok_last = tl.minimum(tok0 + TOK, n_q) - 1
        kv_end = tl.minimum(prefix + tok_last + 1, seq_len)
        # Keys below prefix + tok0 + 1 are visible to every row of the tile: no masks there.
        full_end = ((prefix + tok0 + 1) // BLOCK_N) * BLOCK_N
        full_end = tl.minimum(full_end, kv_end)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_CKV], dtype=tl.float32)
        PT_row = PT + pid_b.to(tl.int64) * stride_pt_b
        m_i, l_i, acc = _mla_attn_loop(
            q,
            qpe,
            m_i,
            l_i,
            acc,
            KV,
            PT_row,
            stride_kv_p,
            stride_kv_t,
            0,
            full_end,
            limit,
            qk_scale,
            PAGE_SIZE,
            BLOCK_N,
            D_CKV,
            D_PE,
            MASK_N=False,
            CAUSAL=False,
            PREC=PREC,
            UPCAST=UPCAST,
        )
        m_i, l_i, acc = _mla_attn_loop(
            q,
            qpe,
            m_i,
            l_i,
            acc,
            KV,
            PT_row,
            stride_kv_p,
            stride_kv_t,
            full_end,
            kv_end,
            limit,
            qk_scale,
            PAGE_SIZE,
            BLOCK_N,
            D_CKV,
            D_PE,
            MASK_N=True,
            CAUSAL=True,
            PREC=PREC,
            UPCAST=UPCAST,
        )

        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc * (out_scale / l_safe)[:, None]
        o_ptrs = OUT + t_abs[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :]
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_mask[:, None])
