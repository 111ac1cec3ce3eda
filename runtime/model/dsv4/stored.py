"""How a DeepSeek-V4 checkpoint stores each tensor, checked from the safetensors headers before anything is read.

Float tensors (bf16 / fp16 / fp32 / fp64; ``tid2eid`` int32 / int64) are read as they are. DeepSeek's release
format (config.json's ``quantization_config``, read into ``model.v4.fp8_block`` / ``expert_dtype`` by
:mod:`runtime.model.dsv4.hf_config`) adds:

* fp8 e4m3 matrices (``F8_E4M3``) with a sibling scale per ``fp8_block`` block (128 x 128), named
  ``<module>.scale`` (the release) or ``<module>.weight_scale_inv`` (transformers), stored as ue8m0
  (``F8_E8M0``), its bytes (``U8``) or float values: ``[ceil(out / 128), ceil(in / 128)]``;
* with ``expert_dtype: fp4``, routed experts' ``w1`` / ``w2`` / ``w3`` as e2m1 two per byte, low nibble first
  (``I8`` ``[out, in / 2]``, or safetensors' ``F4`` whose header counts fp4 elements ``[out, in]``), a scale per
  row and 32 inputs ``[out, ceil(in / 32)]``.

The release also ships bf16 tensors without scales (the compressors' and the indexer's ``wkv`` / ``wgate`` /
``weights_proj``, norms, sinks, ...): any tensor may be float. :func:`check_tensor` returns how to read a tensor
(a :class:`runtime.model.quantized.ScaledTensor`, or None for float) and every problem with it.

``model.weights=stored`` keeps the fp8 matrices as :class:`~runtime.model.quantized.BlockFP8` and the fp4 experts as
:class:`~runtime.model.quantized.PackedFP4`; tensor parallelism then cuts them on whole 128 x 128 blocks / 32-input
groups (16 bytes), as does the loader's fusion of each expert's gate with its up rows:
:func:`stored_layout_problems` lists every cut that would split one before anything is read, with the
``parallel.tp`` values that work. :func:`release_kind` says which tensors the release stores quantized (what the
presets generate with ``model.weights=fp8``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.core.config import DSV4ExpertDtype
from runtime.core.errors import Problem
from runtime.core.parallel import Sharding
from runtime.model.deepseek.checkpoint import TensorInfo
from runtime.model.deepseek.stored import layout_problems
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.sharding import dsv4_tensor_cut
from runtime.model.quantized import FP4_GROUP, ScaledTensor, StoredKind

FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")
INT_DTYPES = ("I64", "I32")
FP8_DTYPE = "F8_E4M3"
FP4_DTYPES = ("I8", "F4")  # packed bytes [out, in / 2]; safetensors' float4 (header shape in fp4 elements)
UE8M0_SCALE_DTYPES = ("F8_E8M0", "U8")  # ue8m0 bytes (fp4 scales are held so whatever their values)
SCALE_DTYPES = (*UE8M0_SCALE_DTYPES, "F32", "BF16", "F16")
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")  # the release's spelling, transformers'


@dataclass(frozen=True)
class StoredFormat:
    """What config.json declares about storage: the fp8 scale block (None: no fp8 weights) and the routed
    experts' format ("fp8", "fp4", or None: float)."""

    fp8_block: tuple[int, int] | None = None
    expert_dtype: str | None = None

    @classmethod
    def of(cls, model: dict) -> StoredFormat:
        """From the resolved `model` config (``model.v4``)."""
        v4 = model.get("v4") or {}
        block, experts = v4.get("fp8_block"), v4.get("expert_dtype")
        return cls(tuple(int(b) for b in block) if block else None,
                   DSV4ExpertDtype(experts).value if experts else None)


def scale_names(index: dict[str, TensorInfo]) -> dict[str, str]:
    """Checkpoint weight name -> the name of its scale tensor, for every ``X.weight`` with an ``X.scale`` or
    ``X.weight_scale_inv`` beside it."""
    out = {}
    for name in index:
        if name.endswith(".weight"):
            for suffix in SCALE_SUFFIXES:
                if name.removesuffix(".weight") + suffix in index:
                    out[name] = name.removesuffix(".weight") + suffix
    return out


