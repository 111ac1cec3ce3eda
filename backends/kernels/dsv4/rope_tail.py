"""Launcher of V4's fused RoPE tail (kernel: :mod:`backends.kernels.dsv4.rope_tail_kernels`).

One launch does what :func:`runtime.model.deepseek.rope.cos_sin` and
:func:`runtime.model.deepseek.rope.apply_rope_tail` do in about 16 torch kernels: the cos / sin of each token's
position, the rotation of the last ``rope_dim`` channels of every row in interleaved pairs (or its inverse), the
other channels copied, out of place. CUDA-graph safe: the output comes from ``torch.empty``, the grid from shapes,
no host value (the caller passes the inverse frequencies made once, :func:`runtime.model.deepseek.rope.inv_freq_on`).
Dtypes float32 / bfloat16 / float16; float64 is refused (the torch functions serve it).
"""

from __future__ import annotations

import torch
import triton

from backends.kernels.checks import interpreted, require
from backends.kernels.dsv4 import rope_tail_kernels as k
from backends.kernels.pdl import use_pdl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the most elements of one program's [rows, channels] tile (V4-Flash: 4 heads x 512, 16 indexer heads x 128)
MAX_TILE = 2048


def takes(x: torch.Tensor, positions: torch.Tensor, rope_dim: int) -> bool:
    """Whether :func:`rope_tail` takes these arguments (else the torch path): a dtype of :data:`DTYPES`, at least
    2 dims with a contiguous last one of even width D, ``rope_dim`` even in ``0 .. D``, positions [T] integer."""
    return (x.dtype in DTYPES and x.dim() >= 2 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0
            and rope_dim % 2 == 0 and 0 <= rope_dim <= x.shape[-1] and positions.shape == x.shape[:1]
            and not positions.is_floating_point() and positions.device == x.device)


def rope_tail(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0,
              inverse: bool = False, pdl: bool = False, max_tile: int = MAX_TILE) -> torch.Tensor:
    """V4's RoPE of the last ``2 * inv_freq.shape[0]`` channels of every row, in one launch.

    Parameters
    ----------
    x : torch.Tensor
        [T, ..., D] in one dtype of :data:`DTYPES`, last dim contiguous, D even; the middle dims (heads) share
        their token's position.
    positions : [T] integer (int32 or int64) each token's position, on x's device.
    inv_freq : [rope_dim / 2] float32 the rope's inverse frequencies, rope_dim <= D (0 elements: a copy).
    attention_factor : cos / sin multiplier.
    inverse : undo the rotation (sin negated).
    pdl : launch with programmatic dependent launch where the GPU has it.
    max_tile : the most elements of one program's [rows, channels] tile.

    Returns
    -------
    torch.Tensor
        [T, ..., D] contiguous in x's dtype: pairs ``(x[2i], x[2i+1])`` of the last rope_dim channels rotated by
        ``float32(positions[t]) * inv_freq[i]`` (cos and sin times attention_factor), the rest copied.
    """
    half = inv_freq.shape[0] if inv_freq.dim() == 1 else -1
    require(x.dtype in DTYPES and x.dim() >= 2 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0,
            f"x [T, ..., D] of a dtype in {[str(d).removeprefix('torch.') for d in DTYPES]} with a contiguous, even "
            f"last dim (float64 or other layouts: TorchOps.rope_tail); got {tuple(x.shape)} {x.dtype} strides "
            f"{x.stride()}")
    require(inv_freq.dim() == 1 and inv_freq.dtype == torch.float32 and 2 * half <= x.shape[-1]
            and inv_freq.device == x.device,
            f"inv_freq [rope_dim / 2] float32 on x's device with rope_dim <= D = {x.shape[-1]}; got "
            f"{tuple(inv_freq.shape)} {inv_freq.dtype} on {inv_freq.device}")
    require(positions.shape == x.shape[:1] and not positions.is_floating_point() and positions.device == x.device,
            f"positions [T] = [{x.shape[0]}] integer on x's device {x.device}; got {tuple(positions.shape)} "
            f"{positions.dtype} on {positions.device}")
    t, d = x.shape[0], x.shape[-1]
    x3 = x.unsqueeze(1) if x.dim() == 2 else x.flatten(1, -2)  # [T, M, D] (a view where the middle dims allow)
    m = x3.shape[1]
    out = torch.empty(t, m, d, dtype=x.dtype, device=x.device)
    if t and m and d:
        block_d = triton.next_power_of_2(d)
        block_m = max(1, min(triton.next_power_of_2(m), max_tile // block_d))
        kern = k._rope_tail_kernel
        p = use_pdl(pdl, kern, x.device)
        kern[(t, triton.cdiv(m, block_m))](
            x3, positions, inv_freq, out, m, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1),
            float(attention_factor), D=d, HALF=half, INVERSE=bool(inverse), BLOCK_M=block_m, BLOCK_D=block_d,
            LIBDEVICE=not interpreted(kern), PDL=p, launch_pdl=p, num_warps=4 if block_m * block_d <= 2048
            else 8, enable_fp_fusion=False)  # no FMA: torch's roundings
    return out.view(x.shape)
