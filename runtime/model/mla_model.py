"""A DeepSeek MLA model over an injected backend: embedding, decoder layers, final norm, LM head.

Each layer: ``x + attn(norm(x))`` (MLA, :mod:`runtime.model.deepseek.attention`; or a linear-attention layer
in hybrid models), then, unless the layer is attention-only (``model.mlp=none``), ``x + mlp(norm(x))`` with
the dense SwiGLU MLP or the MoE (:mod:`runtime.model.deepseek.moe`). Each residual add is done together with
the norm that follows it (``ops.add_rms_norm``: the next sublayer's input norm, or the final norm). The weights
are injected: seeded random (presets) or loaded from a Hugging Face folder
(:mod:`runtime.model.deepseek.checkpoint`); so are the small ops (:mod:`runtime.model.deepseek.ops`: fused
Triton kernels or torch, by ``model.fused``).

Tensor parallelism (:mod:`runtime.model.deepseek.sharding` says who holds what): the injected group sums the
row-parallel outputs (attention ``o_proj``; the dense MLP, or the MoE layer's routed and shared experts together:
one all-reduce each) before they are added to the residual stream, so the hidden states are the same on every
rank after each layer (``group.reduce_add_rms_norm``: the sum, the residual add and the next norm, fused into one
kernel under ``parallel.allreduce=fused``). The embedding is vocabulary-parallel (each rank looks up its own rows,
zeros elsewhere, all-reduce) and the LM head gives each rank its slice of the logits: the greedy path (``top2``)
all-gathers each rank's two largest (value, id) pairs, sampling (``logits``) the full vocabulary. With one rank the
group does nothing and the embedding is a plain lookup.
"""

from __future__ import annotations

import torch

from backends.base import AttentionBackend, MHAChunkPrefill, SparseDecode
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.config import LayerKind
from runtime.core.kv_pool import MLAKVPool
from runtime.core.model_spec import MLPLayer, ModelSpec
from runtime.core.parallel import Collectives
from runtime.model.deepseek.attention import MLAAttention, linear_attention
from runtime.model.deepseek.moe import GROUPED_MM
from runtime.model.deepseek.ops import FusedOps, TorchOps
from runtime.model.deepseek.rope import rope_tables
from runtime.model.deepseek.weights import ModelWeights
from runtime.model.dump import AttentionDumper
from runtime.model.layers import embed_vocab_parallel, vocab_parallel_top2


