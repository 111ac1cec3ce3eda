"""Block-scaled low-precision checkpoint weights -> a float dtype, at load time (the storage formats of DeepSeek's
releases; transformers' ``Fp8Dequantize`` reads the same ones).

* **fp8 e4m3** ``[out, in]`` with one scale per ``block = (rows, cols)`` block, scale grid
  ``[ceil(out / rows), ceil(in / cols)]`` (the edge blocks may be partial): ``w = fp8 * scale``. DeepSeek-V3/V3.2:
  float32 ``<name>_scale_inv``, 128 x 128; DeepSeek-V4: ue8m0 ``<module>.scale``, 128 x 128.
* **fp4 e2m1** (DeepSeek-V4's routed experts): two values per byte, the low nibble first, ``[out, in / 2]`` bytes
  (int8, or torch's ``float4_e2m1fn_x2``), one scale per row and 32 inputs: ``[out, ceil(in / 32)]``.
* **scales**: ``float8_e8m0fnu`` (ue8m0: the power of two ``2 ** (b - 127)`` in one byte b), the same bytes as
  ``uint8``, or float32 / bf16 / fp16 values.

``model.weights=dequantize`` expands the weights to the model dtype when they are read (the reference: a model
loaded from fp8 then holds twice its fp8 bytes in bf16). ``model.weights=stored`` (the default for a quantized
checkpoint) keeps each fp8 matrix as a :class:`BlockFP8`: the e4m3 values and float32 block scales, on the device
as shipped; :func:`linear` is its torch product (per-weight dequantize, then the matmul: exactly the dequantize
path's numbers), the fused ops run the block-fp8 kernels of :mod:`backends.kernels.fp8_gemm` on the GPU.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    """float32 ``values`` [..., out, in] times one scale per ``block`` -> ``dtype`` [..., out, in].

    ``scale`` [..., ceil(out / rows), ceil(in / cols)] (any storage :func:`scale_values` reads). A slice of a larger
    weight: ``values`` its rows / columns, ``scale`` the blocks that cover them, ``row0`` / ``col0`` where the slice
    starts inside its first block row / column (``start % rows``, ``start % cols``)."""
    out_dim, in_dim = values.shape[-2:]
    s = scale_values(scale).repeat_interleave(block[0], -2)[..., row0 : row0 + out_dim, :]
    s = s.repeat_interleave(block[1], -1)[..., col0 : col0 + in_dim]
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


class BlockLayoutError(ValueError):
    """A cut, concatenation or stack of :class:`BlockFP8` weights that would split a scale block."""


def _blocks(s: slice, n: int, b: int, what: str) -> slice:
    """Element slice ``s`` of a dim of ``n`` -> the slice of its scale blocks of ``b``; it must start on a block
    boundary and end on one or at ``n``."""
    r = range(n)[s]
    if r.step != 1 or r.start % b or (r.stop % b and r.stop != n):
        raise BlockLayoutError(
            f"{what}: got the element range [{r.start}, {r.stop}) of {n}; expected a range that starts on a "
            f"multiple of the fp8 scale block ({b}) and ends on one or at {n}. Fix: model.weights=dequantize, or a "
            f"parallel.tp that cuts whole {b}-blocks")
    return slice(r.start // b, -(-r.stop // b))


@dataclass(frozen=True)
class BlockFP8:
    """A weight as DeepSeek's fp8 releases store it: e4m3 values and a float32 scale per ``block`` of
    (rows, cols) elements; ``value = weight * scale`` of its block. ``weight`` [N, K] (a linear layer, F.linear's
    layout) or [E, N, K] (stacked experts); ``scale`` [..., ceil(N / rows), ceil(K / cols)].

    Indexing takes an expert (``w[e]``: [N, K]) or whole blocks of rows / columns (``w[r0:r1]``,
    ``w[:, c0:c1]``, ``w[e, r0:r1]``); a cut through a block raises :class:`BlockLayoutError`."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] = FP8_BLOCK

    @classmethod
    def empty(cls, shape: tuple[int, ...], device: torch.device | str,
              block: tuple[int, int] = FP8_BLOCK) -> BlockFP8:
        """Uninitialized storage for a weight (or stack) of ``shape``: fill it with ``w[i] = part``."""
        grid = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
        return cls(torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
                   torch.empty(grid, dtype=torch.float32, device=device), tuple(block))

    @classmethod
    def quantize(cls, w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> BlockFP8:
        """[N, K] float -> its block-fp8 form (:func:`quantize_fp8`)."""
        q, s = quantize_fp8(w, block)
        return cls(q, s, tuple(block))

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scale]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def dim(self) -> int:
        return self.weight.dim()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight (or stack) in ``dtype``: what ``model.weights=dequantize`` loads."""
        return apply_block_scales(self.weight.float(), self.scale, self.block, dtype)

    def index_of(self, key) -> tuple[tuple, tuple]:
        """(weight index, scale index) of ``key``: ints on the leading (expert) dims, slices on the last two."""
        key = key if isinstance(key, tuple) else (key,)
        lead = self.weight.dim() - 2
        w_idx, s_idx = [], []
        for d, k in enumerate(key):
            if d < lead and isinstance(k, int):
                w_idx.append(k)
                s_idx.append(k)
                continue
            if not isinstance(k, slice):
                raise BlockLayoutError(f"BlockFP8 index: got {key!r}; expected ints on the expert dims, then slices")
            if d < lead:
                w_idx.append(k)
                s_idx.append(k)
            else:
                b = self.block[d - lead]
                w_idx.append(k)
                s_idx.append(_blocks(k, self.weight.shape[d], b, f"a cut of a {list(self.shape)} fp8 weight"))
        return tuple(w_idx), tuple(s_idx)

    def __getitem__(self, key) -> BlockFP8:
        w_idx, s_idx = self.index_of(key)
        return BlockFP8(self.weight[w_idx], self.scale[s_idx], self.block)

    def __setitem__(self, key, value: BlockFP8) -> None:
        w_idx, s_idx = self.index_of(key)
        if tuple(value.block) != tuple(self.block):
            raise BlockLayoutError(f"BlockFP8 store: got a block of {value.block}; expected {self.block}")
        self.weight[w_idx] = value.weight
        self.scale[s_idx] = value.scale

    def contiguous(self) -> BlockFP8:
        return BlockFP8(self.weight.contiguous(), self.scale.contiguous(), self.block)

    def is_contiguous(self) -> bool:
        return self.weight.is_contiguous() and self.scale.is_contiguous()


#: a linear layer's weight as the model holds it: a float tensor, or block-fp8 as stored
Weight = torch.Tensor | BlockFP8


def cat_rows(parts: list[Weight], dim: int = 0) -> Weight:
    """Weights concatenated along ``dim`` (q_a with kv_a, gate with up): float tensors with ``torch.cat``;
    block-fp8 ones with their scales, every part but the last a whole number of blocks along ``dim``."""
    if not isinstance(parts[0], BlockFP8):
        return torch.cat(parts, dim=dim)
    dim = dim % parts[0].dim()
    b = parts[0].block[dim - (parts[0].dim() - 2)]
    for p in parts[:-1]:
        if p.shape[dim] % b:
            raise BlockLayoutError(
                f"fusing fp8 weights along dim {dim}: got a part of {p.shape[dim]} rows; expected a multiple of the "
                f"fp8 scale block ({b}) for every part but the last. Fix: model.weights=dequantize")
    return BlockFP8(torch.cat([p.weight for p in parts], dim=dim), torch.cat([p.scale for p in parts], dim=dim),
                    parts[0].block)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, K] @ w [N, K].T -> [T, N] in x's dtype, torch ops: a block-fp8 weight is dequantized to x's dtype
    first (the numbers of ``model.weights=dequantize``, bit for bit)."""
    return F.linear(x, w.dequantize(x.dtype) if isinstance(w, BlockFP8) else w)


def weight_tensors(w: Weight | None) -> list[torch.Tensor]:
    """The tensors that hold a weight (a block-fp8 one: values and scales)."""
    if w is None:
        return []
    return w.tensors if isinstance(w, BlockFP8) else [w]


def bytes_by_dtype(weights) -> dict[str, int]:
    """dtype -> bytes of ``weights`` (tensors and BlockFP8s, each counted once): ``float8_e4m3fn`` for stored fp8
    values, ``float32 scales`` for their block scales, the float dtypes of every other tensor."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for v in weights:
        parts = [("float8_e4m3fn", v.weight), ("float32 scales", v.scale)] if isinstance(v, BlockFP8) \
            else [(str(v.dtype).removeprefix("torch."), v)]
        for key, t in parts:
            if id(t) not in seen:
                seen.add(id(t))
                out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out
