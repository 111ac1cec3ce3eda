"""RMSNorms as V4 uses them, computed in at least float32 (float64 stays float64)."""

from __future__ import annotations

import torch


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm over the last dim; the weight multiplies before the cast back to x's dtype."""
    cd = compute_dtype(x)
    xf = x.to(cd)
    return (weight.to(cd) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (V4's per-head query norm and the mHC input norm)."""
    cd = compute_dtype(x)
    return x * torch.rsqrt(x.to(cd).square().mean(-1, keepdim=True) + eps).to(x.dtype)
