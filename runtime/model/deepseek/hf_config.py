"""A Hugging Face ``config.json`` -> the `model` config's fields, and the resolution of the `model` config.

Cheap on purpose: it reads one small JSON file and no weights, so validation can refuse a checkpoint before
anything is allocated. Both spellings of the RoPE parameters are read: ``rope_scaling`` (the official DeepSeek
releases: ``{"type": "yarn", "factor": 40, ...}`` next to a top-level ``rope_theta``) and ``rope_parameters``
(what current transformers writes, ``rope_theta`` inside).

Semantics per ``model_type`` follow the reference modeling code:

* ``deepseek_v2``: softmax router, ``topk_method`` greedy or group_limited_greedy (group score = the group's max);
  interleaved RoPE on the MLA rope dims.
* ``deepseek_v3``: sigmoid router with ``e_score_correction_bias`` for the choice, groups ranked by their top-2
  sum (noaux_tc); interleaved RoPE unless ``rope_interleave`` is false.
* ``deepseek_v32``: DeepSeek-V3 plus a lightning indexer on every layer (all layers sparse); interleaved RoPE
  on the MLA rope dims, half-split RoPE in the indexer.
* ``deepseek_v4``: not MLA; read by :mod:`runtime.model.dsv4.hf_config` (the V4 fields go to ``model.v4``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runtime.core.config import MODEL_DEFAULTS
from runtime.core.errors import Problem
from runtime.model.dsv4.hf_config import read_dsv4_hf_config

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4")
SUPPORTED_ROPE = ("default", "yarn")
# Fields a user may set next to model.path (the rest come from config.json and must not disagree with it).
USER_FIELDS = ("num_layers", "max_context", "mlp")
# Fields a preset or checkpoint must provide: no default exists.
REQUIRED = ("num_layers", "hidden_size", "num_heads")


def _problem(path: Path, what: str, got: str, expected: str, fix: str) -> Problem:
    return Problem(f"{path}: {what}", got, expected, fix)


def read_hf_config(folder: str | Path) -> tuple[dict[str, Any], list[Problem]]:
    """The `model` fields a checkpoint folder's config.json defines, and every problem found in it.

    Returns
    -------
    fields : dict
        `model` config keys (``ModelConfig`` names) -> values; empty when config.json cannot be read.
    problems : list of Problem
    """
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file():
        what = "folder" if not folder.is_dir() else "config.json"
        return {}, [_problem(path, what, "missing", "a Hugging Face model folder with config.json and safetensors",
                             "point model.path at the folder that holds config.json")]
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {}, [_problem(path, "config.json", f"unreadable ({e})", "a JSON object", "re-download the file")]
    problems: list[Problem] = []
    add = problems.append
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        add(_problem(path, "model_type", repr(mtype), f"one of {list(SUPPORTED_MODEL_TYPES)}",
                     "serve a DeepSeek-V2/V3/V3.2/V4 checkpoint"))
        return {}, problems
    if mtype == "deepseek_v4":  # its own attention, mHC and MoE: runtime/model/dsv4/hf_config.py
        return read_dsv4_hf_config(path, cfg)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "vocab_size", "intermediate_size"):
        if not isinstance(cfg.get(key), int):
            add(_problem(path, key, repr(cfg.get(key)), "an integer", f"add \"{key}\" to config.json"))
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        add(_problem(path, "hidden_act", repr(act), "'silu' (SwiGLU)", "serve a DeepSeek checkpoint"))
    quant = cfg.get("quantization_config")
    if quant is not None:
        block = quant.get("weight_block_size")
        if quant.get("quant_method") != "fp8" or (block is not None and list(block) != [128, 128]):
            add(_problem(path, "quantization_config", json.dumps(quant),
                         "none, or fp8 with weight_block_size [128, 128] (the official V3/V3.2 release)",
                         "use a bf16/fp32 or block-fp8 checkpoint"))
    v3 = mtype in ("deepseek_v3", "deepseek_v32")
    out: dict[str, Any] = {
        "model_type": mtype,
        "num_layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "num_heads": cfg.get("num_attention_heads"),
        "q_lora_rank": cfg.get("q_lora_rank"),
        "kv_lora_rank": cfg.get("kv_lora_rank"),
        "qk_nope_head_dim": cfg.get("qk_nope_head_dim"),
        "qk_rope_head_dim": cfg.get("qk_rope_head_dim"),
        "v_head_dim": cfg.get("v_head_dim"),
        "vocab_size": cfg.get("vocab_size"),
        "max_context": cfg.get("max_position_embeddings", 4096),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "layer_pattern": ["sparse"] if mtype == "deepseek_v32" else ["full"],
        "mlp": "deepseek",
        "intermediate_size": cfg.get("intermediate_size"),
        "moe_intermediate_size": cfg.get("moe_intermediate_size") or 0,
        "n_routed_experts": cfg.get("n_routed_experts") or 0,
        "n_shared_experts": cfg.get("n_shared_experts") or 0,
        "num_experts_per_tok": cfg.get("num_experts_per_tok") or 0,
        "n_group": cfg.get("n_group") or 1,
        "topk_group": cfg.get("topk_group") or 1,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", v3)),
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else (cfg.get("topk_method") or "greedy"),
        "first_k_dense_replace": cfg.get("first_k_dense_replace", 3 if v3 else 0) or 0,
        "moe_layer_freq": cfg.get("moe_layer_freq") or 1,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "eos_token_id": _int_list(cfg.get("eos_token_id")),
        "rope_interleave": bool(cfg.get("rope_interleave", True)) if mtype == "deepseek_v3" else True,
        "index_n_heads": 0,
    }
    scoring = cfg.get("scoring_func")
    if scoring is not None and scoring != out["scoring_func"]:
        add(_problem(path, "scoring_func", repr(scoring), f"'{out['scoring_func']}' for {mtype}",
                     "fix config.json's scoring_func"))
    method = cfg.get("topk_method")
    allowed = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method is not None and method not in allowed:
        add(_problem(path, "topk_method", repr(method), f"one of {list(allowed)} for {mtype}",
                     "fix config.json's topk_method"))
    if out["n_routed_experts"] and out["n_routed_experts"] % out["n_group"]:
        add(_problem(path, "n_group", f"{out['n_group']} groups of {out['n_routed_experts']} experts",
                     "n_routed_experts divisible by n_group", "fix config.json"))
    layer_types = cfg.get("mlp_layer_types")
    if layer_types is not None:  # deepseek_v32 as transformers writes it: dense * k + sparse * rest
        k = sum(1 for t in layer_types if t == "dense")
        if list(layer_types) != ["dense"] * k + ["sparse"] * (len(layer_types) - k):
            add(_problem(path, "mlp_layer_types", str(layer_types), "dense layers first, then sparse (MoE) layers",
                         "use first_k_dense_replace"))
        out["first_k_dense_replace"], out["moe_layer_freq"] = k, 1
    if mtype == "deepseek_v32":
        out.update(index_n_heads=cfg.get("index_n_heads", 64), index_head_dim=cfg.get("index_head_dim", 128),
                   index_topk=cfg.get("index_topk", 2048))
        if not cfg.get("q_lora_rank"):
            add(_problem(path, "q_lora_rank", repr(cfg.get("q_lora_rank")),
                         "a q LoRA rank (the V3.2 indexer projects the query latent)", "fix config.json"))
    problems += _rope_fields(path, cfg, out)
    return out, problems


def _int_list(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in v] if isinstance(v, list) else [int(v)]


def _rope_fields(path: Path, cfg: dict, out: dict) -> list[Problem]:
    """RoPE fields from ``rope_parameters`` or ``rope_scaling`` (and a top-level ``rope_theta``) into ``out``."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rtype = rp.get("rope_type") or rp.get("type") or "default"
    out["rope_theta"] = float(rp.get("rope_theta") or cfg.get("rope_theta") or 10000.0)
    out["rope_type"] = rtype
    if rtype not in SUPPORTED_ROPE:
        return [_problem(path, "rope type", repr(rtype), f"one of {list(SUPPORTED_ROPE)}",
                         "serve a checkpoint with default or YaRN RoPE")]
    if rtype == "yarn":
        orig = rp.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 4096)
        factor = rp.get("factor") or cfg.get("max_position_embeddings", 4096) / orig
        out.update(rope_factor=float(factor), rope_original_max_position=int(orig),
                   rope_beta_fast=float(rp.get("beta_fast") or 32), rope_beta_slow=float(rp.get("beta_slow") or 1),
                   rope_mscale=rp.get("mscale"), rope_mscale_all_dim=rp.get("mscale_all_dim"),
                   rope_attention_factor=rp.get("attention_factor"), rope_truncate=bool(rp.get("truncate", True)))
    return []


