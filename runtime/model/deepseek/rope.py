"""RoPE for every DeepSeek model (V2, V3, V3.2, V4): inverse frequencies (plain or YaRN), cos/sin tables and the
rotations (half-split, interleaved, and V4's interleaved rope tail).

YaRN (``rope_type=yarn``): frequencies whose wavelength fits the original context many times (fast, above
``beta_fast`` rotations) are kept, slow ones (below ``beta_slow``) are divided by ``factor``, a linear ramp
blends the two in between (the correction range floored / ceiled when ``truncate``: V4 always, V2 / V3 unless
``rope_truncate`` is off); cos/sin are multiplied by the attention factor (V2 / V3:
:attr:`ModelSpec.rope_attention_factor`, YaRN's mscale ratio; V4: its configured ``attention_factor``, 1.0), and
V2 / V3 scale the softmax by ``mscale(factor, mscale_all_dim)^2`` (:attr:`ModelSpec.sm_scale`).

Two ways to the cos/sin values, one set of frequencies: :func:`rope_tables` (V2 / V3: a float32 table of every
position, angles in float64) and :func:`cos_sin` (V4: the step's positions only, angles in the compute dtype).

Rotations: :func:`apply_rope_half` rotates ``(x[i], x[i + R/2])``; :func:`apply_rope_interleaved` rotates pairs
``(x0, x1), (x2, x3), ...`` and returns them de-interleaved (evens then odds), the layout the V2 / V3 reference
uses for q and k alike (dot products equal those of the interleaved layout; the KV cache keeps the rope key in that
layout); :func:`apply_rope_tail` (V4) rotates interleaved pairs of a row's last channels in place, in float32 (or
float64) whatever x's dtype.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from runtime.core.model_spec import ModelSpec


@dataclass(frozen=True)
class RopeParams:
    """One RoPE flavour: DeepSeek-V2 / V3's (:func:`rope_params` of a :class:`ModelSpec`), or one of V4's ``main``
    (sliding-only layers) and ``compress`` (CSA / HCA layers, their compressors and indexer).

    Attributes
    ----------
    theta : float
    rope_type : str
        "yarn", or anything else for plain frequencies ("default").
    factor, original_max_position_embeddings, beta_fast, beta_slow : YaRN parameters (unused without YaRN).
    attention_factor : float
        cos/sin multiplier (V4 forces 1.0 for YaRN: the reference does not apply YaRN's mscale).
    truncate : bool
        Floor / ceil YaRN's correction range (V4 always does).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True


def rope_params(spec: ModelSpec) -> RopeParams:
    """A V2 / V3 / V3.2 :class:`ModelSpec`'s rope as :class:`RopeParams` (the attention factor from its mscales)."""
    return RopeParams(theta=spec.rope_theta, rope_type=spec.rope_type, factor=spec.rope_factor,
                      original_max_position_embeddings=spec.rope_original_max_position,
                      beta_fast=spec.rope_beta_fast, beta_slow=spec.rope_beta_slow,
                      attention_factor=spec.rope_attention_factor, truncate=spec.rope_truncate)


def inv_freq(p: RopeParams, dim: int) -> torch.Tensor:
    """[dim / 2] float64 inverse frequencies of ``dim`` rope channels (YaRN-scaled when ``p.rope_type == 'yarn'``)."""
    base = p.theta
    extrapolation = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if p.rope_type != "yarn":
        return extrapolation
    factor, orig = p.factor, p.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return extrapolation / factor * (1 - keep) + extrapolation * keep


def rope_tables(spec: ModelSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """V2 / V3: cos, sin [max_context, qk_rope_head_dim / 2] float32 (angles in float64), times the YaRN attention
    factor."""
    p = rope_params(spec)
    freqs = torch.outer(torch.arange(spec.max_context, dtype=torch.float64), inv_freq(p, spec.qk_rope_head_dim))
    af = p.attention_factor
    return (freqs.cos() * af).float().to(device), (freqs.sin() * af).float().to(device)


@functools.cache
def inv_freq_on(p: RopeParams, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:func:`inv_freq` on ``device`` in ``dtype``, made once: a decode step captured in a CUDA graph must not copy
    it from the host (the eager warm-up runs before capture make it)."""
    return inv_freq(p, dim).to(device=device, dtype=dtype)


def cos_sin(p: RopeParams, dim: int, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """V4: positions [n] int64 -> (cos, sin) [n, dim // 2] in at least float32 (float64 when ``dtype`` is), times
    ``p.attention_factor``."""
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    freqs = positions.to(cd)[:, None] * inv_freq_on(p, dim, positions.device, cd)[None, :]
    return freqs.cos() * p.attention_factor, freqs.sin() * p.attention_factor


def _broadcast(x: torch.Tensor, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cos or sin [T, R/2] viewed to broadcast over x [T, ..., R/2], in ``dtype``."""
    return t.view((t.shape[0],) + (1,) * (x.dim() - 2) + (t.shape[-1],)).to(dtype)


def _rotate(x1: torch.Tensor, x2: torch.Tensor, c: torch.Tensor, s: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of every rope flavour: pairs (x1, x2) by angles of cosine c and sine s."""
    return x1 * c - x2 * s, x2 * c + x1 * s


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (rotate-half) RoPE. x [T, ..., R]; cos/sin [T, R/2] -> [T, ..., R] in x's dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat(_rotate(x1, x2, _broadcast(x1, cos, x.dtype), _broadcast(x1, sin, x.dtype)), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE. x [T, ..., R] with pairs (x[2i], x[2i+1]); cos/sin [T, R/2] -> [T, ..., R], the
    rotated pairs de-interleaved (first elements, then second elements), in x's dtype."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat(_rotate(x1, x2, _broadcast(x1, cos, x.dtype), _broadcast(x1, sin, x.dtype)), dim=-1)


def apply_rope(spec: ModelSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The MLA rope dims' rotation: interleaved when ``spec.rope_interleave``, else half-split."""
    return (apply_rope_interleaved if spec.rope_interleave else apply_rope_half)(x, cos, sin)


def apply_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4: rotate the last ``2 * cos.shape[-1]`` channels of x [n, ..., D] in interleaved pairs, kept interleaved,
    in float32 (float64 for a float64 x); cos/sin [n, R/2] broadcast over the middle dims -> [n, ..., D] in x's
    dtype. Pass ``-sin`` to undo the rotation."""
    r = 2 * cos.shape[-1]
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    rope = x[..., -r:].to(cd)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack(_rotate(even, odd, _broadcast(even, cos, cd), _broadcast(even, sin, cd)), dim=-1)
    return torch.cat([x[..., :-r], rotated.flatten(-2).to(x.dtype)], dim=-1)
