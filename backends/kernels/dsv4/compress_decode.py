"""Launcher of the fused V4 compressor decode step (kernel: :mod:`backends.kernels.dsv4.compress_decode_kernels`).

One launch does what :func:`runtime.model.dsv4.compressor.compress_decode` does (state update, window mix,
RMSNorm) plus the entry's RoPE that :class:`runtime.model.dsv4.layer.DSV4Attention` applies after it, for a whole
decode batch: no host value, no allocation but the output (CUDA-graph safe). Model dtypes float32 / bfloat16 /
float16 and state dtypes float32 / bfloat16 / float16; float64 is refused (the torch function serves it).
"""

from __future__ import annotations

import torch
import triton

from backends.kernels.checks import interpreted, require
from backends.kernels.dsv4 import compress_decode_kernels as k
from backends.kernels.pdl import use_pdl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the most elements of one [slots, channels] tile a program holds; a longer window runs in chunks of slots
#: (V4-Flash: CSA's 8 slots x 512 and the indexer's 8 x 128 in one tile; HCA's 128 x 512 in 8 chunks of 16)
MAX_TILE = 8192


def compress_decode(kv_new: torch.Tensor, gate_new: torch.Tensor, position_bias: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, pending_kv: torch.Tensor, pending_gate: torch.Tensor,
                    prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None, rows: torch.Tensor,
                    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0,
                    pdl: bool = False, max_tile: int = MAX_TILE) -> torch.Tensor:
    """A decode step of one compressor for every request, in place on the state, in one launch.

    Parameters
    ----------
    kv_new, gate_new : torch.Tensor
        [B, width] the new tokens' projections (gate without the position bias), one dtype of :data:`DTYPES`, last
        dim contiguous; ``width == 2 * dim`` (overlapping) or ``dim``.
    position_bias : [rate, width]; norm_weight : [dim] (any float dtype).
    pending_kv, pending_gate : torch.Tensor
        [R, rate, width] one layer's partial windows (``CompressorStatePool.pending_*[layer]``), one dtype of
        :data:`DTYPES`, same strides, last dim contiguous. Slot ``positions[b] % rate`` of row ``rows[b]`` is
        written.
    prev_kv, prev_gate : torch.Tensor or None
        [R, rate, dim] the previous window's A series (gate with bias), pending's dtype; given exactly when
        overlapping. Replaced by the current window's A series in rows whose window closed.
    rows, positions : [B] integer (int32 or int64) state rows (distinct, except a padding row) and positions.
    inv_freq : [rope_dim / 2] float32 the rope's inverse frequencies (0 elements: no RoPE); attention_factor :
        cos/sin multiplier.
    pdl : launch with programmatic dependent launch where the GPU has it.
    max_tile : the most elements of one [slots, channels] tile (longer windows run in chunks of slots).

    Returns
    -------
    torch.Tensor
        [B, dim] in kv_new's dtype: the candidate entry for entry ``positions[b] // rate`` (RMSNorm, then RoPE of
        the last ``rope_dim`` channels in interleaved pairs at position ``positions[b] // rate * rate``); a real
        entry where the token closed its window (see ``compress_decode``).
    """
    require(kv_new.dim() == 2 and gate_new.shape == kv_new.shape and gate_new.dtype == kv_new.dtype
            and kv_new.dtype in DTYPES and kv_new.stride(-1) == 1 and gate_new.stride(-1) == 1,
            f"kv_new and gate_new [B, width] of one dtype in {DTYPES} with a contiguous last dim (float64: the "
            f"torch compress_decode); got {tuple(kv_new.shape)} {kv_new.dtype}, {tuple(gate_new.shape)} "
            f"{gate_new.dtype}")
    b, width = kv_new.shape
    dim = norm_weight.shape[0]
    overlap = width == 2 * dim
    require(norm_weight.dim() == 1 and (overlap or width == dim),
            f"norm_weight [dim] with width == dim or 2 * dim; got width {width}, norm_weight "
            f"{tuple(norm_weight.shape)}")
    require(pending_kv.dim() == 3 and pending_gate.shape == pending_kv.shape and pending_kv.shape[2] == width
            and pending_gate.dtype == pending_kv.dtype and pending_kv.dtype in DTYPES
            and pending_gate.stride() == pending_kv.stride() and pending_kv.stride(-1) == 1,
            f"pending_kv / pending_gate [R, rate, {width}] of one dtype in {DTYPES} and one layout (last dim "
            f"contiguous); got {tuple(pending_kv.shape)} {pending_kv.dtype} {pending_kv.stride()}, "
            f"{tuple(pending_gate.shape)} {pending_gate.dtype} {pending_gate.stride()}")
    rate = pending_kv.shape[1]
    require(position_bias.shape == (rate, width) and position_bias.stride(-1) == 1,
            f"position_bias [{rate}, {width}] with a contiguous last dim; got {tuple(position_bias.shape)}")
    require((prev_kv is not None) == overlap and (prev_gate is not None) == overlap,
            f"prev_kv and prev_gate given exactly when overlapping (width {width}, dim {dim}); got "
            f"{prev_kv is not None}, {prev_gate is not None}")
    if overlap:
        shape = (pending_kv.shape[0], rate, dim)
        require(prev_kv.shape == shape and prev_gate.shape == shape and prev_kv.dtype == pending_kv.dtype
                and prev_gate.dtype == pending_kv.dtype and prev_gate.stride() == prev_kv.stride()
                and prev_kv.stride(-1) == 1,
                f"prev_kv / prev_gate {list(shape)} in {pending_kv.dtype}, one layout (last dim contiguous); got "
                f"{tuple(prev_kv.shape)} {prev_kv.dtype}, {tuple(prev_gate.shape)} {prev_gate.dtype}")
    require(rows.shape == (b,) and positions.shape == (b,) and not rows.is_floating_point()
            and not positions.is_floating_point(),
            f"rows and positions [{b}] integer; got {tuple(rows.shape)} {rows.dtype}, {tuple(positions.shape)} "
            f"{positions.dtype}")
    half = inv_freq.shape[0]
    require(inv_freq.dim() == 1 and inv_freq.dtype == torch.float32 and 2 * half <= dim and dim % 2 == 0,
            f"inv_freq [rope_dim / 2] float32 with rope_dim <= dim, dim even; got {tuple(inv_freq.shape)} "
            f"{inv_freq.dtype}, dim {dim}")
    out = torch.empty(b, dim, dtype=kv_new.dtype, device=kv_new.device)
    if b == 0:
        return out
    block_d = triton.next_power_of_2(dim)
    slots = 2 * rate if overlap else rate
    block_s = max(1, min(triton.next_power_of_2(slots), max(1, max_tile // block_d)))
    kern = k._compress_decode_kernel
    p = use_pdl(pdl, kern, kv_new.device)
    a_kv, a_gate = (prev_kv, prev_gate) if overlap else (pending_kv, pending_gate)  # unread when not overlapping
    kern[(b,)](kv_new, gate_new, position_bias, norm_weight, pending_kv, pending_gate, a_kv, a_gate, rows,
               positions, inv_freq, out, kv_new.stride(0), gate_new.stride(0), position_bias.stride(0),
               pending_kv.stride(0), pending_kv.stride(1), a_kv.stride(0), a_kv.stride(1), out.stride(0),
               float(eps), float(attention_factor), RATE=rate, DIM=dim, OVERLAP=overlap, HALF=half,
               BLOCK_D=block_d, BLOCK_S=block_s, LIBDEVICE=not interpreted(kern), PDL=p, launch_pdl=p,
               num_warps=4 if block_s * block_d <= 2048 else 8, enable_fp_fusion=False)  # no FMA: torch's roundings
    return out
