"""Float32 math in Triton kernels as torch's CUDA kernels compute it: CUDA's libdevice functions (``expf``,
``cosf``, ``sinf``) on a GPU, Triton's own under the interpreter (which has no libdevice). Kernels that follow
torch's rounding points (the V4 compressor, RoPE tail and router kernels) call these with ``LIBDEVICE = not
interpreted(kernel)``."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def exp_f32(x, LIBDEVICE: tl.constexpr):
    """exp in float32: CUDA's ``expf`` when LIBDEVICE, else ``tl.exp``."""
    if LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def cos_sin_f32(ang, LIBDEVICE: tl.constexpr):
    """cos and sin in float32: CUDA's ``cosf`` / ``sinf`` when LIBDEVICE, else ``tl.cos`` / ``tl.sin``."""
    if LIBDEVICE:
        c = libdevice.cos(ang)
        s = libdevice.sin(ang)
    else:
        c = tl.cos(ang)
        s = tl.sin(ang)
    return c, s
