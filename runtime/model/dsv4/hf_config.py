"""A DeepSeek-V4 ``config.json`` -> the `model` config's fields (``model.v4`` for what is V4's own), and the
resolved `model` config -> :class:`runtime.model.dsv4.config.DSV4Config`.

Both spellings transformers reads are accepted: what ``DeepseekV4Config.to_dict()`` writes (``layer_types``,
``compress_rates``, ``mlp_layer_types``, ``rope_parameters`` nested as ``main`` / ``compress``,
``partial_rotary_factor``) and the legacy one (``compress_ratios`` of 0/4/128 per layer, ``compress_rate_csa`` /
``compress_rate_hca``, ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling`` with ``compress_rope_theta``).
Missing schedules take transformers' defaults (:func:`default_layer_types`, :func:`default_mlp_types`).

DeepSeek's release format (``quantization_config`` fp8 e4m3 with ue8m0 block scales, ``expert_dtype`` fp4) is read
into ``model.v4.fp8_block`` / ``expert_dtype`` (:func:`stored_format`); the checkpoint loader keeps those weights as
stored (``model.weights=stored``, the default) or dequantizes them (``dequantize``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.core.errors import Problem
from runtime.model.dsv4.config import DSV4Config

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
INT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "vocab_size", "q_lora_rank",
            "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "sliding_window", "o_groups",
            "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk")
# quantization_config values we read (DeepSeek's release: fp8 e4m3, ue8m0 scales, dynamic activations)
QUANT_VALUES = {"quant_method": ("fp8",), "fmt": ("e4m3",), "scale_fmt": ("ue8m0", "float"),
                "activation_scheme": ("dynamic",)}
EXPERT_DTYPES = ("fp8", "fp4")


def default_layer_types(n: int) -> list[str]:
    """transformers' default schedule: two HCA layers, then HCA and CSA alternating."""
    return [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]


def default_mlp_types(n: int, hash_layers: int = 3) -> list[str]:
    return ["hash_moe"] * min(n, hash_layers) + ["moe"] * max(0, n - hash_layers)


