"""DeepSeek-V4 attention (``backend=dsv4``): sliding window + compressed entries + sinks, over :class:`DSV4Pools`.

Per layer and step the model has already (1) run the layer's compressors, which wrote every entry whose window
closed in this step into the compressed pools, and (2) computed q [T, H, D] and the new tokens' KV rows kv [T, D]
(normalized, RoPE on the last ``rope_dim`` channels). The backend then, per request:

* window part: the request's cached window rows (positions ``max(0, P - W + 1) .. P - 1``, read from the ring
  before anything is overwritten) and the step's new rows; query ``t`` sees rows ``t - W < p <= t``;
* compressed part: ``hca`` layers: every entry ``e < (t + 1) // rate``; ``csa`` layers: the entries the indexer
  picked (:meth:`DSV4Backend.select_topk`, -1 = none), gathered from the paged pool;
* one joint softmax with a per-head sink (:func:`backends.kernels.dsv4.dsv4_reference.sink_attention`);
* finally the new rows go into the ring.

The plain-torch implementation of attention (float32 or float64 compute, CPU or GPU, a host loop per request) is
the oracle. What each impl runs (class data: :data:`backends.dsv4_flashinfer.DECODE_IMPLS`):

* ``torch``: attention in torch (the oracle); the indexer batched in torch.
* ``triton`` (``auto`` on CUDA): decode through the Triton kernel of :mod:`backends.kernels.dsv4.dsv4_decode` (split
  over the rows at small batches, its partials in the ledger's ``dsv4_decode_splits`` workspace:
  :func:`decode_workspace_spec`), extend
  through the Triton kernel of :mod:`backends.kernels.dsv4.dsv4_extend` (each query token over its own window and
  compressed lists; indices planned once per step in :meth:`DSV4Backend.init_forward_metadata` with tensor ops,
  no loop per request: :mod:`backends.dsv4_extend_plan`), except CSA layers under HiSparse, whose extend reads
  the selection from the host on the torch path; the indexer through the DSA scoring kernel when
  ``index_head_dim`` is a power of two >= 16, else batched torch (:mod:`backends.kernels.dsv4.dsv4_indexer`).
* ``flashinfer``: decode through FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4`` (Blackwell only;
  :mod:`backends.dsv4_flashinfer`, the kernel injected: real or emulated); extend in torch; the indexer batched
  in torch.

The indexer (:meth:`DSV4Backend.select_topk`) has no loop per request with any impl; its semantics are the
per-request reference's (:func:`backends.kernels.dsv4.dsv4_reference.indexer_topk`). The Triton decode and extend
kernels passed on an H100 at V4-Flash shapes; the DSA indexer path passed there in a tiny served model
(tests/test_dsv4_gpu.py, ``index_head_dim`` 16).

CUDA graphs (decode, ``impl=triton``, no HiSparse: validation): the graph hooks keep fixed-width lists in static
buffers, refreshed in place by device ops before each replay (see the graph hooks section below). Captured and
replayed on an H100 (tests/test_dsv4_gpu.py: graphed decode gives the eager tokens); not timed.

HiSparse (``hisparse``, a :class:`runtime.core.sparse.SparseKVCoordinator`, built before this backend): the CSA
entries live in the coordinator's host pool. The compressors' entries go there (:meth:`DSV4Backend.store_entries`);
extend reads each query's selection straight from the host, decode swaps the selection into the coordinator's
device buffer (``swap_in``) and attends over that buffer. The indexer keys, the HCA entries (attended in full:
offloading them would copy every entry every step) and the window ring stay on the device.
"""

from __future__ import annotations

import os
from typing import ClassVar, Protocol, runtime_checkable

import torch

