"""Triton kernel of DeepSeek-V4 decode attention: many query heads over one shared KV head (a row is key and
value), gathered from two sources by index (the sliding-window ring and the compressed-entry pool), one joint
online softmax that starts from each head's sink logit. Only ``@triton.jit`` code lives here; the launcher and the
torch fallback are :mod:`backends.kernels.dsv4.dsv4_decode`.

Grid ``(head_blocks, B)``: program ``(h, b)`` loads ``BLOCK_H`` query heads of request ``b`` once, then runs over
the request's window indices and compressed indices (with ``HAS_LEN``, only the first ``CMP_LEN[b]`` of them: a
list padded to a fixed width for CUDA graphs) in tiles of ``BLOCK_N`` gathered rows; each tile is loaded
once and serves both products (scores ``q . k``, output ``p @ k``) of every head in the block. Index ``-1`` is
masked. The softmax works in base 2 (``qk_scale = sm_scale * log2(e)``); the sink enters as the initial running
max with weight 1 (``exp(sink - m)``) and no value.

Split over the rows (flash-decoding, for small batches): :func:`_dsv4_split_kernel`, grid
``(head_blocks, num_splits, B)``, program ``(h, s, b)`` runs the same tile body over rows
``[s * split_len, (s + 1) * split_len)`` of the request's concatenated list (its window indices, then its
compressed indices; a split may be empty or all ``-1``) and stores its unnormalized state: ``m`` (base 2),
``l``, ``acc`` [D] per head. It starts from the sink as the running max but with weight 0, so ``m`` is always
finite (no ``-inf - -inf``) and the sink is not counted by any split. :func:`_dsv4_merge_kernel`, grid
``(B, cdiv(H, BLOCK_HM), D // BLOCK_DV)``, folds the splits into a state that starts from the sink with weight 1,
so the sink is counted exactly once, and writes ``acc / l``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.mla_decode.mla_decode_kernels import _mm, _mm_acc

LOG2E = 1.4426950408889634


@triton.jit
def _dsv4_part(q, m_i, l_i, acc, ROWS, IDX, n_idx, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax over the rows ``ROWS[IDX[0 .. n_idx - 1]]`` (``-1``: masked) -> (m_i, l_i, acc)."""
    return _dsv4_range(q, m_i, l_i, acc, ROWS, IDX, 0, n_idx, qk_scale, D, BLOCK_N, PREC, UPCAST)


