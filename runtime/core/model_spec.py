"""The model's attention shape as a small frozen value, derived once from the `model` config."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from runtime.core.config import LayerKind

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

    @classmethod
    def from_config(cls, model: dict) -> ModelSpec:
        pattern = [LayerKind(k) for k in model["layer_pattern"]]
        kinds = tuple(pattern[i % len(pattern)] for i in range(model["num_layers"]))
        return cls(
            name=model["name"],
            num_layers=model["num_layers"],
            hidden_size=model["hidden_size"],
            num_heads=model["num_heads"],
            q_lora_rank=model["q_lora_rank"],
            kv_lora_rank=model["kv_lora_rank"],
            qk_nope_head_dim=model["qk_nope_head_dim"],
            qk_rope_head_dim=model["qk_rope_head_dim"],
            v_head_dim=model["v_head_dim"],
            vocab_size=model["vocab_size"],
            max_context=model["max_context"],
            dtype=TORCH_DTYPES[str(model["dtype"])],
            rope_theta=model["rope_theta"],
            rms_norm_eps=model["rms_norm_eps"],
            layer_kinds=kinds,
            linear_num_heads=model.get("linear_num_heads") or model["num_heads"],
            linear_head_dim=model.get("linear_head_dim", 128),
            weight_seed=model["weight_seed"],
            index_n_heads=model.get("index_n_heads", 0),
            index_head_dim=model.get("index_head_dim", 128),
            index_topk=model.get("index_topk", 2048),
        )

    def draft(self, num_layers: int) -> ModelSpec:
        """The spec of a draft model made of this model's first ``num_layers`` layers."""
        return replace(self, name=f"{self.name}:draft{num_layers}", num_layers=num_layers,
                       layer_kinds=self.layer_kinds[:num_layers])

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale of both paths: 1 / sqrt(qk_nope + qk_rope), as the decompressed MHA has it."""
        return 1.0 / math.sqrt(self.qk_head_dim)

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
