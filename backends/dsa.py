"""DeepSeek sparse attention (DSA, DeepSeek-V3.2): indexer top-k and sparse absorbed MLA, in prefill and decode.

Every query token of a sparse layer, in prefill / chunked prefill (EXTEND) as in DECODE, attends only to the
``index_topk`` tokens the indexer picks from its causal prefix (the cached prefix, the chunk's earlier tokens and
itself; all of them while the prefix is shorter than top-k), as DeepSeek-V3.2 computes it. The indexer keys are
stored per token by :meth:`DSABackend.store_sparse_tokens` before attention runs, so a chunk's tokens see each
other's keys. Then:

* without HiSparse the selected positions map to paged-pool slots through the request table;
* with HiSparse (a :class:`runtime.core.sparse.SparseKVCoordinator`, built by the container before this backend
  and passed to the constructor) a DECODE step has the coordinator swap the selected tokens into its device
  buffer and attends there; an EXTEND step reads each token's selection through the coordinator: ``impl=torch``
  gathers it from the host pool (``read_rows``, as the V4 backend's extend does: the prompt's write-through is
  what is read), ``impl=triton`` from the device pages the coordinator holds for the request until its first
  decode step (the same rows). Indexer keys are stored by host slot.

Full (non-sparse) MLA layers of a mixed model prefill and decode densely (:meth:`DSABackend.forward_extend`).

Speculative decoding (without HiSparse): TARGET_VERIFY (``num_steps + 1`` tokens per request after the cached
prefix) and DRAFT_EXTEND are extends: each token attends its own top-k over its causal prefix, so the target's
verified tokens are those of plain greedy decoding. ``impl=torch`` computes them as EXTEND; ``impl=triton`` with
the decode kernels (the indexer scores each token up to its own position, the sparse decode attends each token's
selection), which take fixed shapes, so verify and draft extend run in CUDA graphs (uniform batches) as decode does.
The draft model has its own DSA backends (one per draft step, over the draft KV pool and its own indexer keys).

``impl``: ``torch`` runs the references of ``backends/kernels`` (float32 math; the CPU path and the parity
oracle); ``triton`` runs the Triton indexer, sparse decode and extend kernels (CUDA, or the CPU interpreter
under ``TRITON_INTERPRET=1``); ``auto`` picks triton on CUDA. Kernels are imported when the backend is built.

Decode runs in CUDA graphs (single-token decode) with ``impl=triton``: the indexer scores a fixed
``max_context`` columns there, swap-in and the kernels take fixed shapes, nothing syncs with the host.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from backends import mla_math
from backends.base import BackendCapabilities, CudaGraphLevel, by_name, max_decode_tokens, max_q_len
from backends.kernels.sparse.sparse_mla_extend import (
    REF_TOKENS_PER_STEP,
    rows_read,
    sparse_attention_rows,
    token_rows,
    topk_locations,
)
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.errors import Problem
from runtime.core.kv_pool import MLAKVPool, ReqToTokenPool
from runtime.core.model_spec import ModelSpec
from runtime.core.sparse import IndexKeyCache, SparseKVCoordinator
from runtime.core.workspace import WorkspaceInputs, WorkspaceSpec

#: speculative modes with the same number of tokens per request (Triton: the decode kernels, graphed)
UNIFORM_MODES = frozenset({ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND})
DECODE_WORKSPACE = "dsa_sparse_decode"
INDEXER_WORKSPACE = "dsa_indexer"
IMPLS = ("auto", "torch", "triton")
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def resolve_impl(impl: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on CUDA, ``torch`` elsewhere; other values as given."""
    impl = str(impl)
    return ("triton" if torch.device(device).type == "cuda" else "torch") if impl == "auto" else impl


def max_step_tokens(kv_cfg: dict, graph_cfg: dict, spec_cfg: dict) -> int:
    """Query tokens of the largest step the decode kernels run: the largest decode batch, times ``num_steps + 1``
    with speculation (verify and draft extend run them with that many tokens per request)."""
    return max_decode_tokens(kv_cfg, graph_cfg) * max_q_len(spec_cfg)