def read_dsv4_hf_config(path: Path, cfg: dict) -> tuple[dict[str, Any], list[Problem]]:
    """The `model` fields of a ``deepseek_v4`` config.json (already parsed) and every problem in it."""
    problems: list[Problem] = []

    def add(what, got, expected, fix):
        problems.append(Problem(f"{path}: {what}", got, expected, fix))

    for key in INT_KEYS:
        if not isinstance(cfg.get(key), int):
            add(key, repr(cfg.get(key)), "an integer", f"add \"{key}\" to config.json")
    if problems:
        return {}, problems
    if cfg.get("num_key_value_heads", 1) != 1:
        add("num_key_value_heads", repr(cfg["num_key_value_heads"]), "1 (V4 attention shares one KV head)",
            "fix config.json")
    if cfg.get("hidden_act", "silu") != "silu":
        add("hidden_act", repr(cfg["hidden_act"]), "'silu'", "serve a DeepSeek-V4 checkpoint")
    stored = stored_format(cfg, add)
    n = cfg["num_hidden_layers"]
    rates = dict(cfg.get("compress_rates") or {})
    csa = int(rates.get(CSA, cfg.get("compress_rate_csa", 4)))
    hca = int(rates.get(HCA, cfg.get("compress_rate_hca", 128)))
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        by_ratio = {0: SLIDING, csa: CSA, hca: HCA}
        bad = [r for r in cfg["compress_ratios"] if r not in by_ratio]
        if bad:
            add("compress_ratios", str(bad), f"0, {csa} or {hca}", "fix config.json")
        types = [by_ratio.get(r, SLIDING) for r in cfg["compress_ratios"]]
    types = list(types if types is not None else default_layer_types(n))
    mlp = cfg.get("mlp_layer_types")
    mlp = list(mlp if mlp is not None else default_mlp_types(n, int(cfg.get("num_hash_layers", 3))))
    for name, got in (("layer_types", types), ("mlp_layer_types", mlp)):
        if len(got) < n:
            add(name, f"{len(got)} entries", f"one per layer ({n})", "fix config.json")
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = rp["main"], dict(rp["compress"])
    else:
        scaling = rp or cfg.get("rope_scaling") or {}
        main = {"rope_theta": scaling.get("rope_theta", cfg.get("rope_theta", 10000.0)),
                "partial_rotary_factor": cfg.get("partial_rotary_factor")}
        compress = {**scaling, "rope_theta": cfg.get("compress_rope_theta", 160000.0)}
    ctype = compress.get("rope_type", compress.get("type", "default"))
    if ctype not in ("default", "yarn"):
        add("rope_parameters.compress.rope_type", repr(ctype), "'default' or 'yarn'", "fix config.json")
    factor = cfg.get("partial_rotary_factor") or main.get("partial_rotary_factor") or 64 / 512
    rope_dim = cfg.get("qk_rope_head_dim") or int(cfg["head_dim"] * float(factor))
    v4 = {
        "head_dim": cfg["head_dim"], "rope_head_dim": int(rope_dim), "sliding_window": cfg["sliding_window"],
        "layer_types": types, "csa_rate": csa, "hca_rate": hca, "index_n_heads": cfg["index_n_heads"],
        "index_head_dim": cfg["index_head_dim"], "index_topk": cfg["index_topk"], "o_groups": cfg["o_groups"],
        "o_lora_rank": cfg["o_lora_rank"], "hc_mult": int(cfg.get("hc_mult", 4)),
        "hc_sinkhorn_iters": int(cfg.get("hc_sinkhorn_iters", 20)), "hc_eps": float(cfg.get("hc_eps", 1e-6)),
        "scoring_func": cfg.get("scoring_func", "sqrtsoftplus"), "swiglu_limit": float(cfg.get("swiglu_limit", 10.0)),
        "mlp_layer_types": mlp, "compress_rope_theta": float(compress["rope_theta"]),
        "compress_rope_type": ctype if ctype in ("default", "yarn") else "default",
        "compress_rope_factor": float(compress.get("factor", 1.0)),
        "compress_rope_original_max_position": int(compress.get("original_max_position_embeddings", 0) or 0),
        "compress_rope_beta_fast": float(compress.get("beta_fast") or 32),
        "compress_rope_beta_slow": float(compress.get("beta_slow") or 1), **stored,
    }
    eos = cfg.get("eos_token_id")
    out = {
        "model_type": "deepseek_v4", "num_layers": n, "hidden_size": cfg["hidden_size"],
        "num_heads": cfg["num_attention_heads"], "q_lora_rank": cfg["q_lora_rank"], "vocab_size": cfg["vocab_size"],
        "max_context": cfg.get("max_position_embeddings", 4096), "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(main["rope_theta"]), "mlp": "deepseek",
        "moe_intermediate_size": cfg["moe_intermediate_size"], "n_routed_experts": cfg["n_routed_experts"],
        "n_shared_experts": cfg.get("n_shared_experts") or 1, "num_experts_per_tok": cfg["num_experts_per_tok"],
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.5)), "norm_topk_prob": True,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "eos_token_id": [] if eos is None else ([int(x) for x in eos] if isinstance(eos, list) else [int(eos)]),
        "v4": v4,
    }
    if out["tie_word_embeddings"]:
        add("tie_word_embeddings", "true", "false (V4 has its own lm_head)", "fix config.json")
    return out, problems


