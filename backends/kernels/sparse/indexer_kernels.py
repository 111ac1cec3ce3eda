"""Triton kernels of the indexer top-k: causal scoring through the request table, and the top-k fix-up.

Only ``@triton.jit`` code lives here; the launcher is :func:`backends.kernels.sparse.indexer.indexer_topk`.

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
    # the query as the dot's B operand [DI, BLOCK_H]: logits come out [BLOCK_N, BLOCK_H], so the weighted sum
    # over heads is a reduction along rows (within a few threads) rather than across warps
    q_t = tl.load(Q + t64 * stride_q_t + offs_h[None, :] * stride_q_h + offs_d[:, None], mask=mask_h[None, :], other=0.0)
    w = tl.load(W + t64 * stride_w_t + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    if UPCAST:
        q_t = q_t.to(tl.float32)

    lo = pid_c * chunk
    hi = tl.minimum(lo + chunk, max_len)
    seen = tl.minimum(hi, pos + 1)  # keys [lo, seen) are visible
    s_row = SCORES + t64 * stride_s_t
    r2t_row = R2T + row * stride_r2t
    # no branch in this loop body, so the loads are software-pipelined
    for n0 in range(lo, seen, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        vis = offs_n < seen
        slot = tl.load(r2t_row + offs_n, mask=vis, other=0).to(tl.int64)
        k = tl.load(KC + slot[:, None] * stride_k + offs_d[None, :], mask=vis[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        logits = tl.dot(k, q_t, input_precision=PREC)  # [BLOCK_N, BLOCK_H] fp32
        score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], 1)
        tl.store(s_row + offs_n, tl.where(vis, score, float("-inf")), mask=offs_n < hi)
    # tiles wholly past the token's position: -inf only
    first_hidden = lo + tl.cdiv(tl.maximum(seen - lo, 0), BLOCK_N) * BLOCK_N
    for n0 in range(first_hidden, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        tl.store(s_row + offs_n, tl.full([BLOCK_N], float("-inf"), dtype=tl.float32), mask=offs_n < hi)


@triton.jit
def _sortable(x):
    """float32 -> int32 whose signed order is the float order (-0.0 just below +0.0)."""
    u = x.to(tl.int32, bitcast=True)
    return tl.where(u >= 0, u, u ^ 0x7FFFFFFF)


@triton.jit
def _unsortable(s):
    return tl.where(s >= 0, s, s ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["n_cols", "k"])
def _topk_rows_kernel(
    SCORES,
    CAND,
    OUT_POS,
    OUT_SCORES,
    n_cols,
    k,  # min(TOP_K, n_cols)
    stride_s_t,
    stride_c_t,
    stride_op_t,
    stride_os_t,
    TOP_K: tl.constexpr,
    K_P2: tl.constexpr,  # next power of two >= TOP_K
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,  # 4 or 8: bits of the key decided per pass
):
    """grid (T,): the k largest of SCORES[t, :n_cols], sorted descending (ties: lower position first).

    Radix select on the scores' order-preserving int32 keys, RADIX_BITS bits per pass from the top (32 /
    RADIX_BITS passes over the row, each a histogram of the digit of the keys that match the digits chosen so
    far), gives the k-th largest key and how many keys equal to it are needed; one more pass writes (key,
    position) of every key above it and of the first needed equal ones to CAND[t, :k] (stream compaction by
    prefix sums); then the k candidates are sorted in registers. Padding (positions past k, or -inf scores)
    gets -1 / -inf. Few bins per pass: tl.histogram costs about (bins / 32) popcounts per element."""
    NB: tl.constexpr = 1 << RADIX_BITS
    t = tl.program_id(0).to(tl.int64)
    row = SCORES + t * stride_s_t
    bins = tl.arange(0, 2 * NB)
    prefix = tl.zeros([], dtype=tl.int32)  # chosen high digits of the k-th key (unsigned-order bits)
    pmask = tl.zeros([], dtype=tl.int32)
    rem = k  # how many of the keys matching the prefix are still to be taken
    for p in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (p + 1)
        hist = tl.zeros([2 * NB], dtype=tl.int32)
        for c0 in range(0, n_cols, BLOCK):
            offs = c0 + tl.arange(0, BLOCK)
            live = offs < n_cols
            key = _sortable(tl.load(row + offs, mask=live, other=float("-inf"))) ^ -2147483648  # unsigned order
            digit = (key >> shift) & (NB - 1)
            match = live & ((key & pmask) == prefix)
            hist += tl.histogram(tl.where(match, digit, digit + NB), 2 * NB)  # bins >= NB: not matching
        hist = tl.where(bins < NB, hist, 0)
        suffix = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # matching keys with digit >= d
        d = tl.max(tl.where((suffix >= rem) & (bins < NB), bins, -1), 0)
        rem -= tl.sum(tl.where(bins == d, suffix - hist, 0), 0)  # minus those strictly above digit d
        prefix |= d << shift
        pmask |= tl.full([], NB - 1, tl.int32) << shift
    thr = prefix ^ -2147483648  # the k-th largest key, signed order
    n_gt = k - rem
    cnt_gt = tl.zeros([], dtype=tl.int32)
    cnt_eq = tl.zeros([], dtype=tl.int32)
    cand_row = CAND + t * stride_c_t
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        live = offs < n_cols
        s = _sortable(tl.load(row + offs, mask=live, other=float("-inf")))
        gt = live & (s > thr)
        eq = live & (s == thr)
        pos_gt = cnt_gt + tl.cumsum(gt.to(tl.int32), 0) - 1
        pos_eq = n_gt + cnt_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
        take = gt | (eq & (pos_eq < k))
        packed = (s.to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)  # ties: lower position first
        tl.store(cand_row + tl.where(gt, pos_gt, pos_eq), packed, mask=take)
        cnt_gt += tl.sum(gt.to(tl.int32), 0)
        cnt_eq += tl.sum(eq.to(tl.int32), 0)
    tl.debug_barrier()  # the candidates written above are read back by other threads of this program
    offs_k = tl.arange(0, K_P2)
    packed = tl.load(cand_row + offs_k, mask=offs_k < k, other=-9223372036854775807 - 1)
    packed = tl.sort(packed, descending=True)
    score = _unsortable((packed >> 32).to(tl.int32))
    pos = 0x7FFFFFFF - (packed & 0x7FFFFFFF).to(tl.int32)
    ok = (offs_k < k) & (score > float("-inf"))
    keep = offs_k < TOP_K
    tl.store(OUT_POS + t * stride_op_t + offs_k, tl.where(ok, pos, -1), mask=keep)
    tl.store(OUT_SCORES + t * stride_os_t + offs_k, tl.where(ok, score, float("-inf")), mask=keep)


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