def sparse_decode_workspace_spec(model: ModelSpec, backend_cfg: dict, kv_cfg: dict, graph_cfg: dict,
                                 device: torch.device) -> WorkspaceSpec:
    """Split-K partials of the Triton sparse decode (none for the torch impl)."""
    nbytes = 0
    if resolve_impl(backend_cfg["impl"], device) == "triton":
        from backends.kernels.sparse.sparse_mla_decode import sparse_decode_scratch_bytes

        nbytes = sparse_decode_scratch_bytes(max_decode_tokens(kv_cfg, graph_cfg), model.num_heads,
                                             model.kv_lora_rank, int(backend_cfg["max_splits"]))
    return WorkspaceSpec(DECODE_WORKSPACE, nbytes=nbytes)


def indexer_workspace_spec(model: ModelSpec, backend_cfg: dict, kv_cfg: dict, graph_cfg: dict, spec_cfg: dict,
                           device: torch.device) -> WorkspaceSpec:
    """Score buffer [tokens, max_context] float32 and top-k values/indices of the Triton indexer: the largest
    decode-kernel step's (:func:`max_step_tokens`), and at least ``backend.indexer_prefill_mib`` MiB, since
    prefill scores its tokens in tiles that fit the scratch (one sized for a decode batch of 4 cut a 32k-token
    prompt into 8192 kernel calls)."""
    nbytes = 0
    if resolve_impl(backend_cfg["impl"], device) == "triton":
        from backends.kernels.sparse.indexer import indexer_scratch_bytes

        step = indexer_scratch_bytes(max_step_tokens(kv_cfg, graph_cfg, spec_cfg), model.max_context, model.index_topk)
        nbytes = max(step, int(backend_cfg["indexer_prefill_mib"]) << 20)
    return WorkspaceSpec(INDEXER_WORKSPACE, nbytes=nbytes)


