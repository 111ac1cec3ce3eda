"""Block-scaled low-precision checkpoint weights -> a float dtype, at load time (the storage formats of DeepSeek's
releases; transformers' ``Fp8Dequantize`` reads the same ones).

* **fp8 e4m3** ``[out, in]`` with one scale per ``block = (rows, cols)`` block, scale grid
  ``[ceil(out / rows), ceil(in / cols)]`` (the edge blocks may be partial): ``w = fp8 * scale``. DeepSeek-V3/V3.2:
  float32 ``<name>_scale_inv``, 128 x 128; DeepSeek-V4: ue8m0 ``<module>.scale``, 128 x 128.
* **fp4 e2m1** (DeepSeek-V4's routed experts): two values per byte, the low nibble first, ``[out, in / 2]`` bytes
  (int8, or torch's ``float4_e2m1fn_x2``), one scale per row and 32 inputs: ``[out, ceil(in / 32)]``.
* **scales**: ``float8_e8m0fnu`` (ue8m0: the power of two ``2 ** (b - 127)`` in one byte b), the same bytes as
  ``uint8``, or float32 / bf16 / fp16 values.

The weights are expanded to the model dtype when they are read; computing in the storage format is not built, so a
model loaded from fp8 holds twice its fp8 bytes in bf16, and four times its fp4 bytes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

FP8_BLOCK = (128, 128)  # DeepSeek's fp8 block (rows, cols)
FP4_GROUP = 32  # fp4 inputs per scale
E4M3_MAX = 448.0
# e2m1 nibble -> value: sign bit 3, exponent bits 2..1, mantissa bit 0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class StoredKind(str, enum.Enum):
    fp8 = "fp8"  # float8_e4m3fn, block scales
    fp4 = "fp4"  # e2m1 packed two per byte, scales per row and FP4_GROUP inputs


@dataclass(frozen=True)
class ScaledTensor:
    """How one stored weight becomes floats: its format, the checkpoint tensor holding its scales, and the block
    of (unpacked) weight elements each scale covers."""

    kind: StoredKind
    scale: str  # the scale tensor's name in the checkpoint
    block: tuple[int, int]  # (rows, cols) per scale

    def dequantize(self, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The stored tensor (fp8 [out, in] or packed fp4 [out, in / 2]) and its scales -> ``dtype`` [out, in]."""
        values = unpack_fp4(w) if self.kind == StoredKind.fp4 else w.float()
        return apply_block_scales(values, scale, self.block, dtype)


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as float32: ue8m0 (``float8_e8m0fnu``) or its raw ``uint8`` bytes b -> ``2 ** (b - 127)``; float
    scales as they are."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return (scale.view(torch.uint8).float() - 127.0).exp2()
    return scale.float()


def apply_block_scales(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                       row0: int = 0, col0: int = 0) -> torch.Tensor:
    """float32 ``values`` [out, in] times one scale per ``block`` -> ``dtype`` [out, in].

    ``scale`` [ceil(out / rows), ceil(in / cols)] (any storage :func:`scale_values` reads). A slice of a larger
    weight: ``values`` its rows / columns, ``scale`` the blocks that cover them, ``row0`` / ``col0`` where the slice
    starts inside its first block row / column (``start % rows``, ``start % cols``)."""
    out_dim, in_dim = values.shape
    s = scale_values(scale).repeat_interleave(block[0], 0)[row0 : row0 + out_dim]
    s = s.repeat_interleave(block[1], 1)[:, col0 : col0 + in_dim]
    return (values * s).to(dtype)


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, row0: int = 0, col0: int = 0,
                   block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """fp8 e4m3 [out, in] and block scales [ceil(out / rows), ceil(in / cols)] -> ``dtype`` [out, in] (a slice:
    see :func:`apply_block_scales`)."""
    return apply_block_scales(w.float(), scale, block, dtype, row0, col0)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 [..., n] (int8 / uint8 / ``float4_e2m1fn_x2`` bytes, low nibble first) -> float32 [..., 2n]."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    b = packed.contiguous().view(torch.uint8).long()
    return torch.stack([table[b & 0xF], table[b >> 4]], dim=-1).flatten(-2)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   group: int = FP4_GROUP) -> torch.Tensor:
    """Packed fp4 [out, in / 2] and scales [out, ceil(in / group)] -> ``dtype`` [out, in]."""
    return apply_block_scales(unpack_fp4(packed), scale, (1, group), dtype)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (fp8 e4m3 [out, in], float32 block scales [ceil(out / rows), ceil(in / cols)]) such that
    :func:`dequantize_fp8` gives back ``w`` up to fp8 rounding (each block scaled to e4m3's max 448)."""
    out_dim, in_dim = w.shape
    (br, bc), rb, cb = block, -(-out_dim // block[0]), -(-in_dim // block[1])
    padded = torch.zeros(rb * br, cb * bc, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.float()
    blocks = padded.view(rb, br, cb, bc)
    scale = (blocks.abs().amax(dim=(1, 3)) / E4M3_MAX).clamp_min(1e-12)  # [rb, cb]
    q = (blocks / scale[:, None, :, None]).view(rb * br, cb * bc)[:out_dim, :in_dim]
    return q.to(torch.float8_e4m3fn).contiguous(), scale
