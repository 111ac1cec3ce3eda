"""Startup checks of ``model.weights`` (how the linear layers' weights are held): the value fits the model's
source, the GPU computes fp8, and a preset's fp8 blocks survive its tensor-parallel cuts. A checkpoint's own fp8
tensors are checked against the cuts from their headers (:func:`runtime.model.deepseek.checkpoint.scan_checkpoint`).
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
    if v4:
        out.append(Problem(f"model.weights={value}", "a DeepSeek-V4 model",
                           "a V2 / V3 / V3.2 model: V4's weights in stored precision are not built yet",
                           "model.weights=dequantize for a V4 checkpoint, model.weights=bf16 for the preset"))
        return out
    cc = device.compute_capability
    if device.kind == "cuda" and cc is not None and cc < FP8_MIN_CC:
        out.append(Problem(f"model.weights={value}", f"{device.name} (compute capability {cc[0]}.{cc[1]})",
                           f"a GPU with fp8 tensor cores (compute capability >= {FP8_MIN_CC[0]}.{FP8_MIN_CC[1]})",
                           f"model.weights={'dequantize' if path else 'bf16'}"))
    if value == "fp8":  # a preset: every tensor the release stores in fp8 (a checkpoint's: scan_checkpoint)
        spec = ModelSpec.from_config(model)
        tensors = {n: s for n, s in expected_tensors(spec).items() if release_fp8(n, s)}
        par = cfg.get("parallel") or {}
        out += block_layout_problems(spec, Sharding(0, int(par.get("tp", 1)), str(par.get("moe", "tp"))), tensors)
    return out
