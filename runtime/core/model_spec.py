"""The model's shape and semantics as a small frozen value, derived once from the (resolved) `model` config."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

import torch

from runtime.core.config import MODEL_DEFAULTS, LayerKind, WeightFormat


class MLPLayer(str, enum.Enum):
    none = "none"  # attention-only layer: x + attn(x)
    dense = "dense"  # DeepSeek dense SwiGLU MLP
    moe = "moe"  # DeepSeek MoE: routed experts + shared experts


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

DSV4_MODEL_TYPE = "deepseek_v4"  # DeepSeek-V4: its own attention (runtime/model/dsv4), not MLA

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    max_context: int
    dtype: torch.dtype
    rope_theta: float
    rms_norm_eps: float
    layer_kinds: tuple[LayerKind, ...]
    linear_num_heads: int
    linear_head_dim: int
    weight_seed: int
    index_n_heads: int = 0
    index_head_dim: int = 128
    index_topk: int = 2048
    model_type: str | None = None
    path: str | None = None
    mlp_kinds: tuple[MLPLayer, ...] = ()
    intermediate_size: int = 0
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    rope_interleave: bool = False
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_position: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor_cfg: float | None = None
    rope_truncate: bool = True
    tie_word_embeddings: bool = False
    eos_token_id: tuple[int, ...] = ()
    weights: str = "auto"  # model.weights (runtime.core.config.WeightFormat)
    shared_expert_fusion: bool = True  # model.shared_expert_fusion (the shared expert stacked after the routed)
    tp_size: int = 1  # tensor-parallel ranks: num_heads is this rank's share of the model's heads

    @classmethod
    def from_config(cls, model: dict) -> ModelSpec:
        """From a resolved `model` config (runtime.model.deepseek.hf_config.resolve_model_config); keys it lacks
        take ``MODEL_DEFAULTS``."""
        m = {**MODEL_DEFAULTS, **{k: v for k, v in model.items() if v is not None}}
        pattern = [LayerKind(k) for k in m["layer_pattern"]]
        n = m["num_layers"]
        kinds = tuple(pattern[i % len(pattern)] for i in range(n))
        return cls(
            name=m["name"],
            num_layers=n,
            hidden_size=m["hidden_size"],
            num_heads=m["num_heads"],
            q_lora_rank=model.get("q_lora_rank"),
            kv_lora_rank=m["kv_lora_rank"],
            qk_nope_head_dim=m["qk_nope_head_dim"],
            qk_rope_head_dim=m["qk_rope_head_dim"],
            v_head_dim=m["v_head_dim"],
            vocab_size=m["vocab_size"],
            max_context=m["max_context"],
            dtype=TORCH_DTYPES[str(m["dtype"])],
            rope_theta=float(m["rope_theta"]),
            rms_norm_eps=float(m["rms_norm_eps"]),
            layer_kinds=kinds,
            linear_num_heads=m.get("linear_num_heads") or m["num_heads"],
            linear_head_dim=m.get("linear_head_dim", 128),
            weight_seed=m.get("weight_seed", 0),
            index_n_heads=m["index_n_heads"],
            index_head_dim=m["index_head_dim"],
            index_topk=m["index_topk"],
            model_type=m.get("model_type"),
            path=m.get("path"),
            mlp_kinds=tuple(mlp_layer_kinds(m, kinds)),
            intermediate_size=m["intermediate_size"],
            moe_intermediate_size=m["moe_intermediate_size"],
            n_routed_experts=m["n_routed_experts"],
            n_shared_experts=m["n_shared_experts"],
            num_experts_per_tok=m["num_experts_per_tok"],
            n_group=m["n_group"],
            topk_group=m["topk_group"],
            routed_scaling_factor=float(m["routed_scaling_factor"]),
            norm_topk_prob=bool(m["norm_topk_prob"]),
            scoring_func=str(m["scoring_func"]),
            topk_method=str(m["topk_method"]),
            rope_interleave=bool(m["rope_interleave"]),
            rope_type=str(m["rope_type"]),
            rope_factor=float(m["rope_factor"]),
            rope_original_max_position=int(m["rope_original_max_position"]),
            rope_beta_fast=float(m["rope_beta_fast"]),
            rope_beta_slow=float(m["rope_beta_slow"]),
            rope_mscale=m["rope_mscale"],
            rope_mscale_all_dim=m["rope_mscale_all_dim"],
            rope_attention_factor_cfg=m["rope_attention_factor"],
            rope_truncate=bool(m["rope_truncate"]),
            tie_word_embeddings=bool(m["tie_word_embeddings"]),
            eos_token_id=tuple(m["eos_token_id"]),
            weights=WeightFormat(m.get("weights", "auto")).value,
            shared_expert_fusion=bool(m.get("shared_expert_fusion", True)),
        )

    def draft(self, num_layers: int) -> ModelSpec:
        """The spec of a draft model made of this model's first ``num_layers`` layers."""
        return replace(self, name=f"{self.name}:draft{num_layers}", num_layers=num_layers,
                       layer_kinds=self.layer_kinds[:num_layers], mlp_kinds=self.mlp_kinds[:num_layers])

    def for_rank(self, tp_size: int) -> ModelSpec:
        """The spec one of ``tp_size`` tensor-parallel ranks computes with: ``num_heads / tp_size`` heads (what its
        attention backend and KV reads see); every other field is the model's (the weights carry their own
        sharded shapes). Loading always reads the full model's spec."""
        return replace(self, num_heads=self.num_heads // tp_size, tp_size=self.tp_size * tp_size)

    @property
    def is_dsv4(self) -> bool:
        """A DeepSeek-V4 model: served by runtime/model/dsv4 over the V4 pools; the MLA fields do not apply."""
        return self.model_type == DSV4_MODEL_TYPE

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale of both paths: 1 / sqrt(qk_nope + qk_rope), as the decompressed MHA has it, times
        ``yarn_mscale(factor, mscale_all_dim)^2`` under YaRN when ``mscale_all_dim`` is set (DeepSeek)."""
        scale = 1.0 / math.sqrt(self.qk_head_dim)
        if self.rope_type == "yarn" and self.rope_mscale_all_dim:
            scale *= yarn_mscale(self.rope_factor, self.rope_mscale_all_dim) ** 2
        return scale

    @property
    def rope_attention_factor(self) -> float:
        """The cos/sin multiplier: 1 without YaRN; under YaRN the configured ``attention_factor``, else
        ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else ``mscale(factor)``."""
        if self.rope_type != "yarn":
            return 1.0
        if self.rope_attention_factor_cfg is not None:
            return float(self.rope_attention_factor_cfg)
        if self.rope_mscale and self.rope_mscale_all_dim:
            return yarn_mscale(self.rope_factor, self.rope_mscale) / yarn_mscale(self.rope_factor,
                                                                                 self.rope_mscale_all_dim)
        return yarn_mscale(self.rope_factor)

    @property
    def has_moe(self) -> bool:
        return MLPLayer.moe in self.mlp_kinds

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == LayerKind.linear]

    @property
    def full_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k != LayerKind.linear]

    @property
    def sparse_layers(self) -> list[int]:
        """Layers with DeepSeek sparse attention (an indexer picks the tokens each query attends to)."""
        return [i for i, k in enumerate(self.layer_kinds) if k == LayerKind.sparse]

    @property
    def has_indexer(self) -> bool:
        return self.index_n_heads > 0

    @property
    def kv_cache_layers(self) -> list[int]:
        """Layers that keep a latent KV cache (full and sparse MLA)."""
        return [i for i, k in enumerate(self.layer_kinds) if k in (LayerKind.full, LayerKind.sparse)]


def mlp_layer_kinds(model: dict, kinds: tuple[LayerKind, ...]) -> list[MLPLayer]:
    """Per layer: none (mlp=none, and linear-attention layers), dense for the first ``first_k_dense_replace`` layers
    and where ``i % moe_layer_freq != 0`` or the model has no routed experts, MoE elsewhere (DeepSeek's rule)."""
    out = []
    for i, kind in enumerate(kinds):
        if str(model["mlp"]) == "none" or kind == LayerKind.linear:
            out.append(MLPLayer.none)
        elif (not model["n_routed_experts"] or i < model["first_k_dense_replace"]
              or i % max(1, model["moe_layer_freq"])):
            out.append(MLPLayer.dense)
        else:
            out.append(MLPLayer.moe)
    return out
