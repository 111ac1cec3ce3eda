"""The small tensor functions the models share: RMSNorm and the vocabulary-parallel embedding lookup (RoPE:
:mod:`runtime.model.deepseek.rope`)."""

from __future__ import annotations

import torch

from runtime.core.parallel import SingleRank, TPGroup


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def embed_vocab_parallel(table: torch.Tensor, vocab_start: int, input_ids: torch.Tensor,
                         group: SingleRank | TPGroup) -> torch.Tensor:
    """Tensor parallelism: ``table`` [V / tp, D] holds this rank's vocabulary rows ``vocab_start ..``; each rank
    looks up the ids it holds, zeros for the others, and the all-reduce sums them: input_ids [T] -> [T, D]."""
    local = input_ids - vocab_start
    mine = (local >= 0) & (local < table.shape[0])
    x = table[torch.where(mine, local, 0)]
    return group.all_reduce(torch.where(mine[:, None], x, 0.0).to(x.dtype))


def vocab_parallel_top2(local: torch.Tensor, vocab_start: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The two largest logits over the vocabulary when each rank holds a slice: ``local`` [N, V / tp] (this rank's
    logits of ids ``vocab_start ..``) -> (values [N, 2] float32, ids [N, 2] int64), the same on every rank. Each rank
    sends its own top 2 as (value, id) float32 pairs (ids below 2**24 are exact) in one all-gather of [N, 4]; every
    rank picks from the same gathered candidates, so every rank gets the same ids."""
    k = min(2, local.shape[-1])
    val, idx = torch.topk(local.float(), k, dim=-1)
    if group.size == 1:
        return val, idx
    mine = torch.cat([val, (idx + vocab_start).float()], dim=-1)  # [N, 2k]: values, then ids
    every = group.all_gather(mine, dim=0).view(group.size, -1, 2 * k)  # [tp, N, 2k], in rank (= id) order
    vals = every[..., :k].permute(1, 0, 2).reshape(local.shape[0], -1)
    ids = every[..., k:].permute(1, 0, 2).reshape(local.shape[0], -1)
    top = torch.topk(vals, 2, dim=-1)
    return top.values, torch.gather(ids, 1, top.indices).long()
