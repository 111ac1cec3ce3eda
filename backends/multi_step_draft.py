"""The draft model's attention in speculative decoding: one backend per draft step, planned together.

A speculative round runs ``num_steps - 1`` draft decode steps back to back, with no host work between them
(so they can share one CUDA graph): every step's metadata is planned before the first step runs, which is
why each step has its own backend instance (its own plan / page table). Backend 0 serves the draft
model's extends (the prompt, and DRAFT_EXTEND after each verify).

The shared kv-indices pass (one gather for all steps: their requests and pages are the same, only the
lengths grow) runs only when the container injects it, that is, when some step backend's capabilities say
it does not build its own kv indices (``builds_own_kv_indices``). Backends that build their own would
otherwise pay for a pass whose result they never read.

Sparse step backends (``dsa``, for a DeepSeek-V3.2 target): the draft model's sparse layers reach the active step
backend through this object's :class:`~backends.base.SparseDecode` methods; the container passes it as the draft
model's sparse hook only when the step backends' capabilities say sparse (:func:`draft_sparse_hook`). Each step
backend then keeps its own plan over the draft KV pool and the draft's own indexer keys: the draft attends sparsely,
as the target's first layers do.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from backends.base import AttentionBackend, SparseDecode
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.kv_pool import ReqToTokenPool


class SharedKVIndicesPass:
    """Page ids of every draft step's requests, gathered once: [B, W] int32 (W = pages of the last step's
    longest request), handed to every step batch as ``batch.kv_page_table``.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
    page_size : int
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, page_size: int):
        self.req_to_token_pool, self.page_size = req_to_token_pool, page_size
        table = req_to_token_pool.req_to_token
        self._cols = torch.arange(0, req_to_token_pool.max_context, page_size, device=table.device)
        self.runs = 0

    def run(self, steps: list[ForwardBatch], out: torch.Tensor | None = None) -> None:
        """Fill ``kv_page_table`` of every step batch. ``out``: a static [B_max, W_max] int32 buffer (graphs);
        the table is then written into its first rows and columns."""
        last = steps[-1]
        width = -(-last.max_seq_len // self.page_size)
        table = self.req_to_token_pool.req_to_token
        pages = (table[last.req_pool_indices[:, None], self._cols[None, :width]] // self.page_size).to(torch.int32)
        if out is not None:
            out[: pages.shape[0], :width].copy_(pages)
            pages = out[: pages.shape[0]]
        for b in steps:
            b.kv_page_table = pages
        self.runs += 1


def step_batch(base: ForwardBatch, j: int, table: torch.Tensor, into: dict[str, torch.Tensor] | None = None) -> ForwardBatch:
    """Draft decode step ``j`` of a round whose first step is ``base`` (DECODE, one token per request):
    positions and lengths advance by ``j``; the new token's slot is read from the request table (the round
    reserved it). ``into``: static buffers (graphs) the device fields are written into instead."""
    if j == 0 and into is None:
        return base
    pos = base.positions + j
    seq = base.seq_lens + j
    loc = table[base.req_pool_indices, pos].long()
    if into is not None:
        n = base.batch_size
        into["pos"][:n].copy_(pos)
        into["seq"][:n].copy_(seq)
        into["loc"][:n].copy_(loc)
        pos, seq, loc = into["pos"][:n], into["seq"][:n], into["loc"][:n]
    return replace(base, positions=pos, seq_lens=seq, seq_lens_cpu=base.seq_lens_cpu + j, out_cache_loc=loc,
                   kv_page_table=None)


class MultiStepDraftBackend:
    """The draft model's attention object: extends go to backend 0, draft decode step ``j`` to backend
    ``j + 1``.

    Parameters
    ----------
    backends : list of AttentionBackend
        ``num_steps`` instances of the configured backend (built by the container, each over the draft KV
        pool): index 0 serves EXTEND / DRAFT_EXTEND, 1.. the ``num_steps - 1`` draft decode steps.
    kv_indices_pass : SharedKVIndicesPass or None
        Run before planning the steps, once per round; None when every step backend builds its own kv
        indices (the container decides from capabilities).
    req_to_token_pool : ReqToTokenPool
    """

    def __init__(self, backends: list[AttentionBackend], kv_indices_pass: SharedKVIndicesPass | None,
                 req_to_token_pool: ReqToTokenPool):
        if not backends:
            raise ValueError("MultiStepDraftBackend needs at least one backend (the draft extend's); got none. "
                             "Fix: speculative.num_steps >= 1.")
        self.extend_backend, self.step_backends = backends[0], list(backends[1:])
        self.kv_indices_pass = kv_indices_pass
        self.req_to_token_pool = req_to_token_pool
        self._active: AttentionBackend = self.extend_backend
        self.step_batches: list[ForwardBatch] = []
        self._static: list[dict[str, torch.Tensor]] = []
        self._static_pages: torch.Tensor | None = None
        self.kv_indices_skipped = 0  # draft-step plans that ran without the shared pass (it was not injected)

    @property
    def num_decode_steps(self) -> int:
        return len(self.step_backends)

    # --------------------------------------------------------------------------- AttentionBackend
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """DECODE: plan every draft step of the round (``batch`` is step 0); other modes: backend 0."""
        if batch.mode != ForwardMode.DECODE:
            self._active = self.extend_backend
            self.extend_backend.init_forward_metadata(batch)
            return
        table = self.req_to_token_pool.req_to_token
        self.step_batches = [step_batch(batch, j, table) for j in range(self.num_decode_steps)]
        self._run_kv_indices(self.step_batches)
        for backend, b in zip(self.step_backends, self.step_batches):
            backend.init_forward_metadata(b)

    def select_step(self, j: int) -> ForwardBatch:
        """Route the next forwards to draft decode step ``j``; returns that step's batch."""
        self._active = self.step_backends[j]
        return self.step_batches[j]

    def forward_decode(self, q_nope, q_pe, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        return self._active.forward_decode(q_nope, q_pe, layer_id, batch)

    def forward_extend(self, q_nope, q_pe, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        return self._active.forward_extend(q_nope, q_pe, layer_id, batch)

    # ---------------------------------------------------------- SparseDecode (sparse step backends only)
    def store_sparse_tokens(self, kv_rows, index_k, layer_id: int, batch: ForwardBatch) -> None:
        self._active.store_sparse_tokens(kv_rows, index_k, layer_id, batch)

    def forward_sparse_decode(self, q_nope, q_pe, index_q, index_weights, layer_id: int,
                              batch: ForwardBatch) -> torch.Tensor:
        return self._active.forward_sparse_decode(q_nope, q_pe, index_q, index_weights, layer_id, batch)

    def forward_sparse_extend(self, q_nope, q_pe, index_q, index_weights, layer_id: int,
                              batch: ForwardBatch) -> torch.Tensor:
        return self._active.forward_sparse_extend(q_nope, q_pe, index_q, index_weights, layer_id, batch)

    def prefill_stats(self) -> dict:
        """The draft's prefill key rows (backend 0 runs every draft extend)."""
        return self.extend_backend.prefill_stats()

    # --------------------------------------------------------------------------------- GraphHooks
    def init_graph_state(self, batch: ForwardBatch) -> None:
        if batch.mode != ForwardMode.DECODE:
            self.extend_backend.init_graph_state(batch)
            return
        n, dev = batch.batch_size, batch.seq_lens.device
        self._static = [{"pos": torch.zeros(n, dtype=torch.int64, device=dev),
                         "seq": torch.ones(n, dtype=torch.int32, device=dev),
                         "loc": torch.zeros(n, dtype=torch.int64, device=dev)} for _ in range(self.num_decode_steps)]
        if self.kv_indices_pass is not None:
            width = -(-self.req_to_token_pool.max_context // self.kv_indices_pass.page_size)
            self._static_pages = torch.zeros(n, width, dtype=torch.int32, device=dev)
        steps = self._static_steps(batch)
        for backend, b in zip(self.step_backends, steps):
            backend.init_graph_state(b)

    def _static_steps(self, batch: ForwardBatch) -> list[ForwardBatch]:
        table = self.req_to_token_pool.req_to_token
        steps = [step_batch(batch, j, table, into=self._static[j]) for j in range(self.num_decode_steps)]
        if steps:
            self._run_kv_indices(steps, out=self._static_pages)
        return steps

    def _run_kv_indices(self, steps: list[ForwardBatch], out: torch.Tensor | None = None) -> None:
        """The shared kv-indices pass when injected; otherwise count the skip (the report shows both)."""
        if self.kv_indices_pass is None:
            self.kv_indices_skipped += 1
        else:
            self.kv_indices_pass.run(steps, out=out)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        if batch.mode != ForwardMode.DECODE:
            self._active = self.extend_backend
            self.extend_backend.init_forward_metadata_capture(batch)
            return
        self.step_batches = self._static_steps(batch)
        for backend, b in zip(self.step_backends, self.step_batches):
            backend.init_forward_metadata_capture(b)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        if batch.mode != ForwardMode.DECODE:
            self._active = self.extend_backend
            self.extend_backend.init_forward_metadata_replay(batch)
            return
        self.step_batches = self._static_steps(batch)
        for backend, b in zip(self.step_backends, self.step_batches):
            backend.init_forward_metadata_replay(b)


def draft_sparse_hook(draft: MultiStepDraftBackend, backends: list[AttentionBackend]) -> SparseDecode | None:
    """The draft model's sparse-layer hook: ``draft`` (routing to the active step backend) when every step backend's
    capabilities say sparse; else None (a dense backend's draft has no sparse layers: validation refuses a sparse
    model on a dense backend)."""
    return draft if backends and all(type(b).capabilities.sparse for b in backends) else None


def shared_kv_indices_pass(draft_backends: list[AttentionBackend], mode: str, req_to_token_pool: ReqToTokenPool,
                           page_size: int) -> SharedKVIndicesPass | None:
    """The multi-step draft's shared kv-indices pass, only when a draft step backend's capabilities say it
    does not build its own kv indices (``shared_kv_indices=always`` forces it, for the benchmark)."""
    steps = draft_backends[1:]
    needed = any(not type(b).capabilities.builds_own_kv_indices for b in steps)
    return SharedKVIndicesPass(req_to_token_pool, page_size) if steps and (needed or mode == "always") else None
