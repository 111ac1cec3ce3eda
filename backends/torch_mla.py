"""The reference backend: plain torch, float32 (float64 on request), CPU and GPU, any page size.

It is the oracle every other backend is compared with, so it favours obviousness over speed: one request
at a time, KV rows gathered through the request -> token table, softmax in the compute dtype.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from backends import mla_math
from backends.base import BackendCapabilities, no_workspaces
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.kv_pool import MLAKVPool, ReqToTokenPool
from runtime.core.model_spec import TORCH_DTYPES, ModelSpec


class TorchMLABackend:
    """Absorbed-MLA decode/extend and the MHA chunked-prefix prefill in plain torch.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
    kv_pool : MLAKVPool
    model : ModelSpec
    compute_dtype : str
        "float32" or "float64": every product and softmax runs in it; outputs are cast back to q's dtype.
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        forward_modes=frozenset(ForwardMode),
        cuda_graph=(),  # host loops per request: never inside a graph
        mha_chunked_prefill=True,
        builds_own_kv_indices=True,
        page_sizes=None,
        min_compute_capability=None,
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}),
        kv_dtypes=frozenset({"auto", "fp8_e4m3"}),
        devices=frozenset({"cpu", "cuda"}),
    )
    workspace_specs = classmethod(no_workspaces)

    @classmethod
    def config_problems(cls, backend_cfg: dict, model_cfg: dict, device) -> list:
        return []  # the schema's enum already restricts compute_dtype

    def __init__(
        self, req_to_token_pool: ReqToTokenPool, kv_pool: MLAKVPool, model: ModelSpec, compute_dtype: str
    ):
        self.req_to_token_pool, self.kv_pool, self.model = req_to_token_pool, kv_pool, model
        self.compute_dtype = TORCH_DTYPES[str(compute_dtype)]
        self._kv_slots: list[torch.Tensor] = []
        self._mha_slices: list[tuple[int, int]] = []
        self._chunk_indptrs: list[list[int]] = []

    # ------------------------------------------------------------------------------ absorbed MLA
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = self.req_to_token_pool.req_to_token
        lens = batch.seq_lens_cpu.tolist()
        rows = table[batch.req_pool_indices, : max(lens, default=0)].long()  # one gather and cast for the batch
        self._kv_slots = [row[:n] for row, n in zip(rows, lens)]

    def _absorbed(self, q_nope, q_pe, layer_id, batch) -> torch.Tensor:
        cd = self.compute_dtype
        out = torch.empty(q_nope.shape[:2] + (self.model.kv_lora_rank,), dtype=q_nope.dtype, device=q_nope.device)
        qo = batch.qo_indptr_cpu.tolist()
        for b, slots in enumerate(self._kv_slots):
            s, e = qo[b], qo[b + 1]
            kv = self.kv_pool.gather(layer_id, slots, cd)  # fp8: dequantized in cd
            o = mla_math.absorbed_attention(
                q_nope[s:e].to(cd), q_pe[s:e].to(cd), kv, self.model.kv_lora_rank, self.model.sm_scale, causal=True
            )
            out[s:e] = o.to(out.dtype)
        return out

    def forward_decode(self, q_nope, q_pe, layer_id, batch):
        return self._absorbed(q_nope, q_pe, layer_id, batch)

    def forward_extend(self, q_nope, q_pe, layer_id, batch):
        return self._absorbed(q_nope, q_pe, layer_id, batch)

    # ------------------------------------------------------------------ MHA chunked-prefix prefill
    def init_mha_chunk_metadata(self, batch: ForwardBatch) -> None:
        qo = batch.qo_indptr_cpu.tolist()
        self._mha_slices = [(qo[b], qo[b + 1]) for b in range(batch.batch_size)]
        self._chunk_indptrs = [c.kv_indptr_cpu.tolist() for c in batch.prefix_chunks]

    def forward_mha_extend(self, q, k, v, layer_id, batch):
        """Causal over the new tokens only: q/k [T, H, D], v [T, H, Dv] -> (out [T, H, Dv], lse [T, H]) in the
        compute dtype."""
        return self._mha(q, k, v, self._mha_slices, causal=True)

    def forward_mha_prefix_chunk(self, q, k, v, chunk, layer_id, batch):
        """Non-causal over prefix chunk ``chunk``: k/v [N_chunk, H, *] packed by ``kv_indptr``."""
        ind = self._chunk_indptrs[chunk]
        return self._mha(q, k, v, [(ind[b], ind[b + 1]) for b in range(len(ind) - 1)], causal=False)

    def _mha(self, q, k, v, kv_slices, causal):
        cd = self.compute_dtype  # out/lse stay in it (at least float32) until the model casts the merged result
        t, h = q.shape[:2]
        out = torch.empty(t, h, v.shape[-1], dtype=cd, device=q.device)
        lse = torch.empty(t, h, dtype=cd, device=q.device)
        for (qs, qe), (ks, ke) in zip(self._mha_slices, kv_slices):
            o, l = mla_math.mha_attention(q[qs:qe].to(cd), k[ks:ke].to(cd), v[ks:ke].to(cd), self.model.sm_scale, causal)
            out[qs:qe], lse[qs:qe] = o, l
        return out, lse

    def merge_states(self, out_a, lse_a, out_b, lse_b):
        return mla_math.merge_states(out_a, lse_a, out_b, lse_b)
