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
path's numbers), the fused ops run the block-fp8 kernels of :mod:`backends.kernels.gemm.fp8_gemm` on the GPU.
DeepSeek-V4's fp4 routed experts stay packed as a :class:`PackedFP4` (e2m1 bytes and one scale per row and
32 inputs, kept as the release stores it: a ue8m0 byte, 1 byte per 32 weights; float32 only for a checkpoint whose
float scales are not all powers of two, see :func:`fp4_scales`); on the CPU their product is the torch one
(dequantize per weight, then the matmul), on CUDA in bf16 / fp16 the routed experts take the fp4 expert kernels of
:mod:`backends.kernels.gemm.fp4_moe`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_BLOCK = (128, 128)  # DeepSeek's fp8 block (rows, cols)
FP4_GROUP = 32  # fp4 inputs per scale
UE8M0_BIAS = 127  # ue8m0 byte b -> 2 ** (b - 127); b = 0 .. 254 (255 is NaN)
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


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor | None:
    """Scales as ue8m0 bytes (uint8 b, the value ``2 ** (b - 127)``): ``float8_e8m0fnu`` / ``uint8`` as stored (a
    view); float scales when every value is exactly a power of two in 2**-127 .. 2**127 (then
    ``scale_values(bytes)`` equals ``scale.float()`` bit for bit), else None (a zero, a negative, a non-power of
    two, a value out of range, NaN / inf)."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return scale.view(torch.uint8)
    s = scale.float()
    _, e = torch.frexp(s)  # s = m * 2 ** e, m in [0.5, 1): a power of two has m = 0.5, 2 ** (e - 1)
    b = (e.long() - 1 + UE8M0_BIAS).clamp(0, 2 * UE8M0_BIAS).to(torch.uint8)
    return b if torch.equal(scale_values(b), s) else None


def fp4_scales(scale: torch.Tensor) -> torch.Tensor:
    """A :class:`PackedFP4`'s scales as held: ue8m0 bytes where :func:`ue8m0_bytes` can keep every value (the
    release's, and any float powers of two), else float32 values."""
    b = ue8m0_bytes(scale)
    return scale_values(scale) if b is None else b


