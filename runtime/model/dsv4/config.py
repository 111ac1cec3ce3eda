"""DeepSeek-V4 hyper-parameters as frozen values, read from a Hugging Face ``config.json`` dict."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from runtime.core.dsv4_spec import DSV4AttentionSpec
from runtime.model.deepseek.rope import RopeParams
from runtime.model.deepseek.routing import ScoringFunc


class MlpType(str, enum.Enum):
    hash_moe = "hash_moe"  # experts chosen by a frozen token-id -> expert-ids table
    moe = "moe"  # experts chosen by top-k of the (bias-corrected) router scores


def rope_from_hf(d: dict) -> RopeParams:
    """One of V4's ``rope_parameters`` (``main`` or ``compress``) as :class:`RopeParams` (YaRN's correction range
    always truncated, as the V4 reference computes it)."""
    kind = d.get("rope_type", d.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"DeepSeek-V4 rope_type: got {kind!r}; expected 'default' or 'yarn'. Fix: use a V4 "
                         "config.json (compress rope is YaRN, main rope is default).")
    if kind == "default":
        return RopeParams(theta=float(d["rope_theta"]))
    att = d.get("attention_factor")
    return RopeParams(theta=float(d["rope_theta"]), rope_type="yarn", factor=float(d["factor"]),
                      original_max_position_embeddings=int(d["original_max_position_embeddings"]),
                      beta_fast=float(d.get("beta_fast") or 32), beta_slow=float(d.get("beta_slow") or 1),
                      attention_factor=1.0 if att is None else float(att))


@dataclass(frozen=True)
class DSV4Config:
    """Everything the V4 decoder math reads besides weights."""

    attention: DSV4AttentionSpec
    hidden_size: int
    vocab_size: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    n_routed_experts: int
    moe_intermediate_size: int  # routed experts and the one shared expert
    num_experts_per_tok: int
    scoring_func: ScoringFunc
    routed_scaling_factor: float
    swiglu_limit: float
    mlp_types: tuple[MlpType, ...]
    rope_main: RopeParams
    rope_compress: RopeParams

    @classmethod
    def from_hf_config(cls, cfg: dict) -> DSV4Config:
        """From ``DeepseekV4Config.to_dict()`` (nested ``rope_parameters`` with ``main`` / ``compress``)."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"DeepSeek-V4 hidden_act: got {cfg['hidden_act']!r}; expected 'silu'.")
        n = int(cfg["num_hidden_layers"])
        mlp = cfg.get("mlp_layer_types")
        if mlp is None:
            k = int(cfg.get("num_hash_layers", 3))
            mlp = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
        rp = cfg["rope_parameters"]
        return cls(
            attention=DSV4AttentionSpec.from_hf_config(cfg),
            hidden_size=int(cfg["hidden_size"]),
            vocab_size=int(cfg["vocab_size"]),
            q_lora_rank=int(cfg["q_lora_rank"]),
            o_groups=int(cfg["o_groups"]),
            o_lora_rank=int(cfg["o_lora_rank"]),
            hc_mult=int(cfg["hc_mult"]),
            hc_sinkhorn_iters=int(cfg["hc_sinkhorn_iters"]),
            hc_eps=float(cfg["hc_eps"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            n_routed_experts=int(cfg["n_routed_experts"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            scoring_func=ScoringFunc(cfg["scoring_func"]),
            routed_scaling_factor=float(cfg["routed_scaling_factor"]),
            swiglu_limit=float(cfg["swiglu_limit"]),
            mlp_types=tuple(MlpType(t) for t in mlp[:n]),
            rope_main=rope_from_hf(rp["main"]),
            rope_compress=rope_from_hf(rp["compress"]),
        )
