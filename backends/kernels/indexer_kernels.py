"""Triton kernels of the indexer top-k: causal scoring through the request table, and the top-k fix-up.

Only ``@triton.jit`` code lives here; the launcher is :func:`backends.kernels.indexer.indexer_topk`.

Scoring, grid ``(cdiv(max_len, CHUNK), T)``: program ``(c, t)`` finds token ``t``'s request (the number of
``qo_indptr[1:]`` entries ``<= t``), keeps the token's ``[Hi, Di]`` query in registers and walks key positions
``[c * CHUNK, (c + 1) * CHUNK)`` in tiles of ``BLOCK_N``: slots from ``req_to_token[row]``, keys gathered from
``k_cache`` by slot (no ``[B, ctx, Di]`` copy), ``score = sum_h w_h relu(q_h . k)`` (a ``[Hi, Di] x [Di, BLOCK_N]``
dot), ``-inf`` past ``positions[t]``. Tiles wholly past ``positions[t]`` only store ``-inf``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_reqs", "max_len", "chunk"])
def _indexer_scores_kernel(
    Q,
    W,
    KC,
    R2T,
    ROWS,
    POS,
    INDPTR,
    SCORES,
    stride_q_t,
    stride_q_h,
    stride_w_t,
    stride_k,
    stride_r2t,
    stride_s_t,
    num_reqs,
    max_len,
    chunk,  # key positions per program (a multiple of BLOCK_N)
    HI: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= HI (and >= 16)
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_c = tl.program_id(0)
    t = tl.program_id(1)

    # request of token t: how many requests end at or before it
    b = t * 0
    for i in range(0, num_reqs, BLOCK_B):
        offs_b = i + tl.arange(0, BLOCK_B)
        ends = tl.load(INDPTR + 1 + offs_b, mask=offs_b < num_reqs, other=2147483647)
        b += tl.sum((ends <= t).to(tl.int32), 0)
    row = tl.load(ROWS + b).to(tl.int64)
    pos = tl.load(POS + t)
    t64 = t.to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, DI)
    mask_h = offs_h < HI
    q = tl.load(Q + t64 * stride_q_t + offs_h[:, None] * stride_q_h + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    w = tl.load(W + t64 * stride_w_t + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    if UPCAST:
        q = q.to(tl.float32)

    lo = pid_c * chunk
    hi = tl.minimum(lo + chunk, max_len)
    s_row = SCORES + t64 * stride_s_t
    r2t_row = R2T + row * stride_r2t
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if n0 <= pos:
            vis = offs_n <= pos
            slot = tl.load(r2t_row + offs_n, mask=vis, other=0).to(tl.int64)
            k = tl.load(KC + slot[:, None] * stride_k + offs_d[None, :], mask=vis[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            logits = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BLOCK_H, BLOCK_N] fp32
            score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], 0)
            score = tl.where(vis, score, float("-inf"))
        else:
            score = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
        tl.store(s_row + offs_n, score, mask=offs_n < hi)


@triton.jit(do_not_specialize=["T", "k"])
def _topk_fixup_kernel(
    VALS,
    IDX,
    OUT_POS,
    OUT_SCORES,
    T,
    k,  # columns of VALS / IDX (top-k over min(top_k, max_len) columns)
    stride_v_t,
    stride_i_t,
    stride_op_t,
    stride_os_t,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """grid (T, cdiv(TOP_K, BLOCK)): out_pos = int32(idx) where the score is finite, else -1 (also for
    columns >= k); out_scores = the score, -inf at padding."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    have = offs < k
    v = tl.load(VALS + t * stride_v_t + offs, mask=have, other=float("-inf"))
    i = tl.load(IDX + t * stride_i_t + offs, mask=have, other=-1)
    ok = v > float("-inf")
    keep = offs < TOP_K
    tl.store(OUT_POS + t * stride_op_t + offs, tl.where(ok, i, -1).to(tl.int32), mask=keep)
    tl.store(OUT_SCORES + t * stride_os_t + offs, tl.where(ok, v, float("-inf")), mask=keep)
