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


@triton.jit(do_not_specialize=["H", "n_win", "n_cmp"])
def _dsv4_decode_kernel(Q, WIN, WIN_IDX, CMP, CMP_IDX, SINKS, OUT, qk_scale, stride_q_b, stride_q_h, stride_wi_b,
                        stride_ci_b, stride_o_b, stride_o_h, H, n_win, n_cmp, D: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    hb, b = tl.program_id(0), tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_q_b + heads[:, None] * stride_q_h + d[None, :], mask=hmask[:, None], other=0.0)
    m_i = tl.load(SINKS + heads, mask=hmask, other=0.0).to(tl.float32) * 1.4426950408889634
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    m_i, l_i, acc = _dsv4_part(q, m_i, l_i, acc, WIN, WIN_IDX + b * stride_wi_b, n_win, qk_scale, D, BLOCK_N,
                               PREC, UPCAST)
    m_i, l_i, acc = _dsv4_part(q, m_i, l_i, acc, CMP, CMP_IDX + b * stride_ci_b, n_cmp, qk_scale, D, BLOCK_N,
                               PREC, UPCAST)
    out = acc / l_i[:, None]
    tl.store(OUT + b * stride_o_b + heads[:, None] * stride_o_h + d[None, :], out.to(OUT.dtype.element_ty),
             mask=hmask[:, None])
