"""Triton kernels for absorbed-MLA decode over a paged latent KV cache (split-KV, two stages).

Only ``@triton.jit`` code lives here; the launcher is :mod:`backends.kernels.mla_decode`.

Layout (one layer): ``kv[num_pages, page_size, D_CKV + D_PE]``; a row is one token, its first ``D_CKV``
values are the latent ``ckv`` (also the value), the last ``D_PE`` the rope key ``kpe``. Token ``t`` of request
``b`` lives at ``kv[page_table[b, t // page_size], t % page_size]``.

Scores are ``(q_nope . ckv + q_pe . kpe) * sm_scale``; the kernels work in base 2 internally
(``qk_scale = sm_scale * log2(e)``) and store natural-log LSEs.

The shared tile loop ``_mla_attn_loop`` is also used by the extend kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in fp32. UPCAST feeds fp32 operands to tl.dot (the CPU interpreter computes bf16 dots wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _mm_acc(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _mla_attn_loop(
    q,  # [BLOCK_M, D_CKV] in kv dtype
    qpe,  # [BLOCK_M, D_PE] in kv dtype
    m_i,  # [BLOCK_M] fp32 running max (base-2 domain)
    l_i,  # [BLOCK_M] fp32 running sum
    acc,  # [BLOCK_M, D_CKV] fp32
    KV,
    PT_row,  # pointer to page_table[b, 0]
    stride_kv_p,
    stride_kv_t,
    lo,
    hi,
    limit,  # [BLOCK_M] inclusive causal limit per row (used only when CAUSAL)
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_CKV: tl.constexpr,
    D_PE: tl.constexpr,
    MASK_N: tl.constexpr,  # keys >= hi may appear in a tile
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax over keys [lo, hi) of one request. lo must be a multiple of BLOCK_N when
    PAGE_SIZE % BLOCK_N == 0 (a tile then lies in one page and its page id is a scalar load)."""
    offs_d = tl.arange(0, D_CKV)
    offs_pe = tl.arange(0, D_PE)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        if PAGE_SIZE % BLOCK_N == 0:
            page = tl.load(PT_row + n0 // PAGE_SIZE).to(tl.int64)
            row_off = page * stride_kv_p + (offs_n % PAGE_SIZE) * stride_kv_t
        else:
            if MASK_N:
                page = tl.load(PT_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
            else:
                page = tl.load(PT_row + offs_n // PAGE_SIZE)
            row_off = page.to(tl.int64) * stride_kv_p + (offs_n % PAGE_SIZE) * stride_kv_t
        kv_ptrs = KV + row_off[:, None] + offs_d[None, :]
        pe_ptrs = KV + row_off[:, None] + D_CKV + offs_pe[None, :]
        if MASK_N:
            kv = tl.load(kv_ptrs, mask=mask_n[:, None], other=0.0)
            kpe = tl.load(pe_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            kv = tl.load(kv_ptrs)
            kpe = tl.load(pe_ptrs)

        qk = _mm(q, tl.trans(kv), PREC, UPCAST)
        qk += _mm(qpe, tl.trans(kpe), PREC, UPCAST)
        qk = qk * qk_scale
        if CAUSAL:
            keep = (offs_n[None, :] <= limit[:, None]) & mask_n[None, :]
            qk = tl.where(keep, qk, float("-inf"))
        elif MASK_N:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))

        # Every row has a finite m_i after the first tile it sees (see callers), so no (-inf) - (-inf).
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = _mm_acc(p.to(kv.dtype), kv, acc, PREC, UPCAST)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _split_plan(
    SL, pid_b, num_reqs_for_total, target_splits, min_tokens_per_split, splits_per_req,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Split plan of request ``pid_b``, computed on the GPU: (seq_len, split_len, n_effective_splits).

    The minimal split length is ``min_len = max(min_tokens_per_split, cdiv(total_tokens, target_splits))``
    where total_tokens sums seq_lens over the batch (skipped when ``num_reqs_for_total`` is 0), so the batch
    is cut into about ``target_splits`` equal pieces of work: a long request gets many splits, a short one
    a single split. Then ``n = clamp(len // min_len, 1, splits_per_req)``, ``split_len = cdiv(len, n)``
    rounded up to BLOCK_N, and the non-empty splits are the first ``cdiv(len, split_len)`` (0 if len == 0).
    """
    seq_len = tl.load(SL + pid_b)
    total = seq_len * 0
    for i in range(0, num_reqs_for_total, BLOCK_B):
        offs = i + tl.arange(0, BLOCK_B)
        total += tl.sum(tl.load(SL + offs, mask=offs < num_reqs_for_total, other=0), 0)
    min_len = tl.maximum(tl.cdiv(total, tl.maximum(target_splits, 1)), min_tokens_per_split)
    min_len = tl.maximum(min_len, 1)
    n = tl.minimum(tl.maximum(seq_len // min_len, 1), splits_per_req)
    split_len = tl.cdiv(tl.cdiv(seq_len, n), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, BLOCK_N)
    n_eff = tl.cdiv(seq_len, split_len)
    return seq_len, split_len, n_eff


# Scalars that change with the batch are not specialized, so a new batch size never triggers a recompile
# (which would break CUDA-graph capture); strides keep Triton's divisibility specialization.
@triton.jit(
    do_not_specialize=[
        "H", "num_reqs_for_total", "target_splits", "min_tokens_per_split", "splits_per_req", "slot_div",
    ]
)  # fmt: skip
def _mla_decode_stage1_kernel(
    QN,
    QP,
    KV,
    PT,
    SL,
    PO,
    PL,
    OUT,
    qk_scale,
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    stride_kv_p,
    stride_kv_t,
    stride_pt_b,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    stride_pl_s,
    stride_o_b,
    stride_o_h,
    H,
    num_reqs_for_total,
    target_splits,
    min_tokens_per_split,
    splits_per_req,
    slot_div,
    PAGE_SIZE: tl.constexpr,
    D_CKV: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """grid (cdiv(H, BLOCK_H), B, splits_per_req). One program: one request, BLOCK_H heads, one KV split.
    The head block varies fastest, so the programs that read the same KV tiles run together (L2 hits).
    A request with a single split writes ``OUT`` directly; otherwise the merge kernel does.

    Partial results of (b, split) go to the workspace slot ``b * splits_per_req + split``, addressed as
    ``[slot // slot_div, h, slot % slot_div]`` (slot_div is the workspace's split dimension), so a workspace
    with more rows than requests gives each request more split slots."""
    pid_h = tl.program_id(0)
    pid_b = tl.program_id(1)
    split = tl.program_id(2)

    seq_len, split_len, n_eff = _split_plan(
        SL, pid_b, num_reqs_for_total, target_splits, min_tokens_per_split, splits_per_req, BLOCK_N, BLOCK_B
    )
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    slot = pid_b * splits_per_req + split
    ws_b = (slot // slot_div).to(tl.int64)
    ws_s = slot % slot_div
    pl_ptrs = PL + ws_b * stride_pl_b + offs_h * stride_pl_h + ws_s * stride_pl_s

    if split < n_eff:
        offs_d = tl.arange(0, D_CKV)
        offs_pe = tl.arange(0, D_PE)
        pid_b64 = pid_b.to(tl.int64)
        q = tl.load(
            QN + pid_b64 * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_d[None, :],
            mask=mask_h[:, None],
            other=0.0,
        ).to(KV.dtype.element_ty)
        qpe = tl.load(
            QP + pid_b64 * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_pe[None, :],
            mask=mask_h[:, None],
            other=0.0,
        ).to(KV.dtype.element_ty)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, D_CKV], dtype=tl.float32)
        PT_row = PT + pid_b64 * stride_pt_b
        # start is a multiple of BLOCK_N; full tiles first (no masks), then at most one ragged tile.
        full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
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
            start,
            full_end,
            m_i,
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
            end,
            m_i,
            qk_scale,
            PAGE_SIZE,
            BLOCK_N,
            D_CKV,
            D_PE,
            MASK_N=True,
            CAUSAL=False,
            PREC=PREC,
            UPCAST=UPCAST,
        )

        o = acc / l_i[:, None]
        if n_eff == 1:  # the only split: final output, the merge kernel skips this request
            o_ptrs = OUT + pid_b64 * stride_o_b + offs_h[:, None] * stride_o_h + offs_d[None, :]
            tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=mask_h[:, None])
        else:
            po_ptrs = PO + ws_b * stride_po_b + offs_h[:, None] * stride_po_h + ws_s * stride_po_s + offs_d[None, :]
            tl.store(po_ptrs, o, mask=mask_h[:, None])
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(pl_ptrs, lse, mask=mask_h)
    else:
        tl.store(pl_ptrs, tl.full([BLOCK_H], float("-inf"), dtype=tl.float32), mask=mask_h)


@triton.jit(
    do_not_specialize=["num_reqs_for_total", "target_splits", "min_tokens_per_split", "splits_per_req", "slot_div"]
)
def _mla_decode_stage2_kernel(
    PO,
    PL,
    SL,
    OUT,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    stride_pl_s,
    stride_o_b,
    stride_o_h,
    num_reqs_for_total,
    target_splits,
    min_tokens_per_split,
    splits_per_req,
    slot_div,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """grid (B, H, D_CKV // BLOCK_DV): merge the non-empty splits of (b, h) with their LSEs (requests with
    one split were finished by stage 1; a request with no keys gets zeros)."""
    pid_b = tl.program_id(0)
    h = tl.program_id(1)
    pid_d = tl.program_id(2)

    seq_len, split_len, n_eff = _split_plan(
        SL, pid_b, num_reqs_for_total, target_splits, min_tokens_per_split, splits_per_req, BLOCK_N, BLOCK_B
    )

    if n_eff != 1:  # one split: stage 1 wrote the output
        offs_d = pid_d * BLOCK_DV + tl.arange(0, BLOCK_DV)
        m = tl.full([1], float("-inf"), dtype=tl.float32)
        l = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for s0 in range(0, n_eff, BLOCK_S):
            offs_s = s0 + tl.arange(0, BLOCK_S)
            mask_s = offs_s < n_eff
            slot = pid_b * splits_per_req + offs_s
            ws_b = (slot // slot_div).to(tl.int64)
            ws_s = slot % slot_div
            lse = tl.load(
                PL + ws_b * stride_pl_b + h * stride_pl_h + ws_s * stride_pl_s, mask=mask_s, other=float("-inf")
            )
            o = tl.load(
                PO + ws_b[:, None] * stride_po_b + h * stride_po_h + ws_s[:, None] * stride_po_s + offs_d[None, :],
                mask=mask_s[:, None],
                other=0.0,
            )
            # lse of a non-empty split is finite, and offs_s[0] < n_eff, so m_new is finite.
            m_new = tl.maximum(m, tl.max(lse, 0))
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            l = l * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(w[:, None] * o, 0)
            m = m_new
        l_safe = tl.where(l > 0.0, l, 1.0)
        res = acc / l_safe
        o_ptrs = OUT + pid_b.to(tl.int64) * stride_o_b + h * stride_o_h + offs_d
        tl.store(o_ptrs, res.to(OUT.dtype.element_ty))
