"""The V4 decoder layer over the V4 pools and a ``dsv4`` attention backend.

Attention block (per step, T new tokens of B requests, flattened as in :class:`runtime.core.batch.ForwardBatch`):

1. q: ``q_a_proj`` -> RMSNorm (``q_residual``, shared with the indexer) -> ``q_b_proj`` -> per-head unweighted
   RMSNorm -> RoPE; kv: ``kv_proj`` -> RMSNorm -> RoPE (one 512-d row, key and value of every head). Sliding-only
   layers use the ``main`` rope, compressed layers the ``compress`` rope (YaRN) everywhere.
2. compressed layers: each request's new tokens go through the compressor(s) (extend: :func:`compress_step` per
   request; decode: the ops' ``compress_decode``, the whole batch at once); closed windows' entries (RoPE at
   ``e * rate``) go to ``backend.store_entries`` / ``store_decode_entries`` (the compressed pool, or HiSparse's
   host pool for CSA entries); CSA: indexer queries -> ``backend.select_topk``.
3. ``backend.forward_decode`` / ``forward_extend`` (window + compressed entries + sinks; stores the window rows).
4. inverse RoPE (at the query position) on the output's rope channels; grouped low-rank output projection
   (``o_a_proj`` block-diagonal over ``o_groups`` head groups, then ``o_b_proj``).

Every product with a weight matrix goes through the injected decoder ops' ``linear``
(:mod:`runtime.model.deepseek.ops`): :class:`TorchOps` (the CPU, ``model.fused=off``: a stored block-fp8 weight
dequantized, then the matmul, exactly :func:`runtime.model.quantized.linear`) or :class:`FusedOps` (CUDA: block-fp8
weights through the block-fp8 Triton kernels, bf16 / fp16 ones at few rows through the skinny GEMV kernels).

Every RoPE of the step's tokens (q, kv, the indexer query, and the inverse on the output) goes through the ops'
``rope_tail`` (:class:`TorchOps`: :func:`~runtime.model.deepseek.rope.cos_sin` then
:func:`~runtime.model.deepseek.rope.apply_rope_tail`; :class:`FusedOps`: one Triton launch each); extend's closed
compressor entries keep the torch functions.

Decoder layer: mHC collapse -> RMSNorm -> attention -> mHC expand; mHC collapse -> RMSNorm -> MoE -> mHC expand.
mHC's mixing linear is torch (:func:`runtime.model.dsv4.hyper.hc_mixed`, its input norm the ops' ``v4_rms_norm``);
the rest goes through the ops' ``hc_mix`` / ``hc_post`` (torch, or one Triton kernel each with :class:`FusedOps`), and
every RMSNorm through ``v4_rms_norm``.

Tensor parallelism: ``cfg`` and the weights are this rank's (its heads, their sinks and output groups; its experts
or expert width); the attention output (after ``o_b_proj``) and the MoE output are partial sums, added over the
ranks by the injected group (one all-reduce each) before mHC expands them.
"""

from __future__ import annotations

import torch

from backends.dsv4 import DSV4AttentionBackend
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.dsv4_pools import CompressorStatePool, DSV4Pools
from runtime.core.dsv4_spec import DSV4LayerType
from runtime.core.parallel import SingleRank, TPGroup
from runtime.model.deepseek.ops import FusedOps, TorchOps
from runtime.model.deepseek.rope import apply_rope_tail, cos_sin
from runtime.model.dsv4.compressor import compress_step
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.hyper import hc_mixed
from runtime.model.dsv4.moe import moe_forward
from runtime.model.dsv4.weights import AttentionWeights, CompressorWeights, HyperConnectionWeights, LayerWeights
from runtime.model.quantized import BlockFP8, Weight, dense


