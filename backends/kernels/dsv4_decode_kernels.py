"""Triton kernel of DeepSeek-V4 decode attention: many query heads over one shared KV head (a row is key and
value), gathered from two sources by index (the sliding-window ring and the compressed-entry pool), one joint
online softmax that starts from each head's sink logit. Only ``@triton.jit`` code lives here; the launcher and the
torch fallback are :mod:`backends.kernels.dsv4_decode`.

Grid ``(head_blocks, B)``: program ``(h, b)`` loads ``BLOCK_H`` query heads of request ``b`` once, then runs over
the request's window indices and compressed indices in tiles of ``BLOCK_N`` gathered rows; each tile is loaded
once and serves both products (scores ``q . k``, output ``p @ k``) of every head in the block. Index ``-1`` is
masked. The softmax works in base 2 (``qk_scale = sm_scale * log2(e)``); the sink enters as the initial running
max with weight 1 (``exp(sink - m)``) and no value. No split over the rows: one program per head block and request.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.mla_decode_kernels import _mm, _mm_acc

LOG2E = 1.4426950408889634


@triton.jit
def _dsv4_part(q, m_i, l_i, acc, ROWS, IDX, n_idx, qk_scale, D: tl.constexpr, BLOCK_N: tl.constexpr,
               PREC: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax over the rows ``ROWS[IDX[0 .. n_idx - 1]]`` (``-1``: masked) -> (m_i, l_i, acc)."""
    d = tl.arange(0, D)
    for start in range(0, n_idx, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        idx = tl.load(IDX + n, mask=n < n_idx, other=-1)
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


@triton.jit(do_not_specialize=["H", "n_win", "n_cmp"])
def _dsv4_decode_kernel(Q, WIN, WIN_IDX, CMP, CMP_IDX, SINKS, OUT, qk_scale, stride_q_b, stride_q_h, stride_wi_b,
                        stride_ci_b, stride_o_b, stride_o_h, H, n_win, n_cmp, D: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    hb, b = tl.program_id(0), tl.program_id(1)
    q, m_i, l_i, acc = _start_heads(Q + b * stride_q_b, SINKS, stride_q_h, H, hb, D, BLOCK_H)
    m_i, l_i, acc = _dsv4_part(q, m_i, l_i, acc, WIN, WIN_IDX + b * stride_wi_b, n_win, qk_scale, D, BLOCK_N,
                               PREC, UPCAST)
    m_i, l_i, acc = _dsv4_part(q, m_i, l_i, acc, CMP, CMP_IDX + b * stride_ci_b, n_cmp, qk_scale, D, BLOCK_N,
                               PREC, UPCAST)
    _store_heads(OUT + b * stride_o_b, acc, l_i, stride_o_h, H, hb, D, BLOCK_H)