from backends.base import BackendCapabilities, CudaGraphLevel, by_name
from backends.dsv4_extend_plan import ExtendPlan, plan_extend
from backends.dsv4_flashinfer import DECODE_IMPLS, FlashInferDecode, flashinfer_problems, workspace_spec
from backends.dsv4_flashinfer import WORKSPACE as FLASHINFER_WORKSPACE
from backends.kernels.dsv4.dsv4_decode import CPU_SM_COUNT, decode_workspace_bytes, dsv4_decode
from backends.kernels.dsv4.dsv4_extend import dsv4_extend
from backends.kernels.dsv4.dsv4_indexer import indexer_topk_paged, triton_indexer_fits
from backends.kernels.dsv4.dsv4_reference import sink_attention
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.device import DeviceInfo
from runtime.core.dsv4_pools import DSV4Pools
from runtime.core.dsv4_spec import DSV4AttentionSpec, DSV4LayerType
from runtime.core.errors import Problem
from runtime.core.model_spec import TORCH_DTYPES
from runtime.core.sparse import SparseKVCoordinator
from runtime.core.workspace import WorkspaceInputs, WorkspaceSpec


@runtime_checkable
class DSV4AttentionBackend(Protocol):
    """What the V4 model calls per layer (the ``dsv4`` backend here; a Triton or FlashInfer one later)."""

    capabilities: ClassVar[BackendCapabilities]

    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    def select_topk(self, index_q: torch.Tensor, index_weights: torch.Tensor, layer_id: int,
                    batch: ForwardBatch) -> torch.Tensor: ...

    def store_entries(self, layer_id: int, name: str, row: int, first: int, values: torch.Tensor) -> None: ...

    def store_decode_entries(self, layer_id: int, name: str, batch: ForwardBatch, values: torch.Tensor) -> None: ...

    def forward_decode(self, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, topk: torch.Tensor | None,
                       layer_id: int, batch: ForwardBatch) -> torch.Tensor: ...

    def forward_extend(self, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, topk: torch.Tensor | None,
                       layer_id: int, batch: ForwardBatch) -> torch.Tensor: ...


IMPLS = ("auto", *DECODE_IMPLS)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def resolve_impl(impl: str, device) -> str:
    """``auto``: the Triton decode kernel on CUDA, torch on the CPU."""
    impl = str(impl)
    return ("triton" if torch.device(device).type == "cuda" else "torch") if impl == "auto" else impl


DECODE_WORKSPACE = "dsv4_decode_splits"


def decode_workspace_spec(spec: DSV4AttentionSpec, backend_cfg: dict, info: DeviceInfo) -> WorkspaceSpec:
    """The Triton decode's split partials: room for what its automatic split choice uses at any batch on this
    GPU (:func:`backends.kernels.dsv4.dsv4_decode.decode_workspace_bytes`; V4-Flash on an H100: about 13 MB); 0 bytes
    for the other impls."""
    nbytes = 0
    if resolve_impl(backend_cfg["impl"], info.torch_device) == "triton":
        nbytes = decode_workspace_bytes(spec.num_heads, spec.head_dim, info.sm_count or CPU_SM_COUNT)
    return WorkspaceSpec(DECODE_WORKSPACE, nbytes=nbytes)