def grouped_output(o: torch.Tensor, o_a: Weight, o_b: Weight, groups: int,
                   ops: TorchOps | FusedOps) -> torch.Tensor:
    """o [T, H, D] -> [T, hidden]: group g of the flattened heads through block g of o_a [G * R, H * D / G],
    the concatenated [T, G * R] through o_b [hidden, G * R] (``ops.linear``).

    A block-fp8 o_a whose R rows per group are whole scale blocks (V4-Flash: R = 1024) runs ``ops.linear`` once per
    group on that group's rows (the fused ops' fp8 kernels on CUDA); a float o_a, or one whose groups would cut a
    block (tiny test shapes), one einsum over the groups (a stored one dequantized first)."""
    t = o.shape[0]
    x = o.reshape(t, groups, -1)
    rows = o_a.shape[0] // groups
    if isinstance(o_a, BlockFP8) and (groups == 1 or rows % o_a.block[0] == 0):
        parts = [x[:, g] if x.stride(-1) == 1 else x[:, g].contiguous() for g in range(groups)]
        y = torch.cat([ops.linear(p, o_a[g * rows : (g + 1) * rows]) for g, p in enumerate(parts)], dim=1)
    else:
        y = torch.einsum("tgi,gri->tgr", x, dense(o_a, x.dtype).view(groups, -1, x.shape[-1])).reshape(t, -1)
    return ops.linear(y, o_b)


