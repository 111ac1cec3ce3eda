"""An MLA model with seeded random weights: embedding, MLA attention layers, final norm, LM head.

Per layer: q projection (optional q-LoRA), kv_a projection to the latent (kv_lora_rank) plus the rope key,
RMSNorm on the latent, RoPE on the rope dims, kv_b (latent -> per-head k_nope and v), o projection.
Decode takes the absorbed path (W_UK folded into q; W_UV applied to the latent output). Prefill takes the
MHA chunked-prefix path when a :class:`MHAChunkPrefill` hook is injected, the absorbed path otherwise.

Initialisation: normal weights scaled by 1/sqrt(fan_in); the output projections that write into the
residual stream are scaled by a further 1/sqrt(2 * num_layers) (the GPT-2 / Megatron residual init), so the
stream stays O(1) through depth and the first layers already say much of what the whole stack says, as in a
trained model: a draft made of the first layers (speculative decoding) is accepted at a meaningful rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.base import AttentionBackend, MHAChunkPrefill, SparseDecode
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.config import LayerKind
from runtime.core.kv_pool import MLAKVPool
from runtime.core.model_spec import ModelSpec
from runtime.model.dump import AttentionDumper
from runtime.model.indexer import IndexerWeights, indexer_projections, make_indexer_weights
from runtime.model.layers import apply_rope, rms_norm


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [D]
    wq_a: torch.Tensor | None  # [D, q_lora] when q-LoRA
    q_a_norm: torch.Tensor | None  # [q_lora]
    wq: torch.Tensor  # [q_in, H * qk_head]   (q_in = q_lora or D)
    wkv_a: torch.Tensor  # [D, kv_lora + rope]
    kv_a_norm: torch.Tensor  # [kv_lora]
    w_uk: torch.Tensor  # [H, qk_nope, kv_lora]   (kv_b's key half)
    w_uv: torch.Tensor  # [H, kv_lora, v_head]    (kv_b's value half)
    wo: torch.Tensor  # [H * v_head, D]
    indexer: IndexerWeights | None = None  # sparse layers (DeepSeek-V3.2): picks the tokens decode attends to

    @property
    def tensors(self) -> list[torch.Tensor]:
        own = [t for t in vars(self).values() if isinstance(t, torch.Tensor)]
        return own + (self.indexer.tensors if self.indexer is not None else [])


@dataclass
class LinearLayerWeights:
    """A lightning-style linear-attention layer: SiLU(q), SiLU(k), v, per-head recurrent state, out norm."""

    attn_norm: torch.Tensor  # [D]
    wq: torch.Tensor  # [D, Hl * dk]
    wk: torch.Tensor  # [D, Hl * dk]
    wv: torch.Tensor  # [D, Hl * dv]
    out_norm: torch.Tensor  # [Hl * dv]
    wo: torch.Tensor  # [Hl * dv, D]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(vars(self).values())


class MLAModel:
    """Seeded random MLA stack over an injected backend.

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
    weights_from : MLAModel or None
        Share this model's embedding, final norm, LM head and first ``spec.num_layers`` layers (by
        reference) instead of seeding new weights: the speculative draft model.
    """

    def __init__(
        self,
        spec: ModelSpec,
        device: torch.device,
        kv_pool: MLAKVPool,
        backend: AttentionBackend,
        mha_prefill: MHAChunkPrefill | None,
        dumper: AttentionDumper | None,
        sparse: SparseDecode | None = None,
        weights_from: MLAModel | None = None,
    ):
        self.spec, self.device, self.kv_pool = spec, device, kv_pool
        self.backend, self.mha_prefill, self.dumper = backend, mha_prefill, dumper
        self.sparse = sparse
        self.shares_weights = weights_from is not None
        self.dump_layer = spec.full_layers[0] if spec.full_layers and dumper is not None else -1
        if weights_from is None:
            self._init_weights()
        else:
            self._share_weights(weights_from)
        inv = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.qk_rope_head_dim, 2, dtype=torch.float64) / spec.qk_rope_head_dim))
        freqs = torch.outer(torch.arange(spec.max_context, dtype=torch.float64), inv)
        self.rope_cos = freqs.cos().float().to(device)
        self.rope_sin = freqs.sin().float().to(device)

    # -------------------------------------------------------------------------------------- weights
    def _init_weights(self) -> None:
        s, gen = self.spec, torch.Generator().manual_seed(self.spec.weight_seed)

        def w(*shape: int, fan_in: int, residual: bool = False) -> torch.Tensor:
            scale = fan_in * (2 * s.num_layers if residual else 1)
            t = torch.randn(*shape, generator=gen, dtype=torch.float32) / scale**0.5
            return t.to(device=self.device, dtype=s.dtype)

        def ones(n: int) -> torch.Tensor:
            return torch.ones(n, device=self.device, dtype=s.dtype)

        h, d = s.num_heads, s.hidden_size
        hl, dl = s.linear_num_heads, s.linear_head_dim
        self.embed = w(s.vocab_size, d, fan_in=1)
        self.layers: list[LayerWeights | LinearLayerWeights] = []
        for kind in s.layer_kinds:
            if kind == LayerKind.linear:
                self.layers.append(LinearLayerWeights(
                    attn_norm=ones(d), wq=w(d, hl * dl, fan_in=d), wk=w(d, hl * dl, fan_in=d),
                    wv=w(d, hl * dl, fan_in=d), out_norm=ones(hl * dl), wo=w(hl * dl, d, fan_in=hl * dl, residual=True)))
                continue
            q_in = s.q_lora_rank or d
            wkv_b = w(s.kv_lora_rank, h, s.qk_nope_head_dim + s.v_head_dim, fan_in=s.kv_lora_rank)
            self.layers.append(
                LayerWeights(
                    attn_norm=ones(d),
                    wq_a=w(d, s.q_lora_rank, fan_in=d) if s.q_lora_rank else None,
                    q_a_norm=ones(s.q_lora_rank) if s.q_lora_rank else None,
                    wq=w(q_in, h * s.qk_head_dim, fan_in=q_in),
                    wkv_a=w(d, s.kv_row_dim, fan_in=d),
                    kv_a_norm=ones(s.kv_lora_rank),
                    w_uk=wkv_b[:, :, : s.qk_nope_head_dim].permute(1, 2, 0).contiguous(),
                    w_uv=wkv_b[:, :, s.qk_nope_head_dim :].permute(1, 0, 2).contiguous(),
                    wo=w(h * s.v_head_dim, d, fan_in=h * s.v_head_dim, residual=True),
                    indexer=make_indexer_weights(s, w, ones) if kind == LayerKind.sparse else None,
                )
            )
        self.final_norm = ones(d)
        self.lm_head = w(d, s.vocab_size, fan_in=d)

    def _share_weights(self, other: MLAModel) -> None:
        n = self.spec.num_layers
        if other.spec.layer_kinds[:n] != self.spec.layer_kinds or other.spec.hidden_size != self.spec.hidden_size:
            raise ValueError(
                f"draft model '{self.spec.name}': its {n} layers ({[k.value for k in self.spec.layer_kinds]}) must "
                f"be the first layers of '{other.spec.name}' ({[k.value for k in other.spec.layer_kinds[:n]]}). "
                "Fix: derive the draft spec with ModelSpec.draft(n).")
        self.embed, self.final_norm, self.lm_head = other.embed, other.final_norm, other.lm_head
        self.layers = other.layers[:n]

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this model owns (0 for a draft that shares the target's)."""
        if self.shares_weights:
            return 0
        tensors = [self.embed, self.final_norm, self.lm_head]
        for lw in self.layers:  # LayerWeights or LinearLayerWeights
            tensors += lw.tensors
        return sum(t.numel() * t.element_size() for t in tensors)

    # -------------------------------------------------------------------------------------- forward
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [T] int64 -> final-normed hidden states [T, hidden] in the model dtype."""
        x = self.embed[input_ids]
        cos, sin = self.rope_cos[batch.positions], self.rope_sin[batch.positions]
        use_mha = batch.mode == ForwardMode.EXTEND and self.mha_prefill is not None
        for layer_id, (kind, lw) in enumerate(zip(self.spec.layer_kinds, self.layers)):
            if kind == LayerKind.linear:
                x = x + self._linear_attention(layer_id, lw, x, batch)
            else:
                x = x + self._attention(layer_id, lw, x, cos, sin, batch, use_mha)
        return rms_norm(x, self.final_norm, self.spec.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        return (hidden @ self.lm_head).float()

    def _attention(self, layer_id, lw: LayerWeights, x, cos, sin, batch: ForwardBatch, use_mha: bool):
        s = self.spec
        t, h = x.shape[0], s.num_heads
        xn = rms_norm(x, lw.attn_norm, s.rms_norm_eps)
        q_in = rms_norm(xn @ lw.wq_a, lw.q_a_norm, s.rms_norm_eps) if lw.wq_a is not None else xn
        q = (q_in @ lw.wq).view(t, h, s.qk_head_dim)
        q_nope, q_pe = q[..., : s.qk_nope_head_dim], apply_rope(q[..., s.qk_nope_head_dim :], cos, sin)
        kv = xn @ lw.wkv_a
        ckv = rms_norm(kv[:, : s.kv_lora_rank], lw.kv_a_norm, s.rms_norm_eps)
        kpe = apply_rope(kv[:, s.kv_lora_rank :], cos, sin)
        self.kv_pool.write(layer_id, batch.out_cache_loc, ckv, kpe)
        index = None
        if lw.indexer is not None:  # sparse layer: the backend keeps its indexer keys (and, with HiSparse, its KV)
            index = indexer_projections(lw.indexer, s, xn, q_in, cos, sin)
            self.sparse.store_sparse_tokens(torch.cat([ckv, kpe], dim=-1), index[1], layer_id, batch)
        sparse_decode = index is not None and batch.mode == ForwardMode.DECODE

        if use_mha:
            o = self._mha_prefill(layer_id, lw, q_nope, q_pe, ckv, kpe, batch)
        else:
            q_abs = torch.einsum("thd,hdc->thc", q_nope, lw.w_uk)
            fwd = self.backend.forward_decode if batch.mode == ForwardMode.DECODE else self.backend.forward_extend
            if sparse_decode:
                o_lat = self.sparse.forward_sparse_decode(q_abs, q_pe, index[0], index[2], layer_id, batch)
            else:
                o_lat = fwd(q_abs, q_pe, layer_id, batch)
            if not sparse_decode and layer_id == self.dump_layer and self.dumper.wants(batch.mode.value):
                self.dumper.save_absorbed(layer_id, batch, self.kv_pool, q_abs, q_pe, o_lat, s.kv_lora_rank, s.sm_scale)
            o = torch.einsum("thc,hcd->thd", o_lat, lw.w_uv)
        return o.reshape(t, h * s.v_head_dim) @ lw.wo

    def _linear_attention(self, layer_id, lw: LinearLayerWeights, x, batch: ForwardBatch):
        s = self.spec
        t, hl, dl = x.shape[0], s.linear_num_heads, s.linear_head_dim
        xn = rms_norm(x, lw.attn_norm, s.rms_norm_eps)
        q = torch.nn.functional.silu(xn @ lw.wq).view(t, hl, dl)
        k = torch.nn.functional.silu(xn @ lw.wk).view(t, hl, dl)
        v = (xn @ lw.wv).view(t, hl, dl)
        o = self.backend.forward_linear(q, k, v, layer_id, batch)
        return rms_norm(o.reshape(t, hl * dl), lw.out_norm, s.rms_norm_eps) @ lw.wo

    def decompress(self, lw: LayerWeights, ckv: torch.Tensor, kpe: torch.Tensor):
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
