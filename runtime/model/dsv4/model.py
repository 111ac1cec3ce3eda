"""The V4 causal LM over the V4 pools: embedding -> ``hc_mult`` streams -> decoder layers -> mHC head -> RMSNorm
-> LM head. The engine calls ``backend.init_forward_metadata(batch)`` before :meth:`DSV4Model.forward`; the
token allocator (:class:`runtime.core.dsv4_slots.DSV4TokenSlots`) admits, grows and releases requests in the
pools. Same engine-facing surface as :class:`runtime.model.mla_model.MLAModel`: ``forward`` -> hidden states,
``logits``, ``spec``, ``weights``, ``weight_bytes``.

Tensor parallelism (:mod:`runtime.model.dsv4.sharding` says who holds what): ``cfg`` is this rank's (its share of
the heads and output groups); each layer sums its attention output and its MoE output over the ranks (one
all-reduce each), so the mHC streams are the same on every rank. The embedding is vocabulary-parallel (each rank
looks up its rows, zeros elsewhere, all-reduce) and the LM head gives each rank its slice of the logits,
all-gathered into the full vocabulary on every rank. With one rank the group does nothing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.dsv4 import DSV4AttentionBackend
from runtime.core.batch import ForwardBatch
from runtime.core.dsv4_pools import DSV4Pools
from runtime.core.model_spec import ModelSpec
from runtime.core.parallel import SingleRank, TPGroup
from runtime.model.deepseek.moe import GROUPED_MM
from runtime.model.deepseek.ops import FusedOps, TorchOps
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.hyper import hc_head
from runtime.model.dsv4.layer import DSV4DecoderLayer
from runtime.model.dsv4.norms import rms_norm
from runtime.model.dsv4.weights import ModelWeights
from runtime.model.layers import embed_vocab_parallel, vocab_parallel_top2


class DSV4Model:
    """Parameters
    ----------
    spec : ModelSpec
        The engine's view (name, hidden size, dtype); the V4 math reads ``cfg``.
    cfg : DSV4Config
        This rank's (:func:`runtime.model.dsv4.sharding.rank_config`; the model's own with one rank).
    weights : ModelWeights
        This rank's slices (the whole model with one rank).
    pools : DSV4Pools
    backend : DSV4AttentionBackend
    group : SingleRank or TPGroup
        The tensor-parallel group (:class:`SingleRank` with one rank: no communication).
    ops : TorchOps or FusedOps
        The decoder ops (``model.fused`` and the device's capabilities chose the class): their ``linear`` multiplies
        every weight matrix of the layers (block-fp8 ones through the fp8 kernels on CUDA); the routed experts and
        the LM head do not use them.
    """

    def __init__(self, spec: ModelSpec, cfg: DSV4Config, weights: ModelWeights, pools: DSV4Pools,
                 backend: DSV4AttentionBackend, group: SingleRank | TPGroup,
                 ops: TorchOps | FusedOps):
        a = cfg.attention
        if len(weights.layers) != a.num_layers:
            raise ValueError(f"DeepSeek-V4 model: got {len(weights.layers)} layers of weights; expected "
                             f"{a.num_layers}. Fix: build the weights from the same DSV4Config.")
        heads = weights.layers[0].attn.q_b_proj.shape[0] // a.head_dim
        if heads != a.num_heads:
            raise ValueError(f"DeepSeek-V4 model: got weights of {heads} query heads; expected {a.num_heads} (this "
                             "rank's). Fix: give the model the rank's config (sharding.rank_config) and weights.")
        self.spec, self.cfg, self.w, self.weights = spec, cfg, weights, weights
        self.group, self.ops = group, ops
        self.device = weights.embed_tokens.device
        down = weights.layers[0].mlp.down_proj
        dims = (cfg.hidden_size, down.shape[2])  # the expert width this rank holds
        # torch._grouped_mm multiplies float experts (bf16 ones on SM90); stored ones take the fp4 expert kernels
        # (packed fp4 on CUDA) or the per-expert loop, each expert dequantized as it runs: see deepseek/moe.py
        self.grouped_mm = GROUPED_MM.usable(self.device, down.dtype, dims)
        self.layers = [DSV4DecoderLayer(cfg, i, lw, pools, backend, self.group, ops, self.grouped_mm)
                       for i, lw in enumerate(weights.layers)]

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes

    def hidden(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] int64 -> final normalized hidden states [T, hidden]."""
        x = self._embed(input_ids)
        streams = x[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer.forward(streams, input_ids, batch)
        x = hc_head(self.w.hc_head, streams, self.cfg.hc_eps, self.cfg.rms_norm_eps)
        return rms_norm(x, self.w.norm, self.cfg.rms_norm_eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.w.embed_tokens.shape[0] == self.cfg.vocab_size:
            return self.w.embed_tokens[input_ids]
        return embed_vocab_parallel(self.w.embed_tokens, self.w.vocab_start, input_ids, self.group)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The engine's call: input_ids [T] -> final normalized hidden states [T, hidden] in the model dtype."""
        return self.hidden(input_ids, batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (this rank's vocabulary slice, all-gathered: the same on every rank)."""
        return self.group.all_gather(F.linear(hidden.to(self.w.lm_head.dtype), self.w.lm_head)).float()

    def top2(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy path: (values [N, 2] float32, ids [N, 2] int64) over the vocabulary (one small all-gather)."""
        local = F.linear(hidden.to(self.w.lm_head.dtype), self.w.lm_head)
        return vocab_parallel_top2(local, self.w.vocab_start, self.group)