def stored_format(cfg: dict, add) -> dict[str, Any]:
    """``model.v4.fp8_block`` / ``expert_dtype`` from config.json's ``quantization_config`` (DeepSeek's release:
    fp8 e4m3 with ue8m0 128 x 128 block scales, ``expert_dtype`` "fp4" at the top level or inside it); both null
    without one. Every value we cannot read goes to ``add``."""
    q = cfg.get("quantization_config")
    if q is None:
        return {"fp8_block": None, "expert_dtype": None}
    fix = "serve DeepSeek's release format (fp8 e4m3, ue8m0 or float block scales) or a bf16 checkpoint"
    if not isinstance(q, dict):
        add("quantization_config", repr(q)[:80], "a JSON object", fix)
        return {"fp8_block": None, "expert_dtype": None}
    for key, allowed in QUANT_VALUES.items():
        if (q.get(key) is not None or key == "quant_method") and q.get(key) not in allowed:
            add(f"quantization_config.{key}", repr(q.get(key)), f"one of {list(allowed)}", fix)
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        add("quantization_config.weight_block_size", repr(block), "[rows, cols] of one fp8 scale (the release: "
            "[128, 128])", "fix config.json")
        block = None
    top, inner = cfg.get("expert_dtype"), q.get("expert_dtype")
    if top is not None and inner is not None and top != inner:
        add("expert_dtype", f"{top!r} at the top level, {inner!r} in quantization_config", "one value",
            "fix config.json")
    experts = inner if inner is not None else top if top is not None else "fp8"
    if experts not in EXPERT_DTYPES:
        add("expert_dtype", repr(experts), f"one of {list(EXPERT_DTYPES)} (routed experts' storage)",
            "fix config.json: the V4 release's experts are 'fp4'")
    return {"fp8_block": block, "expert_dtype": experts if experts in EXPERT_DTYPES else None}


def dsv4_config(model: dict) -> DSV4Config:
    """The resolved `model` config of a V4 model (preset or checkpoint) -> its :class:`DSV4Config`, cut to
    ``model.num_layers`` layers."""
    v, n = model["v4"], int(model["num_layers"])
    compress: dict[str, Any] = {"rope_type": "default", "rope_theta": float(v["compress_rope_theta"])}
    if str(v["compress_rope_type"]) == "yarn":
        compress.update(rope_type="yarn", factor=v["compress_rope_factor"],
                        original_max_position_embeddings=v["compress_rope_original_max_position"],
                        beta_fast=v["compress_rope_beta_fast"], beta_slow=v["compress_rope_beta_slow"],
                        attention_factor=1.0)
    hf = {
        "num_hidden_layers": n, "hidden_size": model["hidden_size"], "vocab_size": model["vocab_size"],
        "num_attention_heads": model["num_heads"], "q_lora_rank": model["q_lora_rank"], "head_dim": v["head_dim"],
        "qk_rope_head_dim": v["rope_head_dim"], "sliding_window": v["sliding_window"],
        "layer_types": [str(t) for t in (v["layer_types"] or default_layer_types(n))][:n],
        "compress_rates": {CSA: v["csa_rate"], HCA: v["hca_rate"]},
        "index_n_heads": v["index_n_heads"], "index_head_dim": v["index_head_dim"], "index_topk": v["index_topk"],
        "o_groups": v["o_groups"], "o_lora_rank": v["o_lora_rank"], "hc_mult": v["hc_mult"],
        "hc_sinkhorn_iters": v["hc_sinkhorn_iters"], "hc_eps": v["hc_eps"], "rms_norm_eps": model["rms_norm_eps"],
        "n_routed_experts": model["n_routed_experts"], "num_experts_per_tok": model["num_experts_per_tok"],
        "moe_intermediate_size": model["moe_intermediate_size"], "scoring_func": str(v["scoring_func"]),
        "routed_scaling_factor": model["routed_scaling_factor"],
        "swiglu_limit": v["swiglu_limit"],
        "mlp_layer_types": [str(t) for t in (v["mlp_layer_types"] or default_mlp_types(n))][:n],
        "rope_parameters": {"main": {"rope_type": "default", "rope_theta": float(model["rope_theta"])},
                            "compress": compress},
    }
    return DSV4Config.from_hf_config(hf)
