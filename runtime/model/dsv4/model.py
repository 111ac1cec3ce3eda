"""The V4 causal LM over the V4 pools: embedding -> ``hc_mult`` streams -> decoder layers -> mHC head -> RMSNorm
-> LM head. The engine calls ``backend.init_forward_metadata(batch)`` before :meth:`DSV4Model.forward`, and
``pools.admit`` / ``pools.reserve`` / ``pools.release`` as requests come, grow and go."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.dsv4 import DSV4AttentionBackend
from runtime.core.batch import ForwardBatch
from runtime.core.dsv4_pools import DSV4Pools
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.hyper import hc_head
from runtime.model.dsv4.layer import DSV4DecoderLayer
from runtime.model.dsv4.norms import rms_norm
from runtime.model.dsv4.weights import ModelWeights


class DSV4Model:
    def __init__(self, cfg: DSV4Config, weights: ModelWeights, pools: DSV4Pools, backend: DSV4AttentionBackend):
        self.cfg, self.w = cfg, weights
        self.layers = [DSV4DecoderLayer(cfg, i, lw, pools, backend) for i, lw in enumerate(weights.layers)]

    def hidden(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] int64 -> final normalized hidden states [T, hidden]."""
        x = self.w.embed_tokens[input_ids]
        streams = x[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer.forward(streams, input_ids, batch)
        x = hc_head(self.w.hc_head, streams, self.cfg.hc_eps, self.cfg.rms_norm_eps)
        return rms_norm(x, self.w.norm, self.cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] -> logits [B, vocab] of each request's last new token."""
        last = batch.qo_indptr[1:].long() - 1
        return F.linear(self.hidden(input_ids, batch)[last], self.w.lm_head)
