"""The small tensor functions the models share: RMSNorm, RoPE, and the vocabulary-parallel embedding lookup."""

from __future__ import annotations

import torch

from runtime.core.parallel import SingleRank, TPGroup


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [T, ..., R]; cos/sin [T, R/2] (broadcast over the middle dims)."""
    half = x.shape[-1] // 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape).to(x.dtype), sin.view(shape).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def embed_vocab_parallel(table: torch.Tensor, vocab_start: int, input_ids: torch.Tensor,
                         group: SingleRank | TPGroup) -> torch.Tensor:
    """Tensor parallelism: ``table`` [V / tp, D] holds this rank's vocabulary rows ``vocab_start ..``; each rank
    looks up the ids it holds, zeros for the others, and the all-reduce sums them: input_ids [T] -> [T, D]."""
    local = input_ids - vocab_start
    mine = (local >= 0) & (local < table.shape[0])
    x = table[torch.where(mine, local, 0)]
    return group.all_reduce(torch.where(mine[:, None], x, 0.0).to(x.dtype))
