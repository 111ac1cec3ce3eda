"""The V4 causal LM over the V4 pools: embedding -> ``hc_mult`` streams -> decoder layers -> mHC head -> RMSNorm
-> LM head. The engine calls ``backend.init_forward_metadata(batch)`` before :meth:`DSV4Model.forward`; the
token allocator (:class:`runtime.core.dsv4_slots.DSV4TokenSlots`) admits, grows and releases requests in the
pools. Same engine-facing surface as :class:`runtime.model.mla_model.MLAModel`: ``forward`` -> hidden states,
``logits``, ``spec``, ``weights``, ``weight_bytes``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.dsv4 import DSV4AttentionBackend
from runtime.core.batch import ForwardBatch
from runtime.core.dsv4_pools import DSV4Pools
from runtime.core.model_spec import ModelSpec
from runtime.model.deepseek.moe import grouped_mm_usable
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.hyper import hc_head
from runtime.model.dsv4.layer import DSV4DecoderLayer
from runtime.model.dsv4.norms import rms_norm
from runtime.model.dsv4.weights import ModelWeights


class DSV4Model:
    """Parameters
    ----------
    spec : ModelSpec
        The engine's view (name, hidden size, dtype); the V4 math reads ``cfg``.
    cfg : DSV4Config
    weights : ModelWeights
    pools : DSV4Pools
    backend : DSV4AttentionBackend
    """

    def __init__(self, spec: ModelSpec, cfg: DSV4Config, weights: ModelWeights, pools: DSV4Pools,
                 backend: DSV4AttentionBackend):
        if len(weights.layers) != cfg.attention.num_layers:
            raise ValueError(f"DeepSeek-V4 model: got {len(weights.layers)} layers of weights; expected "
                             f"{cfg.attention.num_layers}. Fix: build the weights from the same DSV4Config.")
        self.spec, self.cfg, self.w, self.weights = spec, cfg, weights, weights
        self.device = weights.embed_tokens.device
        dims = (cfg.hidden_size, cfg.moe_intermediate_size)
        self.grouped_mm = grouped_mm_usable(self.device, weights.embed_tokens.dtype, dims)  # V4 experts: see moe.py
        self.layers = [DSV4DecoderLayer(cfg, i, lw, pools, backend, self.grouped_mm)
                       for i, lw in enumerate(weights.layers)]

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes

    def hidden(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] int64 -> final normalized hidden states [T, hidden]."""
        x = self.w.embed_tokens[input_ids]
        streams = x[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer.forward(streams, input_ids, batch)
        x = hc_head(self.w.hc_head, streams, self.cfg.hc_eps, self.cfg.rms_norm_eps)
        return rms_norm(x, self.w.norm, self.cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The engine's call: input_ids [T] -> final normalized hidden states [T, hidden] in the model dtype."""
        return self.hidden(input_ids, batch)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return F.linear(hidden.to(self.w.lm_head.dtype), self.w.lm_head).float()