def _scales_alike(scales: list[torch.Tensor]) -> list[torch.Tensor]:
    """Scales of parts joined into one weight, in one dtype: as they are when they agree, else all float32 (a
    float checkpoint's part whose scales are not all powers of two)."""
    if len({t.dtype for t in scales}) == 1:
        return scales
    return [scale_values(t) for t in scales]


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


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] (``in`` even) -> (packed e2m1 uint8 [..., out, in / 2], low nibble first; ue8m0 scales, uint8
    [..., out, ceil(in / group)]) as DeepSeek-V4's release stores its experts: per row and ``group`` inputs the
    scale is amax / 6 rounded up to a power of two (2 ** -127 .. 2 ** 127, the byte ``log2(scale) + 127``), each
    value the nearest e2m1 one (ties toward zero). Values already on that grid come back exactly from
    :func:`dequantize_fp4`; otherwise the error is at most half an e2m1 step: ``scale / 4`` below 2, ``scale / 2``
    up to 4, ``scale`` above (``scale <= amax / 3``)."""
    in_dim = w.shape[-1]
    if in_dim % 2:
        raise ValueError(f"quantize_fp4: got an input dim of {in_dim}; expected an even one (two values per byte)")
    groups = -(-in_dim // group)
    padded = torch.zeros(*w.shape[:-1], groups * group, dtype=torch.float32, device=w.device)
    padded[..., :in_dim] = w.float()
    grouped = padded.view(*w.shape[:-1], groups, group)
    amax = grouped.abs().amax(dim=-1)  # [..., out, groups]
    exp = torch.ceil(torch.log2(amax.clamp_min(2.0**-100) / E2M1_VALUES[7])).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    x = (grouped / exp.exp2()[..., None]).flatten(-2)[..., :in_dim]
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=w.device)  # between the e2m1 magnitudes
    nibble = torch.bucketize(x.abs(), mids) | ((x < 0).to(torch.int64) << 3)
    return (nibble[..., 0::2] | (nibble[..., 1::2] << 4)).to(torch.uint8), (exp + UE8M0_BIAS).to(torch.uint8)


class BlockLayoutError(ValueError):
    """A cut, concatenation or stack of :class:`BlockFP8` / :class:`PackedFP4` weights that would split a scale
    block (fp8) or group (fp4)."""


def _blocks(s: slice, n: int, b: int, what: str, unit: str = "fp8 scale block") -> slice:
    """Element slice ``s`` of a dim of ``n`` -> the slice of its scale blocks of ``b``; it must start on a block
    boundary and end on one or at ``n``."""
    r = range(n)[s]
    if r.step != 1 or r.start % b or (r.stop % b and r.stop != n):
        raise BlockLayoutError(
            f"{what}: got the element range [{r.start}, {r.stop}) of {n}; expected a range that starts on a "
            f"multiple of the {unit} ({b}) and ends on one or at {n}. Fix: model.weights=dequantize, or a "
            f"parallel.tp that cuts whole {b}-blocks")
    return slice(r.start // b, -(-r.stop // b))


class _Stored:
    """What the stored formats share (:class:`BlockFP8`, :class:`PackedFP4`): ``weight`` and ``scale`` tensors and
    their scale layout (``layout``: the fp8 block, or the fp4 group); indexing through each format's
    :meth:`index_of`, so an expert, rows or columns are taken with the scales that cover them."""

    weight: torch.Tensor
    scale: torch.Tensor

    @property
    def layout(self):
        raise NotImplementedError

    def _with(self, weight: torch.Tensor, scale: torch.Tensor):
        return type(self)(weight, scale, self.layout)

    def scale_unit(self, dim: int) -> int:
        """Elements per scale along ``dim`` (1 on the expert dims)."""
        lead = self.weight.dim() - 2
        return 1 if dim < lead else self.scale_block[dim - lead]

    @property
    def scale_block(self) -> tuple[int, int]:
        """(rows, cols) of the weight elements one scale covers."""
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype (fp8 values, or packed fp4 bytes)."""
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

    def __getitem__(self, key):
        w_idx, s_idx = self.index_of(key)
        return self._with(self.weight[w_idx], self.scale[s_idx])

    def __setitem__(self, key, value) -> None:
        w_idx, s_idx = self.index_of(key)
        if type(value) is not type(self) or value.layout != self.layout:
            raise BlockLayoutError(f"{type(self).__name__} store: got {type(value).__name__} with scale layout "
                                   f"{value.layout if isinstance(value, _Stored) else None}; expected {self.layout}")
        self.weight[w_idx] = value.weight
        if value.scale.dtype == self.scale.dtype:
            self.scale[s_idx] = value.scale
        elif self.scale.dtype == torch.float32:
            self.scale[s_idx] = scale_values(value.scale)
        elif (b := ue8m0_bytes(value.scale)) is not None:
            self.scale[s_idx] = b
        else:
            raise BlockLayoutError(f"{type(self).__name__} store: got scales that are not all powers of two in "
                                   f"2**-127 .. 2**127; expected values the ue8m0 storage holds. Fix: allocate "
                                   f"it with float32 scales")

    def contiguous(self):
        return self._with(self.weight.contiguous(), self.scale.contiguous())

    def is_contiguous(self) -> bool:
        return self.weight.is_contiguous() and self.scale.is_contiguous()


@dataclass(frozen=True)
class BlockFP8(_Stored):
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
    def layout(self) -> tuple[int, int]:
        return self.block

    @property
    def scale_block(self) -> tuple[int, int]:
        return tuple(self.block)

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


