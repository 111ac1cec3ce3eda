"""Startup checks of ``model.weights`` (how the linear layers' weights are held): the value fits the model's
source, the GPU computes fp8, and a preset's fp8 blocks (DeepSeek-V4: also its fp4 experts' 32-input scale groups)
survive its tensor-parallel cuts. A checkpoint's own fp8 / fp4 tensors are checked against the cuts from their
headers (:func:`runtime.model.deepseek.checkpoint.scan_checkpoint`,
:func:`runtime.model.dsv4.checkpoint.scan_dsv4_checkpoint`). DeepSeek-V4 held as stored refuses CUDA graphs only
for routed experts that loop on the host (block-fp8 ones: :func:`_dsv4_graph_problems`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.core.device import DeviceInfo
from runtime.core.errors import Problem
from runtime.core.model_spec import DSV4_MODEL_TYPE, ModelSpec
from runtime.core.parallel import Sharding
from runtime.model.deepseek.checkpoint import expected_tensors
from runtime.model.deepseek.stored import block_layout_problems, release_fp8
from runtime.model.dsv4.checkpoint import expected_tensors as dsv4_tensors
from runtime.model.dsv4.hf_config import dsv4_config
from runtime.model.dsv4.stored import StoredFormat, release_kind, stored_layout_problems
from runtime.model.quantized import FP4_GROUP, FP8_BLOCK, StoredKind

#: the least compute capability whose tensor cores multiply e4m3 (Ada, Hopper and newer)
FP8_MIN_CC = (8, 9)
CHECKPOINT_VALUES = ("stored", "dequantize")
PRESET_VALUES = ("bf16", "fp8")


def _quantized(path: str) -> bool:
    """Whether the checkpoint's config.json declares quantized weights (validation has read it already)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("quantization_config") is not None
    except (OSError, ValueError):
        return False


def weights_problems(cfg: Mapping[str, Any], device: DeviceInfo) -> list[Problem]:
    """Every reason ``model.weights`` cannot serve ``cfg`` (a resolved plain root config) on ``device``."""
    model = cfg["model"]
    value, path = str(model.get("weights") or "auto"), model.get("path")
    v4 = model.get("model_type") == DSV4_MODEL_TYPE
    out: list[Problem] = []
    if path and value in PRESET_VALUES:
        return [Problem(f"model.weights={value}", f"a checkpoint folder ({path})",
                        f"one of {list(CHECKPOINT_VALUES)} for a checkpoint ({list(PRESET_VALUES)} name the format of "
                        "a preset's random weights)", "model.weights=stored (as shipped) or model.weights=dequantize")]
    if not path and value in CHECKPOINT_VALUES:
        return [Problem(f"model.weights={value}", f"preset '{model['name']}' (random weights, no checkpoint)",
                        f"one of {list(PRESET_VALUES)} for a preset", "model.weights=fp8 (block-fp8 as the V3 "
                        "release) or model.weights=bf16")]
    fp8 = value == "fp8" or (value == "stored" and _quantized(path))
    if not fp8:
        return out
    cc = device.compute_capability
    if device.kind == "cuda" and cc is not None and cc < FP8_MIN_CC:
        out.append(Problem(f"model.weights={value}", f"{device.name} (compute capability {cc[0]}.{cc[1]})",
                           f"a GPU with fp8 tensor cores (compute capability >= {FP8_MIN_CC[0]}.{FP8_MIN_CC[1]})",
                           f"model.weights={'dequantize' if path else 'bf16'}"))
    if v4 and (cfg.get("graph") or {}).get("enabled"):
        out += _dsv4_graph_problems(model, value, bool(path))
    if value == "fp8" and v4:
        out += _dsv4_preset_layout(cfg)
    elif value == "fp8":  # a preset: every tensor the release stores in fp8 (a checkpoint's: scan_checkpoint)
        spec = ModelSpec.from_config(model)
        tensors = {n: s for n, s in expected_tensors(spec).items() if release_fp8(n, s)}
        par = cfg.get("parallel") or {}
        out += block_layout_problems(spec, Sharding(0, int(par.get("tp", 1)), str(par.get("moe", "tp"))), tensors)
    return out


def _dsv4_graph_problems(model: Mapping[str, Any], value: str, checkpoint: bool) -> list[Problem]:
    """Graphed decode of a V4 model held as stored: the routed experts that still loop over the active experts on
    the host (:func:`runtime.model.deepseek.moe.routed_expert_sum`: one GEMM pair per expert after a host sync,
    which a graph capture refuses) are refused. Those are block-fp8 expert stacks (``model.v4.expert_dtype: fp8``;
    a checkpoint's quantization_config without expert_dtype means fp8), and packed fp4 ones whose clamped SwiGLU the
    fp4 kernels do not take (``swiglu_limit <= 0``). Packed fp4 experts on CUDA in bf16 run the fp4 expert kernels and
    the fp8 matrices the decoder ops' fp8 kernels, neither with a host sync: accepted."""
    v4 = model.get("v4") or {}
    experts = StoredFormat.of(model).expert_dtype or (None if checkpoint else StoredKind.fp4.value)
    limit = v4.get("swiglu_limit")
    if experts == StoredKind.fp8.value:
        why = "block-fp8 routed experts (model.v4.expert_dtype: fp8)"
    elif experts == StoredKind.fp4.value and limit is not None and limit <= 0:
        why = f"packed fp4 routed experts with model.v4.swiglu_limit={limit} (the fp4 kernels take a limit > 0)"
    else:
        return []
    fix = "graph=off, or model.weights=" + ("dequantize" if checkpoint else "bf16")
    fix += "" if checkpoint or experts != StoredKind.fp8.value else ", or model.v4.expert_dtype=fp4 (the release's)"
    return [Problem("graph.enabled=true", f"DeepSeek-V4 {why} held as stored (model.weights={value})",
                    "graph=off for these experts: they run the torch loop over the active experts (a host sync per "
                    "MoE layer, which a CUDA graph capture refuses; V4 has fp4 expert kernels, no fp8 expert "
                    "kernel)", fix)]


def _dsv4_preset_layout(cfg: Mapping[str, Any]) -> list[Problem]:
    """A V4 preset with ``model.weights=fp8``: the fp8 matrices and fp4 experts it generates
    (:func:`runtime.model.dsv4.stored.release_kind`) against its tensor-parallel cuts. A config whose V4 fields or
    tensor-parallel split are refused elsewhere (the V4 and parallel checks) is not looked at here."""
    model, par = cfg["model"], cfg.get("parallel") or {}
    tp, moe = int(par.get("tp", 1)), str(par.get("moe", "tp"))
    try:
        v4 = dsv4_config(model)
    except (ValueError, KeyError, TypeError):
        return []  # reported by the V4 validation
    groups, heads = v4.o_groups, v4.attention.num_heads
    if heads % tp or (groups % tp and tp % groups):
        return []  # reported by the parallel checks
    fmt = StoredFormat.of(model)
    block, experts = fmt.fp8_block or FP8_BLOCK, fmt.expert_dtype or StoredKind.fp4.value
    stored = {}
    for name, shape in dsv4_tensors(v4).items():
        kind = release_kind(name, experts)
        if kind is not None:
            stored[name] = (shape, (1, FP4_GROUP) if kind == StoredKind.fp4 else block)
    return stored_layout_problems(v4, Sharding(0, tp, moe), stored, checkpoint=False)
