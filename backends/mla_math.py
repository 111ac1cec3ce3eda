"""Plain-torch attention math for one request: the oracle's arithmetic, readable line by line.

Causality is bottom-right aligned: with ``n`` queries over ``L`` keys, query ``i`` sits at position
``L - n + i`` and sees keys ``0 .. L - n + i``. The log-sum-exp is natural-log.
"""

from __future__ import annotations

import torch


def causal_mask(n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
    """[n_q, n_k] bool, True where query i (at position n_k - n_q + i) may see key j."""
    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    return torch.arange(n_k, device=device)[None, :] <= q_pos


def absorbed_attention(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, kv_lora_rank: int, sm_scale: float, causal: bool
) -> torch.Tensor:
    """Absorbed MLA for one request.

    Parameters
    ----------
    q_nope : [n, H, kv_lora_rank]; q_pe : [n, H, rope]
    kv : [L, kv_lora_rank + rope] latent rows (ckv | kpe) of the request, in token order.

    Returns
    -------
    [n, H, kv_lora_rank] in the inputs' dtype (compute in that dtype: cast before calling).
    """
    ckv, kpe = kv[:, :kv_lora_rank], kv[:, kv_lora_rank:]
    scores = (torch.einsum("nhc,lc->hnl", q_nope, ckv) + torch.einsum("nhr,lr->hnl", q_pe, kpe)) * sm_scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q_nope.shape[0], kv.shape[0], kv.device), float("-inf"))
    return torch.einsum("hnl,lc->nhc", torch.softmax(scores, dim=-1), ckv)


def mha_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-head attention for one request: q [n, H, D], k [L, H, D], v [L, H, Dv] -> (out [n, H, Dv],
    lse [n, H]). With no keys (L == 0) the output is 0 and the lse is -inf, so merging ignores it."""
    n, h = q.shape[0], q.shape[1]
    if k.shape[0] == 0:
        return q.new_zeros(n, h, v.shape[-1]), q.new_full((n, h), float("-inf"))
    scores = torch.einsum("nhd,lhd->hnl", q, k) * sm_scale
    if causal:
        scores = scores.masked_fill(~causal_mask(n, k.shape[0], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    out = torch.einsum("hnl,lhd->nhd", torch.exp(scores - lse[..., None]), v)
    return out, lse.transpose(0, 1).contiguous()


def merge_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax results over disjoint key sets: out [T, H, D], lse [T, H] (natural log)."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    return out_a * w_a + out_b * w_b, lse


def paged_absorbed_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, kv_lora_rank: int, softmax_scale: float,
                             output_scale: float, causal: bool = True,
                             compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Absorbed MLA for a batch over a paged latent cache, with static shapes (no host sync; graph-capturable).
    Computes in ``compute_dtype`` (default float32, float64 for float64 queries) over every column of
    ``block_tables``, masked.

    Parameters
    ----------
    query : [B, S, H, kv_lora + rope]
    kv_cache : [P, page_size, kv_lora + rope] (or with a singleton dim 1)
    block_tables : [B, W] int32 page ids (columns past a request's pages are never attended to)
    seq_lens : [B] int32 KV lengths (device)
    causal : bottom-right causal within the S query rows; False: every row sees all seq_len keys

    Returns
    -------
    [B, S, H, kv_lora] in the query's dtype; a row that sees no key is 0.
    """
    cd = compute_dtype or (torch.float64 if query.dtype == torch.float64 else torch.float32)
    cache = kv_cache.squeeze(1) if kv_cache.dim() == 4 else kv_cache
    b, s = query.shape[:2]
    ps = cache.shape[1]
    kv = cache[block_tables.long()].reshape(b, block_tables.shape[1] * ps, cache.shape[-1]).to(cd)  # [B, L, D]
    scores = torch.einsum("bshd,bld->bshl", query.to(cd), kv) * softmax_scale
    keys = torch.arange(kv.shape[1], device=query.device)
    lens = seq_lens.to(torch.int64)
    visible = keys[None, None, :] < lens[:, None, None]  # [B, 1, L]
    if causal:
        pos = lens[:, None] - s + torch.arange(s, device=query.device)[None, :]  # [B, S]
        visible = visible & (keys[None, None, :] <= pos[:, :, None])  # [B, S, L]
    visible = visible[:, :, None, :]  # [B, S, 1, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = torch.exp(scores - top)  # masked keys: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    out = torch.einsum("bshl,blc->bshc", p, kv[..., :kv_lora_rank]) * output_scale
    return out.to(query.dtype)