@triton.jit
def _dsv4_range(q, m_i, l_i, acc, ROWS, IDX, lo, hi, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr,
                PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax over the rows ``ROWS[IDX[lo .. hi - 1]]`` (``-1``: masked; ``lo >= hi``: none)."""
    d = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(IDX + n, mask=n < hi, other=-1)
        valid = idx >= 0
        k = tl.load(ROWS + tl.where(valid, idx, 0).to(tl.int64)[:, None] * D + d[None, :], mask=valid[:, None],
                    other=0.0)
        s = _mm(q, tl.trans(k), PREC, UPCAST) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _mm_acc(p.to(k.dtype), k, acc * alpha[:, None], PREC, UPCAST)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _start_heads(Q_ROW, SINKS, stride_q_h, H, hb, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """Head block ``hb`` of one query row (``Q_ROW`` points at its head 0): (q [BLOCK_H, D], and the softmax state
    started from the sinks: m = sink (base 2), l = 1, acc = 0)."""
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(Q_ROW + heads[:, None] * stride_q_h + d[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.load(SINKS + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    return q, m_i, tl.full([BLOCK_H], 1.0, tl.float32), tl.zeros([BLOCK_H, D], dtype=tl.float32)


@triton.jit
def _store_heads(OUT_ROW, acc, l_i, stride_o_h, H, hb, D: tl.constexpr, BLOCK_H: tl.constexpr):
    """acc / l of head block ``hb`` into one output row (``OUT_ROW`` points at its head 0)."""
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    tl.store(OUT_ROW + heads[:, None] * stride_o_h + d[None, :], (acc / l_i[:, None]).to(OUT_ROW.dtype.element_ty),
             mask=(heads < H)[:, None])


@triton.jit
def _cmp_count(CMP_LEN, b, n_cmp, HAS_LEN: tl.constexpr):
    """Compressed indices request ``b`` reads: all ``n_cmp``, or its ``CMP_LEN[b]`` first (a padded list)."""
    if HAS_LEN:
        return tl.minimum(n_cmp, tl.load(CMP_LEN + b))
    return n_cmp


@triton.jit(do_not_specialize=["H", "n_win", "n_cmp"])
def _dsv4_decode_kernel(Q, WIN, WIN_IDX, CMP, CMP_IDX, CMP_LEN, SINKS, OUT, qk_scale, stride_q_b, stride_q_h,
                        stride_wi_b, stride_ci_b, stride_o_b, stride_o_h, H, n_win, n_cmp, D: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                        HAS_LEN: tl.constexpr):
    hb, b = tl.program_id(0), tl.program_id(1)
    q, m_i, l_i, acc = _start_heads(Q + b * stride_q_b, SINKS, stride_q_h, H, hb, D, BLOCK_H)
    m_i, l_i, acc = _dsv4_part(q, m_i, l_i, acc, WIN, WIN_IDX + b * stride_wi_b, n_win, qk_scale, D, BLOCK_N,
                               PREC, UPCAST)
    m_i, l_i, acc = _dsv4_part(q, m_i, l_i, acc, CMP, CMP_IDX + b * stride_ci_b, _cmp_count(CMP_LEN, b, n_cmp,
                               HAS_LEN), qk_scale, D, BLOCK_N, PREC, UPCAST)
    _store_heads(OUT + b * stride_o_b, acc, l_i, stride_o_h, H, hb, D, BLOCK_H)


@triton.jit(do_not_specialize=["H", "n_win", "n_cmp", "split_len"])
def _dsv4_split_kernel(Q, WIN, WIN_IDX, CMP, CMP_IDX, CMP_LEN, SINKS, PACC, PML, qk_scale, stride_q_b, stride_q_h,
                       stride_wi_b, stride_ci_b, stride_pa_b, stride_pa_s, stride_pa_h, stride_pm_b, stride_pm_s,
                       stride_pm_l, H, n_win, n_cmp, split_len, D: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, HAS_LEN: tl.constexpr):
    """One split of one request and head block: rows ``[lo, hi)`` of its window-then-compressed list ->
    PACC [B, S, H, D] (acc, unnormalized), PML [B, S, 2, H] (m base 2, then l); float32."""
    hb, s, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q, m_i, l_i, acc = _start_heads(Q + b * stride_q_b, SINKS, stride_q_h, H, hb, D, BLOCK_H)
    l_i = l_i * 0.0  # the sink sets the running max only; the merge counts it (once)
    lo = s * split_len
    hi = tl.minimum(lo + split_len, n_win + _cmp_count(CMP_LEN, b, n_cmp, HAS_LEN))
    m_i, l_i, acc = _dsv4_range(q, m_i, l_i, acc, WIN, WIN_IDX + b * stride_wi_b, lo, tl.minimum(hi, n_win),
                                qk_scale, D, BLOCK_N, PREC, UPCAST)
    m_i, l_i, acc = _dsv4_range(q, m_i, l_i, acc, CMP, CMP_IDX + b * stride_ci_b, tl.maximum(lo - n_win, 0),
                                hi - n_win, qk_scale, D, BLOCK_N, PREC, UPCAST)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    pa = PACC + b.to(tl.int64) * stride_pa_b + s * stride_pa_s
    tl.store(pa + heads[:, None] * stride_pa_h + d[None, :], acc, mask=hmask[:, None])
    pm = PML + b.to(tl.int64) * stride_pm_b + s * stride_pm_s + heads
    tl.store(pm, m_i, mask=hmask)
    tl.store(pm + stride_pm_l, l_i, mask=hmask)


@triton.jit(do_not_specialize=["H", "num_splits"])
def _dsv4_merge_kernel(PACC, PML, SINKS, OUT, stride_pa_b, stride_pa_s, stride_pa_h, stride_pm_b, stride_pm_s,
                       stride_pm_l, stride_o_b, stride_o_h, H, num_splits, BLOCK_HM: tl.constexpr,
                       BLOCK_DV: tl.constexpr):
    """Request ``b``, heads ``[hb * BLOCK_HM, ..)``, columns ``[c * BLOCK_DV, ..)``: the splits folded into a
    state started from the sink (m = sink, l = 1), then ``acc / l`` into OUT [B, H, D]."""
    b, hb, c = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    heads = hb * BLOCK_HM + tl.arange(0, BLOCK_HM)
    hmask = heads < H
    cols = c * BLOCK_DV + tl.arange(0, BLOCK_DV)
    m = tl.load(SINKS + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    l_sum = tl.full([BLOCK_HM], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_HM, BLOCK_DV], dtype=tl.float32)
    for s in range(0, num_splits):
        pm = PML + b * stride_pm_b + s * stride_pm_s + heads
        m_s = tl.load(pm, mask=hmask, other=0.0)
        l_s = tl.load(pm + stride_pm_l, mask=hmask, other=0.0)
        a_s = tl.load(PACC + b * stride_pa_b + s * stride_pa_s + heads[:, None] * stride_pa_h + cols[None, :],
                      mask=hmask[:, None], other=0.0)
        m_new = tl.maximum(m, m_s)
        alpha, beta = tl.exp2(m - m_new), tl.exp2(m_s - m_new)
        l_sum = l_sum * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m = m_new
    tl.store(OUT + b * stride_o_b + heads[:, None] * stride_o_h + cols[None, :],
             (acc / l_sum[:, None]).to(OUT.dtype.element_ty), mask=hmask[:, None])
