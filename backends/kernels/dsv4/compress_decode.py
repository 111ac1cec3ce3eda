"""Launcher of the fused V4 compressor decode step (kernel: :mod:`backends.kernels.dsv4.compress_decode_kernels`).

Two launches do what :func:`runtime.model.dsv4.compressor.compress_decode` does (state update, window mix, RMSNorm)
plus the entry's RoPE that :class:`runtime.model.dsv4.layer.DSV4Attention` applies after it, for a whole decode
batch: the state update and the per-channel mix on a grid of (request, channel block) programs, writing the mixed
rows into the output; then the RMSNorm and RoPE of each row in place, one program per request. No host value, no
allocation but the output (CUDA-graph safe). Model dtypes float32 / bfloat16 / float16 and state dtypes float32 /
bfloat16 / float16; float64 is refused (the torch function serves it).
"""

from __future__ import annotations

import torch
import triton

from backends.kernels.checks import interpreted, require
from backends.kernels.dsv4 import compress_decode_kernels as k
from backends.kernels.pdl import use_pdl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: the most elements of one [slots, channels] tile a program holds; a longer window runs in chunks of slots
#: (V4-Flash, channel blocks of 16 / 8: every window in one tile, HCA's the largest at 128 slots x 16)
MAX_TILE = 8192
#: channel blocks per request the launcher aims at (batch 1 then spreads over that many SMs), and the fewest
#: channels of a block (32 bytes of a float32 state row per slot: whole memory sectors)
BLOCKS_PER_ROW, MIN_BLOCK_C = 32, 8


def block_channels(dim: int) -> int:
    """Channels per program of the mix: a power of two near ``dim / BLOCKS_PER_ROW``, at least ``MIN_BLOCK_C``
    (V4-Flash: 16 for the kv compressors' dim 512, 32 blocks; 8 for the indexer's dim 128, 16 blocks)."""
    return min(triton.next_power_of_2(dim), max(MIN_BLOCK_C, triton.next_power_of_2(triton.cdiv(dim, BLOCKS_PER_ROW))))


def compress_decode(kv_new: torch.Tensor, gate_new: torch.Tensor, position_bias: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, pending_kv: torch.Tensor, pending_gate: torch.Tensor,
                    prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None, rows: torch.Tensor,
                    positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0,
                    pdl: bool = False, max_tile: int = MAX_TILE, block_c: int | None = None) -> torch.Tensor:
    """A decode step of one compressor for every request, in place on the state, in two launches.

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
    block_c : channels per program of the mix, a power of two (None: :func:`block_channels`, or under Triton's
        interpreter, whose time grows with the programs, the whole row).

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
    mix, norm = k._compress_mix_kernel, k._norm_rope_kernel
    if block_c is None:
        block_c = triton.next_power_of_2(dim) if interpreted(mix) else block_channels(dim)
    require(isinstance(block_c, int) and block_c >= 1 and block_c & (block_c - 1) == 0,
            f"block_c a power of two; got {block_c!r}")
    slots = 2 * rate if overlap else rate
    block_s = max(1, min(triton.next_power_of_2(slots), max(1, max_tile // block_c)))
    p = use_pdl(pdl, mix, kv_new.device)
    a_kv, a_gate = (prev_kv, prev_gate) if overlap else (pending_kv, pending_gate)  # unread when not overlapping
    warps = min(8, max(1, block_s * block_c // 256))  # 8 values of a tile per thread (V4-Flash CSA: 1 warp, HCA: 8)
    mix[(b, triton.cdiv(dim, block_c))](
        kv_new, gate_new, position_bias, pending_kv, pending_gate, a_kv, a_gate, rows, positions, out,
        kv_new.stride(0), gate_new.stride(0), position_bias.stride(0), pending_kv.stride(0), pending_kv.stride(1),
        a_kv.stride(0), a_kv.stride(1), out.stride(0), RATE=rate, DIM=dim, OVERLAP=overlap, BLOCK_C=block_c,
        BLOCK_S=block_s, LIBDEVICE=not interpreted(mix), PDL=p, launch_pdl=p,
        num_warps=warps, enable_fp_fusion=False)  # no FMA: torch's roundings
    block_d = triton.next_power_of_2(dim)
    norm[(b,)](norm_weight, positions, inv_freq, out, out.stride(0), float(eps), float(attention_factor), RATE=rate,
               DIM=dim, HALF=half, BLOCK_D=block_d, PDL=p, launch_pdl=p, num_warps=4 if block_d >= 1024 else 2,
               enable_fp_fusion=False)
    return out
