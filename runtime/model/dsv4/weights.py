"""DeepSeek-V4 weights as dataclasses of tensors, keyed to the Hugging Face (transformers ``DeepseekV4*``)
parameter names; every matrix in HF layout ``[out, in]``.

``X.load(state, prefix)`` reads a flat state dict (``{name: tensor}``, e.g. from safetensors after the loader
has dequantized FP8 / renamed the original checkpoint's keys to HF names) with ``prefix`` such as
``"model.layers.3."``. :data:`HF_NAMES` of each class maps field -> name suffix, so the loader can list every
name a layer needs before reading anything.

Under tensor parallelism the tensors are a rank's slices (:mod:`runtime.model.dsv4.sharding`): the shapes below
with this rank's heads, output groups, vocabulary rows, experts or expert width; ``first_expert`` and
``vocab_start`` say where its experts and vocabulary rows start.

Matrices are float tensors, or with ``model.weights=stored`` / ``fp8`` held as the release stores them
(:class:`~runtime.model.quantized.BlockFP8` fp8 matrices, :class:`~runtime.model.quantized.PackedFP4` routed
experts: a :data:`~runtime.model.quantized.Weight`); the layers multiply them through the injected decoder ops'
``linear`` (:mod:`runtime.model.deepseek.ops`), the routed experts through
:func:`runtime.model.deepseek.moe.routed_expert_sum`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from runtime.core.dsv4_spec import DSV4LayerType
from runtime.model.dsv4.config import DSV4Config, MlpType
from runtime.model.quantized import QUANTIZED, Weight, bytes_by_dtype, weight_tensors


def _read(state: dict, name: str) -> torch.Tensor:
    t = state.get(name)
    if t is None:
        raise KeyError(f"DeepSeek-V4 weights: missing {name!r}. Fix: load a DeepSeek-V4 checkpoint with HF names "
                       "(transformers' conversion mapping), or check the prefix.")
    return t


class _Named:
    HF_NAMES: ClassVar[dict[str, str]] = {}

    @classmethod
    def load(cls, state: dict, prefix: str, **extra):
        got = {f: _read(state, prefix + s) for f, s in cls.HF_NAMES.items()}
        return cls(**got, **extra)

    def named(self, prefix: str = ""):
        """(group name, weight) of every field holding a tensor or a stored weight, nested ones included."""
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (torch.Tensor, *QUANTIZED)):
                yield prefix + f.name, v
            elif isinstance(v, _Named):
                yield from v.named(f"{prefix}{f.name}.")

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (a stored weight's values and scales)."""
        return [t for _, v in self.named() for t in weight_tensors(v)]


@dataclass
class CompressorWeights(_Named):
    """``self_attn.compressor.`` (and the indexer's own compressor): width = 2 * dim when overlapping (CSA)."""

    kv_proj: Weight  # [width, hidden]
    gate_proj: Weight  # [width, hidden]
    position_bias: torch.Tensor  # [rate, width]
    kv_norm: torch.Tensor  # [dim]
    HF_NAMES: ClassVar[dict[str, str]] = {"kv_proj": "kv_proj.weight", "gate_proj": "gate_proj.weight",
                                          "position_bias": "position_bias", "kv_norm": "kv_norm.weight"}


@dataclass
class IndexerWeights(CompressorWeights):
    """``self_attn.compressor.indexer.``: a compressor at ``index_head_dim`` plus the query and weight heads."""

    q_b_proj: Weight = None  # [Hi * Di, q_lora]
    weights_proj: torch.Tensor = None  # [Hi, hidden]
    HF_NAMES: ClassVar[dict[str, str]] = {**CompressorWeights.HF_NAMES, "q_b_proj": "q_b_proj.weight",
                                          "weights_proj": "scorer.weights_proj.weight"}


@dataclass
class AttentionWeights(_Named):
    """``self_attn.``"""

    q_a_proj: Weight  # [q_lora, hidden]
    q_a_norm: torch.Tensor  # [q_lora]
    q_b_proj: Weight  # [H * D, q_lora]
    kv_proj: Weight  # [D, hidden]
    kv_norm: torch.Tensor  # [D]
    o_a_proj: Weight  # [G * o_lora, H * D / G]  (block-diagonal per group)
    o_b_proj: Weight  # [hidden, G * o_lora]
    sinks: torch.Tensor  # [H]
    compressor: CompressorWeights | None = None  # CSA / HCA layers
    indexer: IndexerWeights | None = None  # CSA layers
    HF_NAMES: ClassVar[dict[str, str]] = {
        "q_a_proj": "q_a_proj.weight", "q_a_norm": "q_a_norm.weight", "q_b_proj": "q_b_proj.weight",
        "kv_proj": "kv_proj.weight", "kv_norm": "kv_norm.weight", "o_a_proj": "o_a_proj.weight",
        "o_b_proj": "o_b_proj.weight", "sinks": "sinks"}


@dataclass
class HyperConnectionWeights(_Named):
    """``attn_hc.`` / ``ffn_hc.``: n = hc_mult."""

    fn: torch.Tensor  # [(2 + n) * n, n * hidden]
    base: torch.Tensor  # [(2 + n) * n]
    scale: torch.Tensor  # [3]
    HF_NAMES: ClassVar[dict[str, str]] = {"fn": "fn", "base": "base", "scale": "scale"}


@dataclass
class HyperHeadWeights(_Named):
    """``model.hc_head.``"""

    hc_fn: torch.Tensor  # [n, n * hidden]
    hc_base: torch.Tensor  # [n]
    hc_scale: torch.Tensor  # [1]
    HF_NAMES: ClassVar[dict[str, str]] = {"hc_fn": "hc_fn", "hc_base": "hc_base", "hc_scale": "hc_scale"}