@dataclass(frozen=True)
class PackedFP4(_Stored):
    """A weight as DeepSeek-V4's release stores its routed experts: e2m1 values packed two per byte (low nibble
    first) and a scale per row and ``group`` inputs; ``value = e2m1 * scale``. ``weight`` uint8 [N, K / 2] or
    [E, N, K / 2] (stacked experts); ``scale`` [..., N, ceil(K / group)], ue8m0 as the release stores it (uint8 b:
    ``2 ** (b - 127)``, 1 byte) or float32 values (a float checkpoint whose scales are not all powers of two: see
    :func:`fp4_scales`), both read with :func:`scale_values`. :attr:`shape` is the unpacked one ([..., N, K]).

    Indexing takes an expert (``w[e]``), any rows (each row has its own scales) and whole groups of columns
    (``w[:, c0:c1]``: 16 bytes per 32-input group); a cut through a group raises :class:`BlockLayoutError`."""

    weight: torch.Tensor
    scale: torch.Tensor
    group: int = FP4_GROUP

    @classmethod
    def empty(cls, shape: tuple[int, ...], device: torch.device | str, group: int = FP4_GROUP,
              scale_dtype: torch.dtype = torch.uint8) -> PackedFP4:
        """Uninitialized storage for a weight (or stack) of unpacked ``shape``, ue8m0 scales (or float32 ones):
        fill it with ``w[i] = part``."""
        return cls(torch.empty((*shape[:-1], shape[-1] // 2), dtype=torch.uint8, device=device),
                   torch.empty((*shape[:-1], -(-shape[-1] // group)), dtype=scale_dtype, device=device), group)

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int = FP4_GROUP) -> PackedFP4:
        """[..., N, K] float -> its packed fp4 form (:func:`quantize_fp4`), one expert at a time for a stack."""
        if w.dim() > 2:
            parts = [cls.quantize(x, group) for x in w]
            return cls(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]), group)
        q, s = quantize_fp4(w, group)
        return cls(q, s, group)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.weight.shape[:-1], 2 * self.weight.shape[-1]))

    @property
    def layout(self) -> int:
        return self.group

    @property
    def scale_block(self) -> tuple[int, int]:
        return (1, self.group)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight (or stack) in ``dtype``: what ``model.weights=dequantize`` loads."""
        return apply_block_scales(unpack_fp4(self.weight), self.scale, (1, self.group), dtype)

    def index_of(self, key) -> tuple[tuple, tuple]:
        """(packed weight index, scale index) of ``key`` (unpacked element coordinates): ints or slices on the
        leading (expert) dims, slices on the last two, the columns on whole groups."""
        key = key if isinstance(key, tuple) else (key,)
        lead = self.weight.dim() - 2
        w_idx, s_idx = [], []
        for d, k in enumerate(key):
            if d < lead and isinstance(k, int):
                w_idx.append(k)
                s_idx.append(k)
            elif not isinstance(k, slice):
                raise BlockLayoutError(f"PackedFP4 index: got {key!r}; expected ints on the expert dims, then slices")
            elif d <= lead:  # experts, rows: one scale row per weight row
                w_idx.append(k)
                s_idx.append(k)
            else:
                g = _blocks(k, self.shape[d], self.group, f"a cut of a {list(self.shape)} fp4 weight",
                            "fp4 scale group")
                r = range(self.shape[d])[k]
                w_idx.append(slice(r.start // 2, r.stop // 2))
                s_idx.append(g)
        return tuple(w_idx), tuple(s_idx)


#: a weight held as stored (block-fp8 or packed fp4)
QUANTIZED = (BlockFP8, PackedFP4)
#: a linear layer's weight as the model holds it: a float tensor, or block-fp8 / packed fp4 as stored
Weight = torch.Tensor | BlockFP8 | PackedFP4


def stored_weight(kind: StoredKind, block: tuple[int, int], weight: torch.Tensor, scale: torch.Tensor
                  ) -> BlockFP8 | PackedFP4:
    """A checkpoint's stored tensors (fp8 e4m3, or packed fp4 bytes in any 1-byte dtype) and their scales (any
    storage :func:`scale_values` reads) -> the weight as held: fp8 scales as float32; fp4 scales as ue8m0 bytes
    (the release's ``F8_E8M0`` / ``U8`` as stored, float powers of two converted), else float32
    (:func:`fp4_scales`)."""
    if kind == StoredKind.fp4:
        return PackedFP4(weight.contiguous().view(torch.uint8), fp4_scales(scale), block[1])
    return BlockFP8(weight, scale_values(scale), tuple(block))


def cat_rows(parts: list[Weight], dim: int = 0) -> Weight:
    """Weights concatenated along ``dim`` (q_a with kv_a, gate with up): float tensors with ``torch.cat``;
    block-fp8 / packed fp4 ones with their scales, every part but the last a whole number of blocks (fp8) or
    groups (fp4 columns) along ``dim``."""
    first = parts[0]
    if not isinstance(first, QUANTIZED):
        return torch.cat(parts, dim=dim)
    dim = dim % first.dim()
    b = first.scale_unit(dim)
    for p in parts[:-1]:
        if p.shape[dim] % b:
            raise BlockLayoutError(
                f"fusing stored weights along dim {dim}: got a part of {p.shape[dim]} rows; expected a multiple of the "
                f"scale block ({b}) for every part but the last. Fix: model.weights=dequantize")
    return first._with(torch.cat([p.weight for p in parts], dim=dim),
                       torch.cat(_scales_alike([p.scale for p in parts]), dim=dim))


def stack_weights(parts: list[Weight]) -> Weight:
    """Weights of one shape stacked along a new expert dim: ``torch.stack``, or values and scales stacked (fp4
    scales of mixed storage as float32)."""
    first = parts[0]
    if not isinstance(first, QUANTIZED):
        return torch.stack(parts)
    return first._with(torch.stack([p.weight for p in parts]), torch.stack(_scales_alike([p.scale for p in parts])))


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a ``dtype`` tensor: a stored one dequantized, a float one cast."""
    return w.dequantize(dtype) if isinstance(w, QUANTIZED) else w.to(dtype)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """x [T, K] @ w [N, K].T -> [T, N] in x's dtype, torch ops: a block-fp8 or packed fp4 weight is dequantized to
    x's dtype first (the numbers of ``model.weights=dequantize``, bit for bit)."""
    return F.linear(x, w.dequantize(x.dtype) if isinstance(w, QUANTIZED) else w)


def weight_tensors(w: Weight | None) -> list[torch.Tensor]:
    """The tensors that hold a weight (a stored one: values and scales)."""
    if w is None:
        return []
    return w.tensors if isinstance(w, QUANTIZED) else [w]


STORED_KEYS = {BlockFP8: "float8_e4m3fn", PackedFP4: "fp4 e2m1 (packed)"}
FLOAT32_SCALES, UE8M0_SCALES = "float32 scales", "ue8m0 scales"


def scale_key(scale: torch.Tensor) -> str:
    """The :func:`bytes_by_dtype` key of a stored weight's scales: ue8m0 bytes, or float32 values."""
    return UE8M0_SCALES if scale.dtype in (torch.uint8, torch.float8_e8m0fnu) else FLOAT32_SCALES


def bytes_by_dtype(weights) -> dict[str, int]:
    """dtype -> bytes of ``weights`` (tensors, BlockFP8s and PackedFP4s, each counted once): ``float8_e4m3fn`` for
    stored fp8 values, ``fp4 e2m1 (packed)`` for packed fp4 bytes, ``float32 scales`` for fp8 (and float fp4)
    scales, ``ue8m0 scales`` for fp4 scales kept as ue8m0 bytes, the float dtypes of every other tensor."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for v in weights:
        parts = [(STORED_KEYS[type(v)], v.weight), (scale_key(v.scale), v.scale)] if isinstance(v, QUANTIZED) \
            else [(str(v.dtype).removeprefix("torch."), v)]
        for key, t in parts:
            if id(t) not in seen:
                seen.add(id(t))
                out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out