class DSABackend:
    """DeepSeek sparse attention over the paged KV pool, or over a HiSparse coordinator's device buffer.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
    kv_pool : MLAKVPool
        The paged latent KV (prefill reads it; sparse decode too when there is no coordinator).
    index_keys : IndexKeyCache
        Indexer keys of the sparse layers, by device slot (by host slot with a coordinator).
    coordinator : SparseKVCoordinator or None
        HiSparse on: swaps selected tokens into its device buffer; None: everything is in ``kv_pool``.
    model : ModelSpec
    decode_workspace, indexer_workspace : torch.Tensor
        uint8 ledger buffers (:func:`sparse_decode_workspace_spec`, :func:`indexer_workspace_spec`; 0 bytes
        for the torch impl).
    config : dict
        The `backend` config: impl, max_splits.
    device : torch.device
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        # verify / draft extend are extends (each token's own causal top-k), graphed with the decode kernels
        forward_modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                                 ForwardMode.DRAFT_EXTEND}),
        cuda_graph=((ForwardMode.DECODE, CudaGraphLevel.SINGLE_TOKEN_DECODE),
                    (ForwardMode.TARGET_VERIFY, CudaGraphLevel.UNIFORM_BATCH),
                    (ForwardMode.DRAFT_EXTEND, CudaGraphLevel.UNIFORM_BATCH)),
        graph_impls=frozenset({"triton"}),  # the torch impl loops on the host
        mha_chunked_prefill=False,
        sparse=True,
        builds_own_kv_indices=True,
        page_sizes=None,
        min_compute_capability=(8, 0),
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_dtypes=frozenset({"auto", "fp8_e4m3"}),
        devices=frozenset({"cpu", "cuda"}),
        workspaces=frozenset({DECODE_WORKSPACE, INDEXER_WORKSPACE}),
        packages=("triton",),  # backends.kernels imports it (the torch impl runs its reference functions)
    )

    @classmethod
    def workspace_specs(cls, inputs: WorkspaceInputs) -> dict[str, WorkspaceSpec]:
        """The sparse decode's split-K partials and the indexer's scratch (0 bytes each for the torch impl); the
        target and its draft steps share them (their forwards run one after another on one stream)."""
        c, device = inputs.cfg, inputs.device.torch_device
        return by_name(sparse_decode_workspace_spec(inputs.model, c["backend"], c["kv"], c["graph"], device),
                       indexer_workspace_spec(inputs.model, c["backend"], c["kv"], c["graph"], c["speculative"], device))

    @classmethod
    def config_problems(cls, backend_cfg: dict, model_cfg: dict, device) -> list:
        out = []
        impl = str(backend_cfg["impl"])
        if impl not in IMPLS:
            out.append(Problem("backend.impl", repr(impl), f"one of {list(IMPLS)}", "set backend.impl=auto"))
        if backend_cfg["max_splits"] < 1:
            out.append(Problem("backend.max_splits", str(backend_cfg["max_splits"]), ">= 1", "set backend.max_splits=16"))
        if backend_cfg["indexer_prefill_mib"] < 0:
            out.append(Problem("backend.indexer_prefill_mib", str(backend_cfg["indexer_prefill_mib"]), ">= 0 MiB",
                               "set backend.indexer_prefill_mib=256"))
        if not model_cfg.get("index_n_heads") or "sparse" not in [str(k) for k in model_cfg["layer_pattern"]]:
            out.append(Problem(f"backend 'dsa' with model '{model_cfg['name']}'",
                               f"index_n_heads={model_cfg.get('index_n_heads')}, layer_pattern="
                               f"{[str(k) for k in model_cfg['layer_pattern']]}",
                               "a model with an indexer (index_n_heads > 0) and sparse layers",
                               "use model=tiny_dsa (CPU) or model=deepseek_v32, or a dense backend (backend=torch_mla)"))
        if impl == "triton" and device.kind != "cuda" and not _INTERPRET:
            out.append(Problem("backend.impl=triton", f"device {device.kind}",
                               "a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)",
                               "use backend.impl=auto (torch on the CPU)"))
        if impl in IMPLS and resolve_impl(impl, device.torch_device) == "triton":
            for key in ("kv_lora_rank", "qk_rope_head_dim", "index_head_dim"):
                v = model_cfg.get(key, 0)
                if v < 16 or v & (v - 1):
                    out.append(Problem(f"model.{key} with backend dsa (triton)", str(v), "a power of two >= 16",
                                       "use DeepSeek dims (512 / 64 / 128), or backend.impl=torch"))
        return out

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: MLAKVPool,
        index_keys: IndexKeyCache,
        coordinator: SparseKVCoordinator | None,
        model: ModelSpec,
        decode_workspace: torch.Tensor,
        indexer_workspace: torch.Tensor,
        config: dict,
        device: torch.device,
    ):
        self.req_to_token_pool, self.kv_pool, self.index_keys = req_to_token_pool, kv_pool, index_keys
        self.coordinator, self.model = coordinator, model
        self.decode_workspace, self.indexer_workspace = decode_workspace, indexer_workspace
        self.impl = resolve_impl(config["impl"], device)
        self.top_k = model.index_topk
        self.page_size = kv_pool.page_size
        # dense decode is only for full (non-sparse) MLA layers of a mixed model
        self.dense_decode = bool(set(model.kv_cache_layers) - set(model.sparse_layers))
        if self.impl == "triton":
            from backends.kernels.mla_extend.mla_extend import mla_extend
            from backends.kernels.sparse.indexer import indexer_topk
            from backends.kernels.sparse.indexer_extend import indexer_topk_extend
            from backends.kernels.sparse.sparse_mla_decode import sparse_mla_decode
            from backends.kernels.sparse.sparse_mla_extend import sparse_mla_extend

            self._indexer, self._sparse, self._extend = indexer_topk, sparse_mla_decode, mla_extend
            self._indexer_extend, self._sparse_extend = indexer_topk_extend, sparse_mla_extend
        else:
            from backends.kernels.sparse.indexer import indexer_topk_reference
            from backends.kernels.sparse.sparse_mla_decode import sparse_mla_decode_reference
            from backends.kernels.sparse.sparse_mla_extend import sparse_mla_extend_reference

            self._indexer, self._sparse, self._extend = indexer_topk_reference, sparse_mla_decode_reference, None
            self._indexer_extend, self._sparse_extend = indexer_topk_reference, sparse_mla_extend_reference
        self.max_len = req_to_token_pool.max_context  # columns the Triton indexer scores (set per step)
        self.page_table = torch.empty(0, 0, dtype=torch.int32)
        self._graph_page_table = torch.empty(0, 0, dtype=torch.int32)
        self._kv_slots: list[torch.Tensor] = []
        self._token_rows = torch.empty(0, dtype=torch.int64)
        self.prefill_rows = {"tokens": 0, "sparse": 0, "dense": 0}  # key rows per sparse layer (the report)

    # ------------------------------------------------------------------------------- planning
    def _uniform(self, batch: ForwardBatch) -> bool:
        """A speculative verify / draft extend on the Triton kernels without HiSparse: k + 1 tokens per request,
        attended by the decode kernels (:meth:`_attend_selected`)."""
        return self.impl == "triton" and batch.mode in UNIFORM_MODES and self.coordinator is None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """HiSparse bookkeeping, the indexer's column count, each extend token's request row (EXTEND, and the
        speculative TARGET_VERIFY / DRAFT_EXTEND, which are extends: k + 1 tokens after the cached prefix), the key
        rows prefill reads (EXTEND only, for the report), and the dense path's KV indices (full layers of a mixed
        model)."""
        if self.coordinator is not None:
            self.coordinator.begin_step(batch)
        self.max_len = max(1, batch.max_seq_len)
        if batch.mode != ForwardMode.DECODE and not self._uniform(batch):  # (a uniform batch: its request rows)
            self._token_rows = token_rows(batch.req_pool_indices, batch.qo_indptr, batch.num_tokens)
        if batch.mode == ForwardMode.EXTEND:
            for p, n in zip(batch.prefix_lens_cpu.tolist(), batch.extend_lens_cpu.tolist()):
                sparse, dense = rows_read(p, n, self.top_k)
                self.prefill_rows["tokens"] += n
                self.prefill_rows["sparse"] += sparse
                self.prefill_rows["dense"] += dense
        if self.dense_decode:  # the full layers of a mixed model attend densely (sparse layers need no table)
            if self.impl == "triton":
                self.page_table = self._gather_page_table(batch, -(-batch.max_seq_len // self.page_size))
            else:
                table = self.req_to_token_pool.req_to_token
                rows, lens = batch.req_pool_indices_cpu.tolist(), batch.seq_lens_cpu.tolist()
                self._kv_slots = [table[r, :n].long() for r, n in zip(rows, lens)]

    def _gather_page_table(self, batch: ForwardBatch, width: int) -> torch.Tensor:
        """[B, width] int32 page ids, gathered on the device from the request table."""
        table = self.req_to_token_pool.req_to_token
        cols = torch.arange(0, width * self.page_size, self.page_size, device=table.device).clamp_max(table.shape[1] - 1)
        return (table[batch.req_pool_indices[:, None], cols[None, :]] // self.page_size).to(torch.int32)

    # ------------------------------------------------------------------------ decode graphs
    def init_graph_state(self, batch: ForwardBatch) -> None:
        """A static page table (only a mixed model's full layers decode densely)."""
        if self.dense_decode:
            width = -(-self.req_to_token_pool.max_context // self.page_size)
            self._graph_page_table = torch.zeros(batch.batch_size, width, dtype=torch.int32,
                                                 device=self.req_to_token_pool.req_to_token.device)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Graphs score every column of the request table: a fixed shape for any sequence length."""
        self.max_len = self.req_to_token_pool.max_context
        if self.dense_decode:
            self.page_table = self._graph_page_table[: batch.batch_size]

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        if self.coordinator is not None:
            self.coordinator.begin_step(batch)
        if self.dense_decode:
            width = -(-batch.max_seq_len // self.page_size)
            self.page_table = self._graph_page_table[: batch.batch_size]
            self.page_table[:, :width].copy_(self._gather_page_table(batch, width))

    # --------------------------------------------------------------------------- dense MLA
    def _dense(self, q_nope, q_pe, layer_id, batch) -> torch.Tensor:
        t, h = q_nope.shape[:2]
        out = torch.empty(t, h, self.model.kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)
        if self.impl == "triton":
            self._extend(q_nope, q_pe, self.kv_pool.buffer(layer_id), self.page_table, batch.qo_indptr,
                         batch.seq_lens, self.model.sm_scale, out, max_q_len=batch.max_extend_len,
                         kv_scale=self.kv_pool.scale)
            return out
        cd = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
        qo = batch.qo_indptr_cpu.tolist()
        for b, slots in enumerate(self._kv_slots):
            s, e = qo[b], qo[b + 1]
            kv = self.kv_pool.gather(layer_id, slots, cd)
            o = mla_math.absorbed_attention(q_nope[s:e].to(cd), q_pe[s:e].to(cd), kv, self.model.kv_lora_rank,
                                            self.model.sm_scale, causal=True)
            out[s:e] = o.to(out.dtype)
        return out

    def forward_extend(self, q_nope, q_pe, layer_id, batch):
        """Dense extend, for the full (non-sparse) layers of a mixed model (sparse layers:
        :meth:`forward_sparse_extend`)."""
        if not self.dense_decode:
            raise RuntimeError(f"DSABackend.forward_extend (dense) for layer {layer_id}: got a model whose attention "
                               "layers are all sparse; expected a full (non-sparse) MLA layer. Fix: call "
                               "forward_sparse_extend for sparse layers (the model does)")
        return self._dense(q_nope, q_pe, layer_id, batch)

    def forward_decode(self, q_nope, q_pe, layer_id, batch):
        """Dense decode, for the full (non-sparse) layers of a mixed model."""
        return self._dense(q_nope, q_pe, layer_id, batch)

    # ------------------------------------------------------------------------ SparseDecode
    def store_sparse_tokens(self, kv_rows, index_k, layer_id, batch):
        """Indexer keys at the new tokens' slots; with HiSparse, the latent rows to the host (and in DECODE
        into the device buffer) through the coordinator."""
        if self.coordinator is None:
            self.index_keys.write(layer_id, batch.out_cache_loc, index_k)
            return
        host_slots = self.coordinator.new_token_slots(batch)
        self.index_keys.write(layer_id, host_slots, index_k)
        self.coordinator.store_new_tokens(layer_id, batch, kv_rows, host_slots)

    def forward_sparse_decode(self, q_nope, q_pe, index_q, index_weights, layer_id, batch):
        """Top-k positions by the indexer -> device locations (request table, or the coordinator's swap-in)
        -> attention over those rows only."""
        return self._attend_selected(q_nope, q_pe, index_q, index_weights, layer_id, batch, batch.req_pool_indices)

    def _attend_selected(self, q_nope, q_pe, index_q, index_weights, layer_id, batch, req_rows):
        """The decode kernels for any tokens whose positions are their causal limits: the indexer's top-k of each
        token (scores up to its own position), through each token's request-table row ``req_rows`` [T] to device
        locations, the sparse decode over those rows. Fixed shapes, no host sync: decode, and (Triton) verify / draft extend graphs."""
        c = self.coordinator
        table = c.host_table if c is not None else self.req_to_token_pool.req_to_token
        args = (index_q, index_weights, self.index_keys.buffer(layer_id), table, batch.req_pool_indices,
                batch.positions, batch.qo_indptr, self.top_k)
        if self.impl == "triton":
            topk_pos, _ = self._indexer(*args, max_len=self.max_len, scratch=self.indexer_workspace)
        else:
            topk_pos, _ = self._indexer(*args)
        if c is not None:
            locs, rows = c.swap_in(batch, topk_pos, layer_id), c.device_rows(layer_id)
        else:
            slots = self.req_to_token_pool.req_to_token[req_rows[:, None], topk_pos.clamp_min(0).long()]
            locs, rows = torch.where(topk_pos >= 0, slots, -1).to(torch.int32), self.kv_pool.flat(layer_id)
        if self.impl == "triton":
            return self._sparse(q_nope, q_pe, rows, locs, self.model.sm_scale, scratch=self.decode_workspace,
                                kv_scale=self.kv_pool.scale)
        return self._sparse(q_nope, q_pe, rows, locs, self.model.sm_scale, kv_scale=self.kv_pool.scale)

    def forward_sparse_extend(self, q_nope, q_pe, index_q, index_weights, layer_id, batch):
        """Prefill / chunked prefill of a sparse layer (and speculative verify / draft extend): each token's top-k
        over its causal prefix (cached prefix + the step's tokens up to itself), then attention over those rows
        only.

        q_nope [T, H, kv_lora] (absorbed), q_pe [T, H, rope], index_q [T, Hi, Di], index_weights [T, Hi] float32
        -> [T, H, kv_lora] in q's dtype. The torch impl scores every token at once (float32, bounded tiles); the
        Triton impl scores tiles of tokens in the indexer workspace (:mod:`backends.kernels.sparse.indexer_extend`)
        and attends with the sparse kernel (:mod:`backends.kernels.sparse.sparse_mla_extend`).
        """
        c = self.coordinator
        if self._uniform(batch):  # k + 1 tokens per request
            n = q_nope.shape[0] // batch.batch_size
            req_rows = batch.req_pool_indices[:, None].expand(-1, n).reshape(-1)
            return self._attend_selected(q_nope, q_pe, index_q, index_weights, layer_id, batch, req_rows)
        table = c.host_table if c is not None else self.req_to_token_pool.req_to_token
        args = (index_q, index_weights, self.index_keys.buffer(layer_id), table, batch.req_pool_indices,
                batch.positions, batch.qo_indptr, self.top_k)
        sm = self.model.sm_scale
        if self.impl == "triton":
            topk_pos, _ = self._indexer_extend(*args, max_len=self.max_len, scratch=self.indexer_workspace)
            locs = topk_locations(topk_pos, self.req_to_token_pool.req_to_token, self._token_rows)
            return self._sparse_extend(q_nope, q_pe, self.kv_pool.flat(layer_id), locs, sm,
                                       scratch=self.decode_workspace, kv_scale=self.kv_pool.scale)
        topk_pos, _ = self._indexer_extend(*args)
        if c is None:
            locs = topk_locations(topk_pos, self.req_to_token_pool.req_to_token, self._token_rows)
            return self._sparse_extend(q_nope, q_pe, self.kv_pool.flat(layer_id), locs, sm,
                                       kv_scale=self.kv_pool.scale)
        # HiSparse, torch impl: every token's selection read from the host pool through the coordinator
        out = torch.empty_like(q_nope)
        qo = batch.qo_indptr_cpu.tolist()
        for b, row in enumerate(batch.req_pool_indices_cpu.tolist()):
            for s in range(qo[b], qo[b + 1], REF_TOKENS_PER_STEP):
                e = min(s + REF_TOKENS_PER_STEP, qo[b + 1])
                picked = topk_pos[s:e].long()
                rows = c.read_rows(layer_id, row, picked)
                out[s:e] = sparse_attention_rows(q_nope[s:e], q_pe[s:e], rows, picked >= 0, sm).to(out.dtype)
        return out

    def prefill_stats(self) -> dict:
        """Key rows the sparse layers' prefill read so far, per layer: ``tokens`` prefilled, ``sparse`` rows read
        (each token min(top_k, position + 1)), ``dense`` rows a dense prefill of the same steps reads."""
        return dict(self.prefill_rows, top_k=self.top_k)