def resolve_model_config(model: dict) -> tuple[dict, list[Problem]]:
    """The `model` config with every optional field filled: from ``model.path``'s config.json when set (a user
    value for a field the checkpoint defines must agree with it, except ``num_layers`` (at most the checkpoint's:
    its first layers), ``max_context`` and ``mlp``), then ``MODEL_DEFAULTS``. Returns (resolved copy, problems)."""
    out = dict(model)
    problems: list[Problem] = []
    if out.get("path"):
        fields, problems = read_hf_config(out["path"])
        for key, value in fields.items():
            mine = out.get(key)
            if mine is None or key == "model_type":
                out[key] = value
            elif key == "num_layers" and not 1 <= mine <= value:
                problems.append(Problem("model.num_layers", str(mine), f"1..{value} (the checkpoint's layers)",
                                        "drop model.num_layers, or lower it"))
            elif isinstance(mine, dict) and isinstance(value, dict):  # model.v4: the user's values must agree
                bad = [k for k, v in mine.items() if v is not None and _differs(v, value.get(k))]
                for k in bad:
                    problems.append(Problem(f"model.{key}.{k}", repr(mine[k]),
                                            f"{value.get(k)!r} (from {out['path']}/config.json)",
                                            f"drop model.{key}.{k}: it comes from the checkpoint's config.json"))
                if not bad:  # kept as given otherwise, so that resolving again still sees the disagreement
                    out[key] = value
            elif key not in USER_FIELDS and _differs(mine, value):
                problems.append(Problem(f"model.{key}", repr(mine), f"{value!r} (from {out['path']}/config.json)",
                                        f"drop model.{key}: a checkpoint's dimensions come from its config.json"))
    for key, value in MODEL_DEFAULTS.items():
        if out.get(key) is None:
            out[key] = list(value) if isinstance(value, list) else value
    if str(out.get("weights") or "auto") == "auto":  # a checkpoint as stored (V2 - V4), a preset in bf16
        out["weights"] = "stored" if out.get("path") else "bf16"
    for key in REQUIRED:
        if out.get(key) is None:
            problems.append(Problem(f"model.{key}", "null", "a positive integer",
                                    f"set model.{key}, or serve a checkpoint (model=hf model.path=DIR)"))
    return out, problems


def _differs(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(float(a) - float(b)) > 1e-12 * max(1.0, abs(float(b)))
    return a != b
