"""Triton kernels for sparse absorbed-MLA decode (split over the selected entries, then a log-sum-exp merge).

Only ``@triton.jit`` code lives here; the launcher is :mod:`backends.kernels.sparse.sparse_mla_decode`.

Layout: ``kv[S, D_CKV + D_PE]`` (one layer's latent rows by device location; the first ``D_CKV`` values are the
key-nope part and the value, the last ``D_PE`` the rope key); ``locs[T, K]`` the device locations token ``t``
attends to, ``-1`` = masked. Scores are ``(q_nope . ckv + q_pe . kpe) * sm_scale``; the kernels work in base 2
(``qk_scale = sm_scale * log2(e)``) and store natural-log LSEs.

Stage 1, grid ``(head_blocks, num_splits, T)``: program ``(h, s, t)`` runs an online softmax over entries
``[s * split_len, min((s + 1) * split_len, K))`` of token ``t`` for ``BLOCK_H`` heads. Each KV tile (``BLOCK_N``
gathered rows) is loaded once and used by all heads of the block; the head block varies fastest in the grid,
so the programs that gather the same rows run together (L2 hits). With one split the program writes the
final output; otherwise a normalized partial output and its LSE (``-inf`` for a piece without valid entries).
Stage 2, grid ``(T, cdiv(H, BLOCK_HM), D_CKV // BLOCK_DV)``: combines the pieces with their LSEs; a token
without any valid entry gets zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.mla_decode.mla_decode_kernels import _mm, _mm_acc

LOG2E = 1.4426950408889634  # for the launcher (qk_scale = sm_scale * LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


# Scalars that change with the batch are not specialized: a new token count never recompiles (CUDA graphs).
@triton.jit(do_not_specialize=["H", "K", "split_len"])
def _sparse_decode_stage1_kernel(
    QN,
    QP,
    KV,
    LOCS,
    PO,
    PL,
    OUT,
    qk_scale,
    out_scale,
    stride_qn_t,
    stride_qn_h,
    stride_qp_t,
    stride_qp_h,
    stride_kv,
    stride_loc_t,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    stride_pl_s,
    stride_o_t,
    stride_o_h,
    H,
    K,
    split_len,
    D_CKV: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # more than one split: write partials (else the final output)
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,  # an fp8 cache: widened to q's dtype per tile, out_scale (its scale) on the output
):
    pid_h = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_d = tl.arange(0, D_CKV)
    offs_pe = tl.arange(0, D_PE)
    if KV_FP8:
        dt: tl.constexpr = QN.dtype.element_ty
    else:
        dt: tl.constexpr = KV.dtype.element_ty
    q = tl.load(
        QN + t * stride_qn_t + offs_h[:, None] * stride_qn_h + offs_d[None, :], mask=mask_h[:, None], other=0.0
    ).to(dt)
    qpe = tl.load(
        QP + t * stride_qp_t + offs_h[:, None] * stride_qp_h + offs_pe[None, :], mask=mask_h[:, None], other=0.0
    ).to(dt)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D_CKV], dtype=tl.float32)
    lo = pid_s * split_len
    hi = tl.minimum(lo + split_len, K)
    loc_row = LOCS + t * stride_loc_t
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        loc = tl.load(loc_row + offs_n, mask=offs_n < hi, other=-1)
        valid = loc >= 0
        row = loc.to(tl.int64) * stride_kv
        kv = tl.load(KV + row[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        kpe = tl.load(KV + row[:, None] + D_CKV + offs_pe[None, :], mask=valid[:, None], other=0.0)
        kv = kv.to(dt)
        kpe = kpe.to(dt)
        qk = _mm(q, tl.trans(kv), PREC, UPCAST)
        qk = _mm_acc(qpe, tl.trans(kpe), qk, PREC, UPCAST)
        qk = tl.where(valid[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid entry yet: keep everything at 0
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(qk - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _mm_acc(p.to(dt), kv, acc * alpha[:, None], PREC, UPCAST)
        m_i = m_new

    has = l_i > 0.0
    o = acc * (out_scale / tl.where(has, l_i, 1.0))[:, None]
    if SPLIT:
        po = PO + t * stride_po_t + offs_h[:, None] * stride_po_h + pid_s * stride_po_s + offs_d[None, :]
        tl.store(po, o, mask=mask_h[:, None])
        lse = tl.where(has, (m_i + tl.math.log2(tl.where(has, l_i, 1.0))) * _LN2, float("-inf"))
        tl.store(PL + t * stride_pl_t + offs_h * stride_pl_h + pid_s * stride_pl_s, lse, mask=mask_h)
    else:
        o_ptrs = OUT + t * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :]
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=mask_h[:, None])


@triton.jit(do_not_specialize=["H", "num_splits"])
def _sparse_decode_merge_kernel(
    PO,
    PL,
    OUT,
    stride_po_t,
    stride_po_h,
    stride_po_s,
    stride_pl_t,
    stride_pl_h,
    stride_pl_s,
    stride_o_t,
    stride_o_h,
    H,
    num_splits,
    BLOCK_S: tl.constexpr,  # >= num_splits
    BLOCK_HM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """grid (T, cdiv(H, BLOCK_HM), D_CKV // BLOCK_DV): out = sum_s exp(lse_s) o_s / sum_s exp(lse_s)."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_HM + tl.arange(0, BLOCK_HM)
    offs_d = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_s = tl.arange(0, BLOCK_S)
    mask_h = offs_h < H
    mask_sh = (offs_s[:, None] < num_splits) & mask_h[None, :]
    lse = tl.load(
        PL + t * stride_pl_t + offs_s[:, None] * stride_pl_s + offs_h[None, :] * stride_pl_h,
        mask=mask_sh,
        other=float("-inf"),
    )  # [BLOCK_S, BLOCK_HM]
    m = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(m == float("-inf"), 0.0, m)[None, :])  # 0 for empty pieces
    denom = tl.sum(w, 0)
    o = tl.load(
        PO
        + t * stride_po_t
        + offs_s[:, None, None] * stride_po_s
        + offs_h[None, :, None] * stride_po_h
        + offs_d[None, None, :],
        mask=mask_sh[:, :, None],
        other=0.0,
    )  # [BLOCK_S, BLOCK_HM, BLOCK_DV]
    res = tl.sum(w[:, :, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_ptrs = OUT + t * stride_o_t + offs_h[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o_ptrs, res.to(OUT.dtype.element_ty), mask=mask_h[:, None])
