"""MLA attention of one DeepSeek layer over the injected backend, and the linear-attention layer of hybrids.

MLA per layer: one GEMM of the normed hidden state with ``qkv_a`` (``q_a_proj`` and ``kv_a_proj_with_mqa``
concatenated), then q (q LoRA: RMSNorm -> ``q_b_proj``, one op; else ``q_proj``), RMSNorm on the latent
(kv_lora_rank), RoPE on the rope dims of q and the latent (interleaved or half-split,
:mod:`runtime.model.deepseek.rope`), the latent row written to the KV pool and, on the absorbed path, q_nope @ W_UK
(one op); the small ops come from the injected :mod:`runtime.model.deepseek.ops` (fused kernels or torch).
Decode takes the absorbed path (``W_UK`` of ``kv_b_proj`` folded into q by ``ops.rope_latent``; ``W_UV`` applied to
the latent output by ``ops.head_linear``; each one product per head (a batched matmul, or the few-row kernel at
decode), written in the layout the next op reads);
prefill takes the MHA chunked-prefix path when a :class:`MHAChunkPrefill` hook is injected, the absorbed path
otherwise. Sparse layers (V3.2) also compute the indexer's q, k and head weights and hand them to the sparse
backend's hooks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.base import AttentionBackend, MHAChunkPrefill, SparseDecode
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.kv_pool import MLAKVPool
from runtime.core.model_spec import ModelSpec
from runtime.model.deepseek.ops import FusedOps, TorchOps
from runtime.model.deepseek.weights import AttentionWeights, LinearLayerWeights
from runtime.model.dump import AttentionDumper
from runtime.model.indexer import indexer_projections
from runtime.model.layers import rms_norm


class MLAAttention:
    """The attention half of every MLA layer (weights passed per call).

    Parameters
    ----------
    spec : ModelSpec
    kv_pool : MLAKVPool
    backend : AttentionBackend
    mha_prefill : MHAChunkPrefill or None
        The MHA chunked-prefix prefill hook; None selects the absorbed path for prefill.
    dumper : AttentionDumper or None
    sparse : SparseDecode or None
        The sparse backend's hooks, for sparse layers.
    dump_layer : int
        The layer whose attention inputs/outputs the dumper saves (-1: none).
    ops : TorchOps or FusedOps
        The small ops (norms, RoPE, the latent write).
    """

    def __init__(self, spec: ModelSpec, kv_pool: MLAKVPool, backend: AttentionBackend,
                 mha_prefill: MHAChunkPrefill | None, dumper: AttentionDumper | None, sparse: SparseDecode | None,
                 dump_layer: int, ops: TorchOps | FusedOps):
        self.spec, self.kv_pool, self.backend = spec, kv_pool, backend
        self.mha_prefill, self.dumper, self.sparse, self.dump_layer = mha_prefill, dumper, sparse, dump_layer
        self.ops = ops

    def forward(self, layer_id: int, lw: AttentionWeights, xn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch, use_mha: bool) -> torch.Tensor:
        """xn [T, D] normed hidden states -> attention output [T, D] (before the residual add)."""
        s, ops = self.spec, self.ops
        t, h, ql = xn.shape[0], s.num_heads, lw.q_lora
        qkv = ops.linear(xn, lw.qkv_a)  # [T, q_lora + kv_lora + rope]
        if ql and lw.indexer is None:  # the q LoRA's RMSNorm and q_b_proj in one op
            q_in, q = None, ops.norm_linear(qkv[:, :ql], lw.q_a_norm, s.rms_norm_eps, lw.q_b)
        else:  # q_b_proj's (q_proj's) input, which a sparse layer's indexer also reads
            q_in = ops.rms_norm(qkv[:, :ql], lw.q_a_norm, s.rms_norm_eps) if ql else xn
            q = ops.linear(q_in, lw.q_b)
        q = q.view(t, h, s.qk_head_dim)
        q_nope, q_pe, ckv, kpe, q_abs = ops.rope_latent(s, q, self.kv_pool, layer_id, batch.out_cache_loc,
                                                        qkv[:, ql:], lw.kv_a_norm, cos, sin,
                                                        None if use_mha else lw.w_uk)  # q_abs [T, H, kv_lora]
        index = None
        if lw.indexer is not None:  # sparse layer: the backend keeps its indexer keys (and, with HiSparse, its KV)
            index = indexer_projections(lw.indexer, s, xn, q_in, cos, sin, ops.linear)
            self.sparse.store_sparse_tokens(torch.cat([ckv, kpe], dim=-1), index[1], layer_id, batch)
        decode = batch.mode == ForwardMode.DECODE

        if use_mha:
            o = self._mha_prefill(layer_id, lw, q_nope, q_pe, ckv, kpe, batch)
        else:
            if index is not None:  # sparse layer: every query token attends to its own indexer top-k
                fwd = self.sparse.forward_sparse_decode if decode else self.sparse.forward_sparse_extend
                o_lat = fwd(q_abs, q_pe, index[0], index[2], layer_id, batch)
            else:
                fwd = self.backend.forward_decode if decode else self.backend.forward_extend
                o_lat = fwd(q_abs, q_pe, layer_id, batch)
            if index is None and layer_id == self.dump_layer and self.dumper.wants(batch.mode.value):
                self.dumper.save_absorbed(layer_id, batch, self.kv_pool, q_abs, q_pe, o_lat, s.kv_lora_rank, s.sm_scale)
            o = ops.head_linear(o_lat, lw.w_uv)  # [T, H, v_head]
        return ops.linear(o.reshape(t, h * s.v_head_dim), lw.o)

    def decompress(self, lw: AttentionWeights, ckv: torch.Tensor, kpe: torch.Tensor):
        """Latent rows -> per-head keys and values: ckv [N, kv_lora], kpe [N, rope] -> k [N, H, qk_head],
        v [N, H, v_head]."""
        k_nope = torch.einsum("nc,hdc->nhd", ckv, lw.w_uk)
        v = torch.einsum("nc,hcd->nhd", ckv, lw.w_uv)
        k = torch.cat([k_nope, kpe[:, None, :].expand(-1, self.spec.num_heads, -1)], dim=-1)
        return k, v

    def _mha_prefill(self, layer_id, lw, q_nope, q_pe, ckv, kpe, batch: ForwardBatch) -> torch.Tensor:
        s, hook = self.spec, self.mha_prefill
        q = torch.cat([q_nope, q_pe], dim=-1)
        k, v = self.decompress(lw, ckv, kpe)
        out, lse = hook.forward_mha_extend(q, k, v, layer_id, batch)
        for i, chunk in enumerate(batch.prefix_chunks):
            rows = self.kv_pool.gather(layer_id, chunk.kv_slots)
            k_c, v_c = self.decompress(lw, rows[:, : s.kv_lora_rank], rows[:, s.kv_lora_rank :])
            out_c, lse_c = hook.forward_mha_prefix_chunk(q, k_c, v_c, i, layer_id, batch)
            out, lse = hook.merge_states(out, lse, out_c, lse_c)
        out = out.to(q.dtype)
        if layer_id == self.dump_layer and self.dumper.wants("extend_mha"):
            self.dumper.save_mha(layer_id, batch, self.kv_pool, q, out, lambda c, p: self.decompress(lw, c, p), s.sm_scale)
        return out


def linear_attention(spec: ModelSpec, backend: AttentionBackend, layer_id: int, lw: LinearLayerWeights,
                     x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """A hybrid model's lightning-attention layer: x [T, D] (un-normed) -> output [T, D] (before the residual)."""
    t, hl, dl = x.shape[0], spec.linear_num_heads, spec.linear_head_dim
    xn = rms_norm(x, lw.attn_norm, spec.rms_norm_eps)
    q = F.silu(xn @ lw.wq).view(t, hl, dl)
    k = F.silu(xn @ lw.wk).view(t, hl, dl)
    v = (xn @ lw.wv).view(t, hl, dl)
    o = backend.forward_linear(q, k, v, layer_id, batch)
    return rms_norm(o.reshape(t, hl * dl), lw.out_norm, spec.rms_norm_eps) @ lw.wo