class DSV4Attention:
    """One V4 attention layer's math; weights and collaborators (the decoder ops: every weight product) arrive in
    the constructor."""

    def __init__(self, cfg: DSV4Config, layer_id: int, weights: AttentionWeights, pools: DSV4Pools,
                 backend: DSV4AttentionBackend, ops: TorchOps | FusedOps):
        self.cfg, self.layer_id, self.w, self.pools, self.backend = cfg, layer_id, weights, pools, backend
        self.ops = ops
        self.kind = cfg.attention.layer_types[layer_id]
        self.rope = cfg.rope_main if self.kind == DSV4LayerType.sliding else cfg.rope_compress

    def _compress(self, comp: CompressorWeights, state: CompressorStatePool, name: str, x: torch.Tensor,
                  batch: ForwardBatch) -> None:
        """Feed the step's tokens to one compressor; closed windows' entries (RoPE applied) go to the backend,
        which stores them where this layer's entries live (the pool, or HiSparse's host pool)."""
        spec, eps = self.cfg.attention, self.cfg.rms_norm_eps
        kv, gate = self.ops.linear(x, comp.kv_proj), self.ops.linear(x, comp.gate_proj)  # the step's tokens at once
        if batch.mode == ForwardMode.DECODE:  # the whole batch at once: candidate entries with RoPE (the ops'
            # compress_decode: torch, or one fused kernel), see runtime.model.dsv4.compressor.compress_decode
            ent = self.ops.compress_decode(kv, gate, comp.position_bias, comp.kv_norm, eps, state, self.layer_id,
                                           batch.req_pool_indices, batch.positions, self.rope, spec.rope_dim)
            self.backend.store_decode_entries(self.layer_id, name, batch, ent)
            return
        qo, prefix = batch.qo_indptr_cpu.tolist(), batch.prefix_lens_cpu.tolist()
        for b, row in enumerate(batch.req_pool_indices_cpu.tolist()):
            s, e = qo[b], qo[b + 1]
            first, ent = compress_step(kv[s:e], gate[s:e], comp.position_bias, comp.kv_norm, eps, state,
                                       self.layer_id, row, prefix[b])
            if ent.shape[0]:
                pos = (first + torch.arange(ent.shape[0], device=x.device)) * state.rate
                cos, sin = cos_sin(self.rope, spec.rope_dim, pos, ent.dtype)
                self.backend.store_entries(self.layer_id, name, row, first, apply_rope_tail(ent, cos, sin))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] (normalized layer input) -> [T, hidden]."""
        cfg, spec, w, eps, linear = self.cfg, self.cfg.attention, self.w, self.cfg.rms_norm_eps, self.ops.linear
        t, norm = x.shape[0], self.ops.v4_rms_norm

        def rope(y: torch.Tensor, inverse: bool = False) -> torch.Tensor:  # the ops' rope_tail: one fused launch
            return self.ops.rope_tail(y, batch.positions, self.rope, spec.rope_dim, inverse)

        q_res = norm(linear(x, w.q_a_proj), w.q_a_norm, eps)
        q = norm(linear(q_res, w.q_b_proj).view(t, spec.num_heads, spec.head_dim), None, eps)
        q = rope(q)
        kv = rope(norm(linear(x, w.kv_proj), w.kv_norm, eps))
        topk = None
        if self.kind == DSV4LayerType.hca:
            self._compress(w.compressor, self.pools.hca_state, "kv", x, batch)
        elif self.kind == DSV4LayerType.csa:
            self._compress(w.compressor, self.pools.csa_state, "kv", x, batch)
            self._compress(w.indexer, self.pools.csa_index_state, "index", x, batch)
            hi, di = spec.index_n_heads, spec.index_head_dim
            index_q = rope(linear(q_res, w.indexer.q_b_proj).view(t, hi, di))
            index_w = linear(x, w.indexer.weights_proj) * (hi**-0.5 * di**-0.5)
            topk = self.backend.select_topk(index_q, index_w, self.layer_id, batch)
        attend = self.backend.forward_decode if batch.mode == ForwardMode.DECODE else self.backend.forward_extend
        o = attend(q, kv, w.sinks, topk, self.layer_id, batch)
        o = rope(o, inverse=True)
        return grouped_output(o, w.o_a_proj, w.o_b_proj, cfg.o_groups, self.ops)


class DSV4DecoderLayer:
    """mHC around attention and MoE. ``forward(streams [T, n, hidden], input_ids [T], batch)``; ``group`` sums the
    attention and MoE outputs over the tensor-parallel ranks; ``ops``: the decoder ops whose ``linear`` multiplies
    every weight matrix (the routed experts excepted); ``grouped_mm``: the routed experts run as two grouped GEMMs
    (see :mod:`runtime.model.dsv4.moe`); the ops' ``hc_mix`` / ``hc_post`` also run mHC around both blocks."""

    def __init__(self, cfg: DSV4Config, layer_id: int, weights: LayerWeights, pools: DSV4Pools,
                 backend: DSV4AttentionBackend, group: SingleRank | TPGroup,
                 ops: TorchOps | FusedOps, grouped_mm: bool = False):
        self.cfg, self.layer_id, self.w, self.group, self.grouped_mm = cfg, layer_id, weights, group, grouped_mm
        self.ops = ops
        self.attention = DSV4Attention(cfg, layer_id, weights.attn, pools, backend, ops)

    def _hc_pre(self, w: HyperConnectionWeights, streams: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mHC before a block: the mixing linear (its norm through ``ops.v4_rms_norm``), then ``ops.hc_mix`` ->
        (post, comb, collapsed)."""
        cfg = self.cfg
        mixed = hc_mixed(w, streams, cfg.rms_norm_eps, lambda x, eps, dt: self.ops.v4_rms_norm(x, None, eps, dt))
        return self.ops.hc_mix(mixed, w.base, w.scale, streams, cfg.hc_sinkhorn_iters, cfg.hc_eps)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        cfg, w, ne = self.cfg, self.w, self.cfg.rms_norm_eps
        post, comb, x = self._hc_pre(w.attn_hc, streams)
        a = self.group.all_reduce(self.attention.forward(self.ops.v4_rms_norm(x, w.input_layernorm, ne), batch))
        streams = self.ops.hc_post(post, comb, a, streams)
        post, comb, x = self._hc_pre(w.ffn_hc, streams)
        h = self.ops.v4_rms_norm(x, w.post_attention_layernorm, ne)
        m = self.group.all_reduce(moe_forward(w.mlp, h, input_ids, cfg, self.ops, self.grouped_mm))
        return self.ops.hc_post(post, comb, m, streams)