def check_tensor(what: str, name: str, index: dict[str, TensorInfo], scales: dict[str, str],
                 shape: tuple[int, ...], fmt: StoredFormat, *, integer: bool, routed_expert: bool
                 ) -> tuple[ScaledTensor | None, list[Problem]]:
    """Checkpoint tensor ``name`` (``what`` names it and its file) against the ``shape`` the config implies:
    (how to read it, every problem)."""
    info = index[name]
    fp4 = routed_expert and fmt.expert_dtype == "fp4"
    fp8 = fmt.fp8_block is not None and not fp4 and len(shape) == 2
    if integer or info.dtype in FLOAT_DTYPES:
        allowed = INT_DTYPES if integer else FLOAT_DTYPES
        problems = _shape(what, list(info.shape), list(shape), "(from config.json)")
        if info.dtype not in allowed:
            problems.append(Problem(what, f"dtype {info.dtype}", f"one of {list(allowed)}",
                                    "save the checkpoint with transformers (tid2eid stays int64)"))
        return None, problems
    if info.dtype == FP8_DTYPE and fp8:
        kind, block = StoredKind.fp8, fmt.fp8_block
        problems = _shape(what, list(info.shape), list(shape), "(fp8 e4m3, from config.json)")
    elif info.dtype in FP4_DTYPES and fp4:
        kind, block = StoredKind.fp4, (1, FP4_GROUP)
        packed = list(shape) if info.dtype == "F4" else [shape[0], shape[1] // 2]
        note = f"(fp4 e2m1 of the config's {list(shape)}" + (", two per byte)" if info.dtype == "I8" else ")")
        problems = _shape(what, list(info.shape), packed, note)
        if shape[1] % 2:
            problems.append(Problem(what, f"an odd input dim {shape[1]} stored as fp4", "an even input dim",
                                    "store this expert in bf16"))
    else:
        allowed = [*FLOAT_DTYPES, *([FP8_DTYPE] if fp8 else []), *(FP4_DTYPES if fp4 else [])]
        why = (" (config.json has no quantization_config)" if fmt.fp8_block is None
               else f" (config.json: expert_dtype {fmt.expert_dtype!r})" if routed_expert else "")
        return None, [Problem(what, f"dtype {info.dtype}", f"one of {allowed}{why}",
                              "declare the release's quantization_config / expert_dtype in config.json, or save "
                              "the checkpoint with transformers in bf16")]
    return _with_scale(what, name, index, scales, shape, kind, block, problems)


def _with_scale(what: str, name: str, index: dict[str, TensorInfo], scales: dict[str, str],
                shape: tuple[int, ...], kind: StoredKind, block: tuple[int, int], problems: list[Problem]
                ) -> tuple[ScaledTensor | None, list[Problem]]:
    """The scale beside an fp8 / fp4 weight: present, of the grid ``block`` implies, in a scale dtype."""
    grid = [-(-n // b) for n, b in zip(shape, block)]
    per = (f"fp8 scales, one per {block[0]} x {block[1]} block" if kind == StoredKind.fp8
           else f"fp4 scales, one per row and {block[1]} inputs")
    module = name.removesuffix(".weight")
    scale = scales.get(name)
    if scale is None:
        problems.append(Problem(what, f"{kind.value} without its scale (no {module}.scale or "
                                f"{module}.weight_scale_inv)", f"{module}.scale of shape {grid} ({per})",
                                "re-download the shard that holds the scale, or use a bf16 checkpoint"))
        return None, problems
    info = index[scale]
    if list(info.shape) != grid:
        problems.append(Problem(f"{what}: its scale {scale}", f"shape {list(info.shape)}",
                                f"shape {grid} ({per}, for the weight's {list(shape)})",
                                "the scales do not match the weight: re-download, or fix weight_block_size"))
    if info.dtype not in SCALE_DTYPES:
        problems.append(Problem(f"{what}: its scale {scale}", f"dtype {info.dtype}", f"one of {list(SCALE_DTYPES)}",
                                "re-download the checkpoint"))
    return ScaledTensor(kind, scale, block), problems


def _shape(what: str, got: list[int], want: list[int], note: str) -> list[Problem]:
    if got == want:
        return []
    return [Problem(what, f"shape {got}", f"shape {want} {note}",
                    "the config and the weights disagree (or the shard is damaged): fix config.json or "
                    "re-download / re-save the checkpoint")]


# ---------------------------------------------------------------------------- model.weights=stored / fp8
#: the matrices DeepSeek's V4 release stores in fp8 (transformers names): attention's projections, the indexer's
#: query projection and the shared expert; the compressors, the indexer's weights_proj, embed / head are bf16
RELEASE_FP8 = re.compile(r"self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)\.weight$"
                         r"|compressor\.indexer\.q_b_proj\.weight$|shared_experts\.(gate|up|down)_proj\.weight$")
#: routed experts: per expert (the release) or transformers' fused stacks (the presets)
ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.(\d+\.(gate|up|down)_proj\.weight|gate_up_proj|down_proj)$")


def release_kind(name: str, expert_dtype: str | None) -> StoredKind | None:
    """How DeepSeek's V4 release stores the tensor ``name`` (transformers' spelling): fp8, fp4 (routed experts
    with ``expert_dtype`` fp4), or None (a float tensor). What ``model.weights=fp8`` generates for a preset."""
    if ROUTED_EXPERT.search(name):
        return StoredKind(expert_dtype) if expert_dtype else None
    return StoredKind.fp8 if RELEASE_FP8.search(name) else None


def _expert_gate(name: str) -> bool:
    """A routed expert's gate rows, which the loader fuses with its up rows."""
    return bool(ROUTED_EXPERT.search(name)) and name.endswith("gate_proj.weight")


def stored_layout_problems(cfg: DSV4Config, shard: Sharding,
                           stored: dict[str, tuple[tuple[int, ...], tuple[int, int]]], checkpoint: bool
                           ) -> list[Problem]:
    """Every kind of stored V4 tensor (``stored``: transformers name -> (full unpacked shape, scale block: fp8
    (128, 128), fp4 (1, 32))) whose tensor-parallel cut (:mod:`runtime.model.dsv4.sharding`) or load-time fusion
    would split an fp8 scale block or an fp4 scale group (:func:`runtime.model.deepseek.stored.layout_problems`).
    ``cfg``: the full model's."""
    heads, groups = cfg.attention.num_heads, cfg.o_groups
    im, experts = cfg.moe_intermediate_size, cfg.n_routed_experts
    return layout_problems(
        stored, shard, lambda n, shape, sh: dsv4_tensor_cut(n, shape, cfg, sh), _expert_gate,
        lambda tp: (not heads % tp and not (groups % tp and tp % groups) and not cfg.vocab_size % tp
                    and not im % tp and not (shard.moe == "ep" and experts % tp)),
        "dequantize" if checkpoint else "bf16")
