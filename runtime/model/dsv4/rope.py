"""V4 RoPE: interleaved pairs ``(2i, 2i+1)`` on the LAST ``rope_dim`` channels of a row; default or YaRN
frequencies (computed in float64).

YaRN as the V4 reference computes it: correction range from ``beta_fast`` / ``beta_slow`` floored / ceiled
(truncate on: the reference reads ``truncate`` from the top-level, label-keyed rope dict, where it never is),
a linear ramp between them mixing interpolated (``/ factor``) and extrapolated frequencies, and cos/sin scaled by
``attention_factor`` (1.0 for V4).
"""

from __future__ import annotations

import functools
import math

import torch

from runtime.model.dsv4.config import RopeParams


def inv_freq(p: RopeParams, rope_dim: int) -> torch.Tensor:
    """[rope_dim // 2] float64 inverse frequencies."""
    base = p.theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    extrapolated = 1.0 / base
    if p.rope_type == "default":
        return extrapolated
    interpolated = 1.0 / (p.factor * base)

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(p.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(p.theta))

    low = max(math.floor(correction_dim(p.beta_fast)), 0)
    high = min(math.ceil(correction_dim(p.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the extrapolated frequency
    return interpolated * (1 - keep) + extrapolated * keep


@functools.cache
def _inv_freq_on(p: RopeParams, rope_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`inv_freq` on ``device`` in ``dtype``, made once: a decode step captured in a CUDA graph must not copy
    it from the host (the eager warm-up runs before capture make it)."""
    return inv_freq(p, rope_dim).to(device=device, dtype=dtype)


def cos_sin(p: RopeParams, rope_dim: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """positions [n] int64 -> (cos, sin) [n, rope_dim // 2] in ``dtype`` (at least float32 math)."""
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    freqs = positions.to(cd)[:, None] * _inv_freq_on(p, rope_dim, positions.device, cd)[None, :]
    return freqs.cos() * p.attention_factor, freqs.sin() * p.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of x [n, ..., D] in interleaved pairs; cos/sin [n, R/2]
    broadcast over the middle dims. Pass ``-sin`` to undo the rotation."""
    r = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = cos.view(shape).to(cd), sin.view(shape).to(cd)
    rope = x[..., -r:].to(cd)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)
