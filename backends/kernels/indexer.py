"""DeepSeek-V3.2 sparse-attention indexer: per query token, the top-k previous tokens by indexer score.

For query token ``t`` of request ``b`` (row ``req_rows[b]`` of the request-to-token table), key position ``j``
(``0 <= j <= positions[t]``, causal, inclusive) scores::

    score(t, j) = sum_h weights[t, h] * relu(q[t, h] . k_cache[req_to_token[req_rows[b], j]])

and the indexer returns the positions of the ``top_k`` highest scores (token positions, not KV slots), sorted
by descending score, ``-1`` where fewer than ``top_k`` positions are visible.

Two implementations with one signature:

* :func:`indexer_topk_reference`: torch, any device, float32 math; the oracle for tests and the CPU path.
* :func:`indexer_topk`: a Triton scoring kernel (keys gathered through the request table inside the kernel, so
  no ``[B, ctx, Di]`` copy is made) into a ``[T, max_len]`` float32 score buffer, then ``torch.topk`` and a
  small fix-up kernel (int32 positions, ``-1`` / ``-inf`` padding). Graph-safe when given ``max_len`` and
  preallocated ``out_pos`` / ``out_scores`` / ``scratch``: no allocation, no host sync.

Triton is imported lazily, so the reference works where Triton is not installed.
"""

from __future__ import annotations

import torch

from backends.kernels.checks import require

__all__ = ["indexer_scratch_bytes", "indexer_topk_reference"]

#: Query tokens scored per reference step (bounds the [tokens, heads, keys] float32 intermediate).
_REF_TOKENS_PER_STEP = 64


def _check_args(q, weights, k_cache, req_to_token, req_rows, positions, qo_indptr, top_k) -> None:
    require(q.dim() == 3, f"q [T, Hi, Di]; got shape {tuple(q.shape)}")
    T, Hi, Di = q.shape
    require(weights.shape == (T, Hi), f"weights [T, Hi] = {(T, Hi)}; got {tuple(weights.shape)}")
    require(k_cache.dim() == 2 and k_cache.shape[1] == Di, f"k_cache [S, Di={Di}]; got {tuple(k_cache.shape)}")
    require(req_to_token.dim() == 2, f"req_to_token [R, max_ctx]; got {tuple(req_to_token.shape)}")
    require(positions.shape == (T,), f"positions [T={T}]; got {tuple(positions.shape)}")
    require(qo_indptr.dim() == 1 and qo_indptr.shape[0] >= 1, "qo_indptr [B + 1]")
    require(req_rows.shape == (qo_indptr.shape[0] - 1,), "req_rows [B] with qo_indptr [B + 1]")
    require(int(top_k) >= 1, f"top_k >= 1; got {top_k}")


def indexer_topk_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    positions: torch.Tensor,
    qo_indptr: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer top-k in plain torch (float32 math, any device; host syncs, so not for CUDA graphs).

    Parameters
    ----------
    q : [T, Hi, Di] model dtype
        Indexer queries of the batch's query tokens (requests laid end to end, see ``qo_indptr``).
    weights : [T, Hi] float32
        Per-token head weights (already including any scale).
    k_cache : [S, Di] model dtype
        Indexer keys by KV slot.
    req_to_token : [R, max_ctx] int32 or int64
        KV slot of each request row's token positions.
    req_rows : [B] int64
        Row of ``req_to_token`` of each request.
    positions : [T] int64
        Absolute position of each query token; it sees key positions ``0 .. positions[t]``.
    qo_indptr : [B + 1] int32
        Query tokens of request ``b`` are ``qo_indptr[b] .. qo_indptr[b + 1] - 1``.
    top_k : int

    Returns
    -------
    topk_pos : [T, top_k] int32
        Token positions of the highest scores, by descending score; -1 where fewer are visible.
    topk_scores : [T, top_k] float32
        Their scores; -inf at padding.
    """
    _check_args(q, weights, k_cache, req_to_token, req_rows, positions, qo_indptr, top_k)
    T = q.shape[0]
    dev = q.device
    out_pos = torch.full((T, top_k), -1, dtype=torch.int32, device=dev)
    out_scores = torch.full((T, top_k), float("-inf"), dtype=torch.float32, device=dev)
    indptr = qo_indptr.tolist()
    rows = req_rows.tolist()
    pos_all = positions.to(torch.int64)
    for b, row in enumerate(rows):
        t0, t1 = indptr[b], indptr[b + 1]
        if t1 <= t0:
            continue
        n_keys = int(pos_all[t0:t1].max()) + 1
        slots = req_to_token[row, :n_keys].long()
        keys = k_cache[slots].float()  # [L, Di]
        for s0 in range(t0, t1, _REF_TOKENS_PER_STEP):
            s1 = min(s0 + _REF_TOKENS_PER_STEP, t1)
            logits = torch.einsum("thd,ld->thl", q[s0:s1].float(), keys).relu_()
            scores = torch.einsum("th,thl->tl", weights[s0:s1].float(), logits)  # [n, L]
            pos = pos_all[s0:s1]
            visible = torch.arange(n_keys, device=dev)[None, :] <= pos[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            k = min(top_k, n_keys)
            vals, idx = torch.topk(scores, k, dim=1, largest=True, sorted=True)
            # ranks past the visible count hold masked (-inf) entries: padding
            keep = torch.arange(k, device=dev)[None, :] < (pos[:, None] + 1)
            out_pos[s0:s1, :k] = torch.where(keep, idx, -1).to(torch.int32)
            out_scores[s0:s1, :k] = torch.where(keep, vals, float("-inf"))
    return out_pos, out_scores


def indexer_scratch_bytes(max_tokens: int, max_len: int, top_k: int) -> int:
    """Bytes of the scratch :func:`indexer_topk` needs for up to ``max_tokens`` query tokens that see at most
    ``max_len`` key positions: a float32 score buffer [max_tokens, max_len] and int64 top-k indices
    [max_tokens, min(top_k, max_len)] (8-byte aligned)."""
    return 4 * max_tokens * max_len + (-(4 * max_tokens * max_len) % 8) + 8 * max_tokens * min(top_k, max_len)
