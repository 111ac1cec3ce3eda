"""RoPE for DeepSeek models: inverse frequencies (plain or YaRN), cos/sin tables, half-split and interleaved rotation.

YaRN (``rope_type=yarn``): frequencies whose wavelength fits the original context many times (fast, above
``beta_fast`` rotations) are kept, slow ones (below ``beta_slow``) are divided by ``factor``, a linear ramp
blends the two in between; cos/sin are multiplied by :attr:`ModelSpec.rope_attention_factor`, and the softmax
scale by ``mscale(factor, mscale_all_dim)^2`` (:attr:`ModelSpec.sm_scale`).

Interleaved RoPE rotates pairs ``(x0, x1), (x2, x3), ...``; :func:`apply_rope_interleaved` returns the rotated
pairs de-interleaved (evens then odds), the layout the reference uses for q and k alike: dot products equal
those of the interleaved layout, and the KV cache keeps the rope key in that layout.
"""

from __future__ import annotations

import math

import torch

from runtime.core.model_spec import ModelSpec


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """[qk_rope_head_dim / 2] float64 inverse frequencies (YaRN-scaled when ``spec.rope_type == 'yarn'``)."""
    dim, base = spec.qk_rope_head_dim, spec.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    extrapolation = 1.0 / base**exponents
    if spec.rope_type != "yarn":
        return extrapolation
    factor, orig = spec.rope_factor, spec.rope_original_max_position

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(spec.rope_beta_fast), correction_dim(spec.rope_beta_slow)
    if spec.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return extrapolation / factor * (1 - keep) + extrapolation * keep


def rope_tables(spec: ModelSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_context, qk_rope_head_dim / 2] float32, times the YaRN attention factor."""
    freqs = torch.outer(torch.arange(spec.max_context, dtype=torch.float64), inv_freq(spec))
    af = spec.rope_attention_factor
    return (freqs.cos() * af).float().to(device), (freqs.sin() * af).float().to(device)


def _broadcast(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """cos or sin [T, R/2] viewed to broadcast over x [T, ..., R/2] in x's dtype."""
    return t.view((t.shape[0],) + (1,) * (x.dim() - 2) + (t.shape[-1],)).to(x.dtype)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (rotate-half) RoPE. x [T, ..., R]; cos/sin [T, R/2] -> [T, ..., R] in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = _broadcast(x1, cos), _broadcast(x1, sin)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE. x [T, ..., R] with pairs (x[2i], x[2i+1]); cos/sin [T, R/2] -> [T, ..., R], the
    rotated pairs de-interleaved (first elements, then second elements)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = _broadcast(x1, cos), _broadcast(x1, sin)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_rope(spec: ModelSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The MLA rope dims' rotation: interleaved when ``spec.rope_interleave``, else half-split."""
    return (apply_rope_interleaved if spec.rope_interleave else apply_rope_half)(x, cos, sin)