class MLAModel:
    """A DeepSeek MLA stack over an injected backend.

    Parameters
    ----------
    spec : ModelSpec
    device : torch.device
    kv_pool : MLAKVPool
    backend : AttentionBackend
    mha_prefill : MHAChunkPrefill or None
        The hook for the MHA chunked-prefix prefill; None selects the absorbed path for prefill.
    dumper : AttentionDumper or None
    sparse : SparseDecode or None
        The sparse backend's hooks, for sparse layers (stores their indexer keys, runs their decode).
    weights : ModelWeights
        ``spec.num_layers`` layers of weights (seeded random, loaded, or the target's first layers for a draft).
    ops : TorchOps or FusedOps
        The decoder's small ops (``model.fused`` and the device's capabilities chose the class).
    group : Collectives
        The tensor-parallel collectives over the group, one rank included (``spec.num_heads`` is this rank's share
        of the heads).
    shares_weights : bool
        True for the speculative draft, whose weights are the target's (its weight bytes count 0).
    """

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device,
        kv_pool: MLAKVPool,
        backend: AttentionBackend,
        mha_prefill: MHAChunkPrefill | None,
        dumper: AttentionDumper | None,
        sparse: SparseDecode | None,
        weights: ModelWeights,
        ops: TorchOps | FusedOps,
        group: Collectives,
        shares_weights: bool = False,
    ):
        if len(weights.layers) != spec.num_layers:
            raise ValueError(f"model '{spec.name}': {len(weights.layers)} layers of weights for {spec.num_layers} "
                             "layers. Fix: derive a draft's weights with ModelWeights.first(n).")
        self.spec, self.device, self.kv_pool = spec, device, kv_pool
        self.backend, self.mha_prefill, self.dumper, self.sparse = backend, mha_prefill, dumper, sparse
        self.weights, self.shares_weights, self.ops, self.group = weights, shares_weights, ops, group
        self.layers = weights.layers
        self._embed = self._embed_full if weights.embed.shape[0] == spec.vocab_size else self._embed_vocab_parallel
        dump_layer = spec.full_layers[0] if spec.full_layers and dumper is not None else -1
        self.dump_layer = dump_layer
        self.attention = MLAAttention(spec, kv_pool, backend, mha_prefill, dumper, sparse, dump_layer, ops)
        self.rope_cos, self.rope_sin = rope_tables(spec, device)
        moe = [lw.mlp.down for k, lw in zip(spec.mlp_kinds, self.layers) if k == MLPLayer.moe]
        moe_dims = tuple(d for down in moe for d in down.shape[1:])
        # torch._grouped_mm multiplies float experts (block-fp8 ones take the fused ops' fp8 kernels)
        self.grouped_mm = spec.has_moe and GROUPED_MM.usable(device, moe[0].dtype, moe_dims)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this model owns (0 for a draft that shares the target's)."""
        return 0 if self.shares_weights else self.weights.nbytes

    # -------------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] int64 -> final-normed hidden states [T, hidden] in the model dtype."""
        s, ops, eps = self.spec, self.ops, self.spec.rms_norm_eps
        x = self._embed(input_ids)
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        use_mha = batch.mode == ForwardMode.EXTEND and self.mha_prefill is not None
        # the last sublayer's row-parallel partial output: summed over the ranks, added to the residual stream x
        # and normed by the next reduce_add_rms_norm (one kernel under parallel.allreduce=fused)
        delta, g = None, self.group
        for layer_id, (kind, mkind, lw) in enumerate(zip(s.layer_kinds, s.mlp_kinds, self.layers)):
            if kind == LayerKind.linear:  # (hybrid models run at tp=1: the sum is the partial itself)
                x = x if delta is None else x + g.all_reduce(delta)
                x, delta = x + linear_attention(s, self.backend, layer_id, lw.attn, x, batch), None
            else:
                x, xn = g.reduce_add_rms_norm(x, delta, lw.attn.attn_norm, eps, ops)
                delta = self.attention.forward(layer_id, lw.attn, xn, cos, sin, batch, use_mha)
            if mkind == MLPLayer.dense:
                x, xn = g.reduce_add_rms_norm(x, delta, lw.mlp_norm, eps, ops)
                delta = ops.dense_mlp(lw.mlp, xn)
            elif mkind == MLPLayer.moe:
                x, xn = g.reduce_add_rms_norm(x, delta, lw.mlp_norm, eps, ops)
                delta = ops.moe(s, lw.mlp, xn, self.grouped_mm)
        return g.reduce_add_rms_norm(x, delta, self.weights.final_norm, eps, ops)[1]

    def _embed_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weights.embed[input_ids]

    def _embed_vocab_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the embedding, zeros for ids outside its slice, summed over the ranks."""
        return embed_vocab_parallel(self.weights.embed, self.weights.vocab_start, input_ids, self.group)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (this rank's vocabulary slice, all-gathered: the same on every rank)."""
        lm_head = self.weights.lm_head
        return self.group.all_gather(self.ops.linear(hidden.to(lm_head.dtype), lm_head)).float()

    def top2(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy path's logits: [N, hidden] -> (values [N, 2] float32, token ids [N, 2] int64), the two largest
        logits over the whole vocabulary, from each rank's own top 2 (one all-gather of [N, 4] floats)."""
        lm_head = self.weights.lm_head
        local = self.ops.linear(hidden.to(lm_head.dtype), lm_head)
        return vocab_parallel_top2(local, self.weights.vocab_start, self.group)
