"""Reference math of DeepSeek-V4 attention (plain torch; the oracle future Triton/FlashInfer kernels match).

* :func:`sink_attention`: many query heads over one shared KV head whose rows are both key and value, several key
  sets ("parts": the sliding window, the compressed entries) softmaxed jointly with a per-head sink logit that
  takes probability mass but has no value.
* :func:`indexer_topk`: the lightning indexer's scores ``sum_h w[h] * relu(q[h] . k)`` over the compressed keys a
  query may see, and the top-k of them.
"""

from __future__ import annotations

import torch


def sink_attention(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                   sm_scale: float) -> torch.Tensor:
    """Joint softmax over every part's visible rows plus one sink logit per head.

    Parameters
    ----------
    q : torch.Tensor
        [n, H, D] queries, in the compute dtype.
    parts : list of (rows, visible)
        rows: [L, D] shared by every query, or [n, L, D] per query; visible: [n, L] bool. A query that sees no
        row at all gets the zero vector (all its mass goes to the sink).
    sinks : torch.Tensor
        [H] sink logits (not scaled by ``sm_scale``).
    sm_scale : float

    Returns
    -------
    torch.Tensor
        [n, H, D] in q's dtype.
    """
    n, h, _ = q.shape
    logits = []
    for rows, visible in parts:
        eq = "nhd,ld->nhl" if rows.dim() == 2 else "nhd,nld->nhl"
        s = torch.einsum(eq, q, rows.to(q.dtype)) * sm_scale
        logits.append(s.masked_fill(~visible[:, None, :], float("-inf")))
    sink = sinks.to(q.dtype).view(1, h, 1).expand(n, h, 1)
    joint = torch.cat([*logits, sink], dim=-1)
    joint = joint - joint.amax(dim=-1, keepdim=True)
    probs = torch.softmax(joint, dim=-1)
    out = torch.zeros_like(q)
    at = 0
    for (rows, _), s in zip(parts, logits):
        p = probs[..., at: at + s.shape[-1]]
        at += s.shape[-1]
        eq = "nhl,ld->nhd" if rows.dim() == 2 else "nhl,nld->nhd"
        out = out + torch.einsum(eq, p, rows.to(q.dtype))
    return out


def indexer_topk(index_q: torch.Tensor, index_weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                 rate: int, top_k: int) -> torch.Tensor:
    """Top-k compressed entries per query.

    Parameters
    ----------
    index_q : torch.Tensor
        [n, Hi, Di] indexer queries (RoPE applied), compute dtype.
    index_weights : torch.Tensor
        [n, Hi] per-head weights with every scale folded in (``weights_proj(x) * Hi**-0.5 * Di**-0.5``).
    keys : torch.Tensor
        [E, Di] the request's compressed indexer keys, entry order.
    positions : torch.Tensor
        [n] int64 absolute positions of the queries; a query at ``t`` sees entries ``e < (t + 1) // rate``.
    rate : int
    top_k : int

    Returns
    -------
    torch.Tensor
        [n, top_k] int64 entry ids, -1 where fewer than ``top_k`` entries are visible.
    """
    n, e = index_q.shape[0], keys.shape[0]
    out = torch.full((n, top_k), -1, dtype=torch.int64, device=index_q.device)
    if e == 0 or n == 0:
        return out
    scores = torch.relu(torch.einsum("nhd,ed->nhe", index_q, keys.to(index_q.dtype)))
    scores = (scores * index_weights.to(scores.dtype)[:, :, None]).sum(dim=1)  # [n, E]
    limit = (positions + 1) // rate
    future = torch.arange(e, device=scores.device)[None, :] >= limit[:, None]
    scores = scores.masked_fill(future, float("-inf"))
    k = min(top_k, e)
    idx = scores.topk(k, dim=-1).indices
    out[:, :k] = torch.where(idx >= limit[:, None], -1, idx)
    return out
