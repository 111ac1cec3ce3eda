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
