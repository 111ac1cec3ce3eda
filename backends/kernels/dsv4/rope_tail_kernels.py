"""Triton kernel of V4's RoPE tail (launcher: :mod:`backends.kernels.dsv4.rope_tail`; the torch functions it
reproduces: :func:`runtime.model.deepseek.rope.cos_sin` then :func:`runtime.model.deepseek.rope.apply_rope_tail`).

Grid ``(T, cdiv(M, BLOCK_M))``: program ``(t, j)`` takes rows ``j * BLOCK_M ...`` of token ``t``'s ``M`` rows
(heads; 1 for a 2-D x), every one of their ``D`` channels. Token ``t``'s cos / sin are computed once per program
for every channel pair (the pairs before the rope tail get inverse frequency 0 and are not used), the rows are read
as interleaved pairs, the tail's pairs rotated and the other channels copied unchanged.

Rounding follows the torch ops: the angle ``float32(position) * inv_freq`` rounded once, cos and sin in float32
(CUDA's ``cosf`` / ``sinf`` when LIBDEVICE, as torch's CUDA kernels call them), each times the attention factor,
the rotation ``x1 * c - x2 * s``, ``x2 * c + x1 * s`` in float32 with every product rounded (the launch turns off
FMA contraction), one rounding to x's dtype at the end. ``INVERSE`` negates sin (torch: ``-sin``, exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.libdevice_math import cos_sin_f32 as _cos_sin
from backends.kernels.pdl import pdl_enter


@triton.jit
def _rope_tail_kernel(X, POS, INV_FREQ, OUT, m, stride_xt, stride_xm, stride_ot, stride_om, attention_factor,
                      D: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_D: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    """Rows of one token: see the module docstring."""
    pdl_enter(PDL)
    DT: tl.constexpr = OUT.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    r = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    mask = (r < m)[:, None] & (c < D)[None, :]
    x = tl.load(X + t * stride_xt + r[:, None] * stride_xm + c[None, :], mask=mask, other=0.0)

    # cos / sin of the token's position for every pair; pair p is rope pair p - (D / 2 - HALF)
    k = tl.arange(0, BLOCK_D // 2) - (D // 2 - HALF)
    f = tl.load(INV_FREQ + k, mask=(k >= 0) & (k < HALF), other=0.0)
    ang = tl.load(POS + t).to(tl.float32) * f
    cs, sn = _cos_sin(ang, LIBDEVICE)
    cs = cs * attention_factor
    sn = sn * attention_factor
    if INVERSE:
        sn = -sn

    ev, od = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_D // 2, 2)))
    rot = tl.join(ev * cs[None, :] - od * sn[None, :], od * cs[None, :] + ev * sn[None, :])
    y = tl.where((c >= D - 2 * HALF)[None, :], tl.reshape(rot, (BLOCK_M, BLOCK_D)).to(DT), x)
    tl.store(OUT + t * stride_ot + r[:, None] * stride_om + c[None, :], y, mask=mask)
