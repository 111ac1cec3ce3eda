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