@dataclass
class MoEWeights(_Named):
    """``mlp.``: router, routed experts (3-D, gate rows first in ``gate_up_proj``) and the shared expert."""

    gate: torch.Tensor  # [E, hidden]
    gate_up_proj: Weight  # [E, 2 * I, hidden]
    down_proj: Weight  # [E, hidden, I]
    shared_gate_proj: Weight  # [Is, hidden]
    shared_up_proj: Weight  # [Is, hidden]
    shared_down_proj: Weight  # [hidden, Is]
    e_score_correction_bias: torch.Tensor | None = None  # [E] float32 (top-k routed layers)
    tid2eid: torch.Tensor | None = None  # [vocab, top_k] int64 (hash layers)
    first_expert: int = 0  # global id of gate_up_proj[0] (moe=ep: this rank's first expert; else 0)
    HF_NAMES: ClassVar[dict[str, str]] = {
        "gate": "gate.weight", "gate_up_proj": "experts.gate_up_proj", "down_proj": "experts.down_proj",
        "shared_gate_proj": "shared_experts.gate_proj.weight", "shared_up_proj": "shared_experts.up_proj.weight",
        "shared_down_proj": "shared_experts.down_proj.weight"}


@dataclass
class LayerWeights(_Named):
    """``model.layers.{i}.``"""

    attn: AttentionWeights
    mlp: MoEWeights
    input_layernorm: torch.Tensor  # [hidden]
    post_attention_layernorm: torch.Tensor  # [hidden]
    attn_hc: HyperConnectionWeights
    ffn_hc: HyperConnectionWeights

    @classmethod
    def load(cls, state: dict, prefix: str, *, cfg: DSV4Config, layer_id: int, first_expert: int = 0
             ) -> LayerWeights:
        kind = cfg.attention.layer_types[layer_id]
        a = prefix + "self_attn."
        comp = idx = None
        if kind != DSV4LayerType.sliding:
            comp = CompressorWeights.load(state, a + "compressor.")
        if kind == DSV4LayerType.csa:
            idx = IndexerWeights.load(state, a + "compressor.indexer.")
        routed = {}
        if cfg.mlp_types[layer_id] == MlpType.hash_moe:
            routed["tid2eid"] = _read(state, prefix + "mlp.gate.tid2eid")
        else:
            routed["e_score_correction_bias"] = _read(state, prefix + "mlp.gate.e_score_correction_bias")
        return cls(
            attn=AttentionWeights.load(state, a, compressor=comp, indexer=idx),
            mlp=MoEWeights.load(state, prefix + "mlp.", **routed, first_expert=first_expert),
            input_layernorm=_read(state, prefix + "input_layernorm.weight"),
            post_attention_layernorm=_read(state, prefix + "post_attention_layernorm.weight"),
            attn_hc=HyperConnectionWeights.load(state, prefix + "attn_hc."),
            ffn_hc=HyperConnectionWeights.load(state, prefix + "ffn_hc."),
        )


@dataclass
class ModelWeights(_Named):
    """The whole ``DeepseekV4ForCausalLM`` (MTP layers are not read)."""

    embed_tokens: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    hc_head: HyperHeadWeights
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    vocab_start: int = 0  # first vocabulary id of embed_tokens / lm_head (tensor parallelism: this rank's slice)
    source: str = "random"  # where they came from: "random" (a preset) or the checkpoint folder
    stored_dtypes: dict = field(default_factory=dict)  # checkpoint dtype -> tensors read in it (dequantized / cast)
    load_seconds: float = 0.0
    peak_host_bytes: int = 0

    @classmethod
    def load(cls, state: dict, prefix: str = "", *, cfg: DSV4Config, first_expert: int = 0,
             vocab_start: int = 0) -> ModelWeights:
        """``state`` holds the whole model's tensors, or a rank's slices whose experts start at ``first_expert``
        and vocabulary rows at ``vocab_start``."""
        m = prefix + "model."
        return cls(
            embed_tokens=_read(state, m + "embed_tokens.weight"),
            layers=[LayerWeights.load(state, f"{m}layers.{i}.", cfg=cfg, layer_id=i, first_expert=first_expert)
                    for i in range(cfg.attention.num_layers)],
            hc_head=HyperHeadWeights.load(state, m + "hc_head."),
            norm=_read(state, m + "norm.weight"),
            lm_head=_read(state, prefix + "lm_head.weight"),
            vocab_start=vocab_start,
        )

    def named(self, prefix: str = ""):
        """(group name, weight): the embedding, norm, LM head, mHC head, then every layer's (group names without
        the layer index)."""
        yield from (("embed_tokens", self.embed_tokens), ("norm", self.norm), ("lm_head", self.lm_head))
        yield from self.hc_head.named("hc_head.")
        for layer in self.layers:
            yield from layer.named()

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for _, v in self.named() for t in weight_tensors(v)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def bytes_by_dtype(self) -> dict[str, int]:
        """dtype -> bytes as held (:func:`runtime.model.quantized.bytes_by_dtype`: fp8 values, packed fp4 bytes,
        their scales: float32 for fp8, ue8m0 bytes for fp4; the float dtypes)."""
        return bytes_by_dtype(v for _, v in self.named())

    def unquantized_bytes(self) -> dict[str, int]:
        """Weight group (``attn.q_b_proj``, ``mlp.gate_up_proj``, ``embed_tokens``, ...: summed over the layers) ->
        bytes held in a float dtype (all of them with ``model.weights=dequantize`` / ``bf16``)."""
        out: dict[str, int] = {}
        for group, v in self.named():
            if isinstance(v, torch.Tensor):
                out[group] = out.get(group, 0) + v.numel() * v.element_size()
        return out
