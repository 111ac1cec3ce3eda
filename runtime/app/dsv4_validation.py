"""Startup checks of a DeepSeek-V4 configuration (``model.model_type=deepseek_v4``), part of the one validation
pass of :mod:`runtime.app.validation`: the ``model.v4`` fields, and the features the V4 path does not offer
(attention dumps, attention-only layers, CUDA graphs with HiSparse) and what HiSparse offload of the CSA
entries needs. Which backend serves V4, and speculative decoding, CUDA graphs or an fp8 cache with it, are decided
from backend capabilities in the generic checks."""

from __future__ import annotations

from typing import Any

from runtime.app.hisparse_checks import hisparse_size_problems
from runtime.core.errors import Problem
from runtime.model.dsv4.hf_config import CSA, default_layer_types

REQUIRED_V4 = ("head_dim", "rope_head_dim", "sliding_window", "csa_rate", "hca_rate", "index_n_heads",
               "index_head_dim", "index_topk", "o_groups", "o_lora_rank", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
               "scoring_func", "swiglu_limit", "compress_rope_theta", "compress_rope_type")


def dsv4_problems(cfg: dict[str, Any]) -> list[Problem]:
    """Every problem of a V4 config (a resolved plain dict of the root config)."""
    model, out = cfg["model"], []
    add = out.append
    name = model["name"]
    v4 = model.get("v4")
    if not v4:
        return [Problem(f"model '{name}' (model_type deepseek_v4)", "model.v4 = null",
                        "the V4 fields (head_dim, sliding_window, compress rates, indexer, mHC, ...)",
                        "use model=deepseek_v4_flash, or model=hf model.path=DIR with a V4 config.json")]
    missing = [k for k in REQUIRED_V4 if v4.get(k) is None]
    if missing:
        add(Problem("model.v4", f"no value for {missing}", "every V4 field set", "set them, or use model=deepseek_v4_flash"))
        return out
    n = model["num_layers"]
    for key in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_context", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size"):
        if (model.get(key) or 0) < 1:
            add(Problem(f"model.{key}", str(model.get(key)), ">= 1", f"set model.{key}"))
    if (model.get("q_lora_rank") or 0) < 1:
        add(Problem("model.q_lora_rank", str(model.get("q_lora_rank")), ">= 1 (V4 queries go through a LoRA)",
                    "set model.q_lora_rank=1024"))
    for key in ("sliding_window", "csa_rate", "hca_rate", "index_n_heads", "index_head_dim", "index_topk",
                "o_groups", "o_lora_rank", "hc_mult", "hc_sinkhorn_iters"):
        if v4[key] < 1:
            add(Problem(f"model.v4.{key}", str(v4[key]), ">= 1", f"set model.v4.{key}"))
    d, r = v4["head_dim"], v4["rope_head_dim"]
    if not (0 < r < d and r % 2 == 0):
        add(Problem("model.v4.rope_head_dim", f"{r} (head_dim {d})", "an even number in 2..head_dim - 1",
                    "set model.v4.rope_head_dim=64"))
    if v4["o_groups"] >= 1 and model["num_heads"] % v4["o_groups"]:
        add(Problem("model.v4.o_groups", f"{v4['o_groups']} ({model['num_heads']} heads)",
                    "a divisor of model.num_heads (the output projection groups heads)", "set model.v4.o_groups=1"))
    if model["num_experts_per_tok"] > model["n_routed_experts"]:
        add(Problem("model.num_experts_per_tok", str(model["num_experts_per_tok"]),
                    f"<= n_routed_experts ({model['n_routed_experts']})", "lower model.num_experts_per_tok"))
    for key in ("layer_types", "mlp_layer_types"):
        got = v4.get(key)
        if got is not None and len(got) < n:
            add(Problem(f"model.v4.{key}", f"{len(got)} entries", f"at least model.num_layers ({n})",
                        f"list one per layer, or set model.v4.{key}=null (transformers' default schedule)"))
    if str(v4["compress_rope_type"]) == "yarn":
        if (v4.get("compress_rope_factor") or 0) < 1 or (v4.get("compress_rope_original_max_position") or 0) < 1:
            add(Problem("model.v4.compress_rope_factor / compress_rope_original_max_position",
                        f"{v4.get('compress_rope_factor')} / {v4.get('compress_rope_original_max_position')}",
                        "factor >= 1 and original_max_position >= 1 for YaRN", "set both, or compress_rope_type=default"))
    if str(model.get("mlp")) != "deepseek":
        add(Problem("model.mlp", str(model.get("mlp")), "deepseek (V4 layers always have their MoE)",
                    "drop model.mlp"))
    if cfg["hisparse"]["enabled"]:
        out += dsv4_hisparse_problems(cfg)
        if cfg["graph"]["enabled"]:
            add(Problem("graph.enabled=true", "hisparse.enabled=true with DeepSeek-V4",
                        "graph=off with HiSparse (a V4 decode step moves the CSA entries between the host pool "
                        "and the device on the host)", "use graph=off, or hisparse=off"))
    if cfg.get("dump_dir"):
        add(Problem("+dump_dir", f"DeepSeek-V4 model '{name}'", "an MLA model (dumps record MLA attention inputs)",
                    "drop +dump_dir"))
    return out


def dsv4_hisparse_problems(cfg: dict[str, Any]) -> list[Problem]:
    """HiSparse with a V4 model offloads the CSA layers' compressed entries (the ones the indexer's top-k selects)
    to host memory; the HCA entries (every one attended, every step) and the window ring stay on the device.
    It needs CSA layers, ``hisparse.top_k`` equal to the indexer's top-k, a device buffer that holds a selection,
    and a host pool at least as large as the device one."""
    model, hs, out = cfg["model"], cfg["hisparse"], []
    add = out.append
    v4, n = model["v4"], model["num_layers"]
    kinds = [str(t) for t in (v4.get("layer_types") or default_layer_types(n))][:n]
    if CSA not in kinds:
        add(Problem("hisparse.enabled=true", f"DeepSeek-V4 layer types {sorted(set(kinds))}",
                    f"at least one {CSA} layer (HiSparse offloads the CSA entries the indexer selects; HCA entries "
                    "are all attended every step and stay on the device)", "use hisparse=off"))
    if hs["top_k"] != v4["index_topk"]:
        add(Problem("hisparse.top_k", f"{hs['top_k']} (model.v4.index_topk is {v4['index_topk']})",
                    "equal to model.v4.index_topk (the entries the V4 indexer selects per query)",
                    f"set hisparse.top_k={v4['index_topk']}"))
    # a host pool larger than the device one only over-allocates for V4 (token pages are kept): the fix says 1
    return out + hisparse_size_problems(hs, "entry", ratio_fix=1)
