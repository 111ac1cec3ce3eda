"""Triton kernel of DeepSeek-V4 extend (prefill / chunked prefill) attention: every query token attends over its
own index lists into three row sources (the window ring, the chunk's new rows, the compressed entries), one joint
online softmax from each head's sink logit. Only ``@triton.jit`` code lives here; the launcher is
:mod:`backends.kernels.dsv4.dsv4_extend`.

Grid ``(head_blocks, T)``: program ``(h, t)`` loads ``BLOCK_H`` heads of query token ``t`` once, then, for each
part ``(ROWS, IDX, SEL, LEN)``, runs over ``IDX[SEL[t], 0 .. LEN[t] - 1]`` in tiles of ``BLOCK_N`` gathered rows
(index ``-1`` masked) with the decode kernel's tile body (:func:`backends.kernels.dsv4.dsv4_decode_kernels._dsv4_part`):
each tile is loaded once and serves both products of every head in the block. ``SEL`` lets queries share an index
row (HCA: the request's row of the entry table) or own one (the window lists, CSA's top-k slots); ``LEN`` bounds the
loop per query, so a query only walks the tiles its lists fill. No split over the rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.dsv4.dsv4_decode_kernels import _dsv4_part, _start_heads, _store_heads


@triton.jit
def _extend_part(q, m_i, l_i, acc, t, ROWS, IDX, SEL, LEN, stride_idx, qk_scale, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One part of query ``t``: the rows ``ROWS[IDX[SEL[t], :LEN[t]]]``."""
    sel = tl.load(SEL + t).to(tl.int64)
    n = tl.load(LEN + t)
    return _dsv4_part(q, m_i, l_i, acc, ROWS, IDX + sel * stride_idx, n, qk_scale, D, BLOCK_N, PREC, UPCAST)


@triton.jit(do_not_specialize=["H"])
def _dsv4_extend_kernel(Q, SINKS, OUT, R0, I0, S0, L0, R1, I1, S1, L1, R2, I2, S2, L2, qk_scale, stride_q_t,
                        stride_q_h, stride_i0, stride_i1, stride_i2, stride_o_t, stride_o_h, H, D: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr):
    hb, t = tl.program_id(0), tl.program_id(1)
    t64 = t.to(tl.int64)
    q, m_i, l_i, acc = _start_heads(Q + t64 * stride_q_t, SINKS, stride_q_h, H, hb, D, BLOCK_H)
    m_i, l_i, acc = _extend_part(q, m_i, l_i, acc, t, R0, I0, S0, L0, stride_i0, qk_scale, D, BLOCK_N, PREC, UPCAST)
    m_i, l_i, acc = _extend_part(q, m_i, l_i, acc, t, R1, I1, S1, L1, stride_i1, qk_scale, D, BLOCK_N, PREC, UPCAST)
    m_i, l_i, acc = _extend_part(q, m_i, l_i, acc, t, R2, I2, S2, L2, stride_i2, qk_scale, D, BLOCK_N, PREC, UPCAST)
    _store_heads(OUT + t64 * stride_o_t, acc, l_i, stride_o_h, H, hb, D, BLOCK_H)