class DSV4Backend:
    """V4 attention in plain torch over the V4 pools.

    Parameters
    ----------
    pools : DSV4Pools
        Ring, compressed pools and compressor state (the spec rides on it).
    compute_dtype : str
        "float32" or "float64": every product and softmax of the torch path runs in it; outputs are cast back
        to q's dtype.
    impl : str
        "torch", "triton" (decode and extend through the Triton kernels, the indexer through the DSA scoring
        kernel where its head width allows), "flashinfer" or "auto" (triton on CUDA).
    device : torch.device
        Where the pools live (resolves ``auto``).
    hisparse : SparseKVCoordinator or None
        HiSparse on: the CSA entries' host pool and device buffers (the pools then hold no CSA entries).
    flashinfer : FlashInferDecode or None
        impl=flashinfer: the kernel call (real or emulated) and its workspace.
    decode_workspace : torch.Tensor or None
        impl=triton: the split partials' uint8 ledger buffer (:func:`decode_workspace_spec`); None: the kernel's
        launcher allocates them per call when it splits.
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        # The compressors' partial-window state is not rewindable (as in the reference), so speculative verify /
        # draft-extend are not offered until the state pools learn to snapshot and roll back.
        forward_modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE}),
        # decode in CUDA graphs with impl=triton (validation refuses the others, and HiSparse): fixed-width lists
        cuda_graph=((ForwardMode.DECODE, CudaGraphLevel.SINGLE_TOKEN_DECODE),),
        graph_impls=frozenset({"triton"}),
        mha_chunked_prefill=False,
        sparse=False,  # its own top-k over compressed entries, not DSA's SparseDecode (HiSparse: see dsv4_validation)
        builds_own_kv_indices=True,
        page_sizes=None,
        min_compute_capability=None,
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}),
        devices=frozenset({"cpu", "cuda"}),
        workspaces=frozenset({DECODE_WORKSPACE, FLASHINFER_WORKSPACE}),
        model_families=frozenset({"dsv4"}),
    )

    @classmethod
    def workspace_specs(cls, inputs: WorkspaceInputs) -> dict[str, WorkspaceSpec]:
        """The Triton decode's split partials (:func:`decode_workspace_spec`, sized for this rank's heads:
        ``inputs.v4_attention``), and with impl=flashinfer its kernel's workspace (acquired by
        :class:`~backends.dsv4_flashinfer.FlashInferDecode`)."""
        b = inputs.cfg["backend"]
        specs = by_name(decode_workspace_spec(inputs.v4_attention, b, inputs.device))
        return specs | (by_name(workspace_spec(b)) if str(b["impl"]) == "flashinfer" else {})

    @classmethod
    def config_problems(cls, backend_cfg: dict, model_cfg: dict, device) -> list:
        """backend.impl: a known name; triton needs a GPU (or the interpreter), float32 compute (the kernel's
        accumulation) and a model dtype and row width the kernel takes."""
        impl, out = str(backend_cfg.get("impl", "auto")), []
        if impl not in IMPLS:
            return [Problem("backend.impl", repr(impl), f"one of {list(IMPLS)}", "set backend.impl=auto")]
        if resolve_impl(impl, device.torch_device) == "flashinfer":
            return flashinfer_problems(backend_cfg, model_cfg, device, _INTERPRET)
        if resolve_impl(impl, device.torch_device) != "triton":
            return []
        if device.kind != "cuda" and not _INTERPRET:
            out.append(Problem("backend.impl=triton", f"device {device.kind}",
                               "a CUDA device (or TRITON_INTERPRET=1 for the CPU interpreter)", "use backend.impl=auto"))
        if str(backend_cfg["compute_dtype"]) != "float32":
            out.append(Problem("backend.impl=triton", f"compute_dtype={backend_cfg['compute_dtype']}",
                               "compute_dtype=float32 (the kernel accumulates in float32)", "use backend.impl=torch"))
        if str(model_cfg["dtype"]) not in ("float32", "bfloat16", "float16"):
            out.append(Problem("backend.impl=triton", f"model.dtype={model_cfg['dtype']}",
                               "float32, bfloat16 or float16", "use backend.impl=torch"))
        d = (model_cfg.get("v4") or {}).get("head_dim") or 0
        if d < 16 or d & (d - 1):
            out.append(Problem("backend.impl=triton", f"model.v4.head_dim={d}", "a power of two >= 16",
                               "use backend.impl=torch"))
        return out

    def __init__(self, pools: DSV4Pools, compute_dtype: str, impl: str = "torch", device=None,
                 hisparse: SparseKVCoordinator | None = None, flashinfer: FlashInferDecode | None = None,
                 decode_workspace: torch.Tensor | None = None):
        self.pools, self.spec = pools, pools.spec
        self.decode_workspace = decode_workspace
        self.compute_dtype = TORCH_DTYPES[str(compute_dtype)]
        self.impl = resolve_impl(impl, pools.window.device if device is None else device)
        if (self.impl == "flashinfer") != (flashinfer is not None):
            raise ValueError(f"DSV4Backend: impl={self.impl!r} with flashinfer={flashinfer!r}; expected the FlashInfer "
                             "decode exactly when impl=flashinfer. Fix: build it through the container.")
        self.hisparse, self.flashinfer = hisparse, flashinfer
        paths = DECODE_IMPLS[self.impl]
        self.extend_kernel = paths.triton_extend
        self.indexer_impl = "triton" if paths.triton_indexer and triton_indexer_fits(self.spec.index_head_dim) \
            else "torch"
        self._rows: list[int] = []
        self._prefix: list[int] = []
        self._qo: list[int] = [0]
        self._win_idx = self._hca_idx = self._hca_len = None
        self._extend: ExtendPlan | None = None
        self._fixed = False  # a graphed decode step: lists of fixed width (see the graph hooks below)
        self._graph: dict[str, torch.Tensor] = {}

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._rows = batch.req_pool_indices_cpu.tolist()
        self._prefix = batch.prefix_lens_cpu.tolist()
        self._qo = batch.qo_indptr_cpu.tolist()
        self._fixed = False
        if self.hisparse is not None:
            self.hisparse.begin_step(batch)
        if self.impl != "torch" and batch.mode == ForwardMode.DECODE:
            hca = self.pools.hca
            width = 0 if hca is None else max(1, max(((p + 1) // hca.rate for p in self._prefix), default=0))
            self._win_idx, self._hca_idx, self._hca_len = self._decode_lists(batch, width)
        self._extend = plan_extend(batch, self.spec.sliding_window) \
            if self.extend_kernel and batch.mode == ForwardMode.EXTEND else None

    def _decode_lists(self, batch: ForwardBatch, hca_width: int):
        """The kernel's indices for a decode step, shared by every layer, from the batch's device tensors (no host
        value but ``hca_width``): window rows [B, W] (ring row ``r * W + p % W`` of positions ``P - W + 1 .. P``,
        the new token's included), the HCA entries' slots [B, hca_width] (-1 past each request's ``(P + 1) //
        rate`` entries) and those counts [B] int32 (None without HCA layers)."""
        w = self.spec.sliding_window
        rows = batch.req_pool_indices.long()
        pos = batch.positions.long()[:, None] - torch.arange(w - 1, -1, -1, device=rows.device)[None, :]
        win = torch.where(pos >= 0, rows[:, None] * w + pos % w, -1).to(torch.int32)
        hca = self.pools.hca
        if hca is None:
            return win, None, None
        counts = ((batch.positions.long() + 1) // hca.rate).to(torch.int32)
        idx = hca.table[rows, :hca_width]
        keep = torch.arange(hca_width, device=rows.device)[None, :] < counts[:, None]
        return win, torch.where(keep, idx, -1), counts

    # ------------------------------------------------------------------------------------ graph hooks
    # A graphed decode step (impl=triton, no HiSparse: validation) reads fixed-shape lists from static buffers
    # that the replay hook refreshes with device ops: the window rows, every HCA entry a request could have
    # (the table's width, -1 past its count; the kernel visits only its count), and the indexer scores every
    # entry column of the CSA table (its causal bound masks the rest).

    def init_graph_state(self, batch: ForwardBatch) -> None:
        n, dev, w = batch.batch_size, self.pools.window.device, self.spec.sliding_window
        hca = self.pools.hca
        self._graph = {"win": torch.full((n, w), -1, dtype=torch.int32, device=dev)}
        if hca is not None:
            self._graph["hca"] = torch.full((n, hca.max_entries), -1, dtype=torch.int32, device=dev)
            self._graph["hca_len"] = torch.zeros(n, dtype=torch.int32, device=dev)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata_replay(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        n, g = batch.batch_size, self._graph
        self._fixed = True
        hca = self.pools.hca
        win, idx, counts = self._decode_lists(batch, 0 if hca is None else hca.max_entries)
        self._win_idx = g["win"][:n]
        self._win_idx.copy_(win)
        if hca is not None:
            self._hca_idx, self._hca_len = g["hca"][:n], g["hca_len"][:n]
            self._hca_idx.copy_(idx)
            self._hca_len.copy_(counts)

    # ------------------------------------------------------------------------------------------ indexer
    def select_topk(self, index_q: torch.Tensor, index_weights: torch.Tensor, layer_id: int,
                    batch: ForwardBatch) -> torch.Tensor:
        """Lightning-indexer top-k of a CSA layer over the entries already in the pool, the whole batch at once
        (:func:`backends.kernels.dsv4.dsv4_indexer.indexer_topk_paged`: batched torch, or with ``impl=triton`` the DSA
        scoring kernel when the indexer head width allows).

        index_q [T, Hi, Di] (RoPE applied), index_weights [T, Hi] (scales folded in) -> [T, index_topk] int64
        entry ids, -1 padding.
        """
        spec, pool = self.spec, self.pools.csa
        entries = pool.max_entries if self._fixed else pool.entries_for(batch.max_seq_len)
        return indexer_topk_paged(index_q, index_weights, pool.flat(layer_id, "index"), pool.table,
                                  batch.req_pool_indices, batch.qo_indptr, batch.positions, spec.csa_rate,
                                  spec.index_topk, entries, self.indexer_impl, self.compute_dtype)

    # ------------------------------------------------------------------------------ compressed entries
    def store_entries(self, layer_id: int, name: str, row: int, first: int, values: torch.Tensor) -> None:
        """Entries ``first ..`` of ``row`` whose windows closed (``name``: "kv", or the CSA indexer's "index"):
        into the layer's compressed pool, or, for CSA entries under HiSparse, the coordinator's host pool."""
        if self.spec.layer_types[layer_id] == DSV4LayerType.hca:
            self.pools.hca.write(layer_id, name, row, first, values)
        elif name == "kv" and self.hisparse is not None:
            self.hisparse.store_rows(layer_id, row, first, values)
        else:
            self.pools.csa.write(layer_id, name, row, first, values)

    def store_decode_entries(self, layer_id: int, name: str, batch: ForwardBatch, values: torch.Tensor) -> None:
        """A decode step's candidate entries, values [B, dim] (RoPE applied): request ``b``'s candidate for entry
        ``positions[b] // rate``, a real entry only where its window closed with this token. The pools take every
        candidate at once (:meth:`CompressedKVPool.write_candidates`: an open entry's slot is overwritten when it
        closes); HiSparse's host pool takes only the closed ones (known on the host from the prefix lengths)."""
        pool = self.pools.hca if self.spec.layer_types[layer_id] == DSV4LayerType.hca else self.pools.csa
        if name == "kv" and self.hisparse is not None and pool is self.pools.csa:
            for b, (row, p) in enumerate(zip(batch.req_pool_indices_cpu.tolist(), batch.prefix_lens_cpu.tolist())):
                if (p + 1) % pool.rate == 0:
                    self.hisparse.store_rows(layer_id, row, p // pool.rate, values[b : b + 1])
            return
        pool.write_candidates(layer_id, name, batch.req_pool_indices, batch.positions // pool.rate, values)

    def _csa_rows(self, layer_id: int, row: int, picked: torch.Tensor, locs: torch.Tensor | None) -> torch.Tensor:
        """The selected CSA entries of one request, [n, K, D] (padding rows arbitrary: masked by the caller):
        from the pool; under HiSparse from the device buffer (decode: ``locs`` from swap_in) or the host
        (extend)."""
        if self.hisparse is None:
            pool = self.pools.csa
            return pool.flat(layer_id, "kv")[pool.table[row].long()[picked.clamp_min(0)]]
        if locs is None:
            return self.hisparse.read_rows(layer_id, row, picked)
        return self.hisparse.device_rows(layer_id)[locs.clamp_min(0).long()]

    def _swap_in(self, topk, layer_id, batch) -> torch.Tensor | None:
        """HiSparse decode of a CSA layer: the selection's rows in the device buffer, [B, K] int32 (-1 padding)."""
        if self.hisparse is None or self.spec.layer_types[layer_id] != DSV4LayerType.csa:
            return None
        return self.hisparse.swap_in(batch, topk.to(torch.int32), layer_id)

    # ---------------------------------------------------------------------------------------- attention
    def _attend(self, q, kv, sinks, topk, layer_id, batch, locs=None) -> torch.Tensor:
        cd, spec, ring = self.compute_dtype, self.spec, self.pools.window
        kind = spec.layer_types[layer_id]
        w = spec.sliding_window
        out = torch.empty_like(q)
        for b, row in enumerate(self._rows):
            s, e, p = self._qo[b], self._qo[b + 1], self._prefix[b]
            pos = batch.positions[s:e]
            start = max(0, p - w + 1)
            rows = torch.cat([ring.read(layer_id, row, start, p).to(cd), kv[s:e].to(cd)])
            kpos = torch.arange(start, p + e - s, device=q.device)
            visible = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - w)
            parts = [(rows, visible)]
            if kind == DSV4LayerType.hca:
                pool = self.pools.hca
                count = pool.entries_for(p + e - s)
                entries = pool.gather(layer_id, "kv", row, count).to(cd)
                ent = torch.arange(count, device=q.device)
                parts.append((entries, ent[None, :] < ((pos + 1) // pool.rate)[:, None]))
            elif kind == DSV4LayerType.csa:
                picked = topk[s:e]
                entries = self._csa_rows(layer_id, row, picked, None if locs is None else locs[s:e]).to(cd)
                parts.append((entries, picked >= 0))
            out[s:e] = sink_attention(q[s:e].to(cd), parts, sinks.to(cd), spec.sm_scale).to(out.dtype)
            ring.write(layer_id, row, p, kv[s:e])
        return out

    def forward_decode(self, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, topk: torch.Tensor | None,
                       layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """q [B, H, D], kv [B, D] (the new tokens' rows), sinks [H], topk [B, K] (CSA layers; else None)
        -> [B, H, D] in q's dtype; stores kv in the window ring."""
        locs = self._swap_in(topk, layer_id, batch)
        if self.impl == "torch":
            return self._attend(q, kv, sinks, topk, layer_id, batch, locs)
        spec, ring = self.spec, self.pools.window.ring(layer_id)
        w = spec.sliding_window
        rows = batch.req_pool_indices.long()
        # the new row first: its ring slot held position P - W, which the query at P no longer sees
        ring[rows, batch.positions % w] = kv.to(ring.dtype)
        kind = spec.layer_types[layer_id]
        d = spec.head_dim
        cmp_len = None
        if kind == DSV4LayerType.hca:
            pool = self.pools.hca
            cmp_pages, cmp_idx = pool.flat(layer_id, "kv").view(-1, pool.page_size, d), self._hca_idx
            cmp_len = self._hca_len
        elif kind == DSV4LayerType.csa and locs is not None:
            cmp_pages, cmp_idx = self.hisparse.device_rows(layer_id).view(ring.shape[0], -1, d), locs
        elif kind == DSV4LayerType.csa:
            pool = self.pools.csa
            slots = pool.table[rows[:, None], topk.clamp_min(0)]
            cmp_pages = pool.flat(layer_id, "kv").view(-1, pool.page_size, d)
            cmp_idx = torch.where(topk >= 0, slots, -1).to(torch.int32)
        else:
            cmp_pages, cmp_idx = ring, self._win_idx[:, :0]
        if self.impl == "flashinfer":
            return self.flashinfer.decode(q, ring, self._win_idx, cmp_pages, cmp_idx, sinks, spec.sm_scale,
                                          batch.positions)
        return dsv4_decode(q.contiguous(), ring.view(-1, d), self._win_idx, cmp_pages.view(-1, d),
                           cmp_idx.contiguous(), sinks.to(q.dtype), spec.sm_scale, workspace=self.decode_workspace,
                           cmp_len=cmp_len)

    def forward_extend(self, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, topk: torch.Tensor | None,
                       layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """q [T, H, D], kv [T, D], sinks [H], topk [T, K] or None -> [T, H, D]; causal over each request's window
        (cached prefix rows + new rows) and its compressed entries; stores the new rows' latest W in the ring.

        ``impl=triton``: the Triton extend kernel over the step's planned lists (:mod:`backends.dsv4_extend_plan`),
        then the ring writes; CSA layers under HiSparse (their entries are read from the host) and the other
        impls: the torch path."""
        kind = self.spec.layer_types[layer_id]
        if self._extend is None or (self.hisparse is not None and kind == DSV4LayerType.csa):
            return self._attend(q, kv, sinks, topk, layer_id, batch)
        plan, ring = self._extend, self.pools.window.ring(layer_id)
        kv = kv.to(q.dtype).contiguous()
        if kind == DSV4LayerType.hca:
            cmp = plan.hca_part(self.pools.hca, layer_id)
        elif kind == DSV4LayerType.csa:
            cmp = plan.csa_part(self.pools.csa, layer_id, topk)
        else:
            cmp = plan.empty_part(kv)
        out = dsv4_extend(q.contiguous(), (*plan.window_parts(ring, kv), cmp), sinks, self.spec.sm_scale)
        ring.view(-1, ring.shape[-1])[plan.ring_dst] = kv[plan.ring_src].to(ring.dtype)
        return out
