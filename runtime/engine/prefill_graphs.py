"""Graphed prefill: EXTEND steps replayed from CUDA graphs captured per padded token count.

An eager prefill of a few thousand tokens waits on the host: it launches ~37 kernels a layer from Python, and on
16 layers of a TP8 DeepSeek-V3 rank the GPU idles for ~2/3 of a 1024-token step (docs/kernels.md#prefill). A
captured step is one launch. Every graph of this mode has ``slots`` request slots and ``tokens`` rows (one of
``graph.prefill_tokens``); a step of ``t`` tokens over ``n`` requests (``n < slots``) replays the graph of the
smallest count ``tokens >= t``, laid out so (:func:`padded_layout`):

* requests ``0 .. n - 1`` are the step's, rows ``0 .. t - 1`` as the step packs them;
* request ``n`` is the padding: the request table's padding row (all slots 0), its ``tokens - t`` rows all at position
  0 (a count may exceed ``model.max_context``, the RoPE tables' length), written to slot 0 (the padding page) and
  attending causally over its own rows, which all read the padding page: finite values, outputs dropped;
* requests ``n + 1 ..`` are empty (no rows, no keys): the attention's programs for them exit at once.

Capture is the same layout with no request of the step (the padding request holds every row), so the attention
kernel's grid (``slots`` requests x the tiles of ``tokens`` rows) is the one every replay needs. The backend's
:class:`~backends.base.GraphHooks` refresh its static metadata (the page table) before each replay, as for decode;
a backend takes this mode when its capabilities give EXTEND the level ``ALWAYS`` (only ``triton_mla`` today: its
extend kernel reads the lengths on the device and exits the tiles past them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from backends.base import GraphHooks
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.parallel import CollectiveSample, CollectiveStats
from runtime.engine.graph_capture import GraphDecision, capture_copies, replay_copies


def padded_layout(tokens: int, slots: int, padding_row: int, req: torch.Tensor, seq: torch.Tensor,
                  ext: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host side of a graphed prefill step: the step's ``n`` requests (rows ``req`` int64, KV lengths ``seq``
    and new tokens ``ext`` int32, [n] each), then the padding request of ``tokens - sum(ext)`` tokens, then empty
    requests, ``slots`` in all. -> (req [slots] int64, seq [slots] int32, ext [slots] int32, qo_indptr [slots + 1]
    int32)."""
    n, t = int(req.shape[0]), int(ext.sum())
    if n >= slots or t > tokens:
        raise ValueError(f"graphed prefill: {n} requests and {t} tokens do not fit {slots - 1} requests and {tokens} "
                         "tokens (the engine checks can_run first)")
    req_p = torch.full((slots,), padding_row, dtype=torch.int64)
    seq_p = torch.zeros(slots, dtype=torch.int32)
    ext_p = torch.zeros(slots, dtype=torch.int32)
    req_p[:n], seq_p[:n], ext_p[:n] = req, seq, ext
    seq_p[n] = ext_p[n] = tokens - t
    qo = torch.zeros(slots + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(ext_p, 0)
    return req_p, seq_p, ext_p, qo


class PrefillGraphs:
    """Captured prefill steps: ``fn(ids, batch)`` per padded token count (``decision.sizes``).

    Parameters
    ----------
    decision : GraphDecision of the "prefill" mode (its sizes: ``graph.prefill_tokens``)
    fn : callable (ids [tokens] int64, batch) -> hidden states [tokens, hidden]
    hooks : GraphHooks (the attention backend)
    slots : requests per graph (``graph.prefill_requests``): a step of up to ``slots - 1`` requests replays
    padding_row : the request table's padding row
    device : torch.device
    copies : executable graphs per size (2 with the overlap scheduler: replays alternate)
    stats : CollectiveStats of the tensor-parallel group (captured collectives are added to each replayed step)
    """

    mode = ForwardMode.EXTEND

    def __init__(self, decision: GraphDecision, fn: Callable, hooks: GraphHooks, slots: int, padding_row: int,
                 device: torch.device, copies: int = 1, stats: CollectiveStats | None = None):
        if decision.graphed and slots < 2:
            raise ValueError(f"graph.prefill_requests: got {slots}; expected >= 2 (one slot is the padding request). "
                             "Fix: graph.prefill_requests=8")
        self.decision, self.fn, self.hooks, self.slots = decision, fn, hooks, int(slots)
        self.padding_row, self.device, self.copies = padding_row, device, copies
        self.graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardBatch]]] = {}
        self.max_tokens = max(decision.sizes) if decision.graphed else 0
        self.replays = 0
        self._bufs: dict[str, torch.Tensor] = {}
        self.stats = stats if stats is not None else CollectiveStats(device)
        self.collectives: dict[int, CollectiveSample] = {}
        self._prepared = (0, 0)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (self.decision.graphed and batch.mode == self.mode and 0 < batch.num_tokens <= self.max_tokens
                and batch.batch_size < self.slots)

    def _static_batch(self, tokens: int, host: tuple[torch.Tensor, ...]) -> ForwardBatch:
        b = self._bufs
        req, seq, ext, qo = host
        return ForwardBatch(mode=self.mode, req_pool_indices=b["req"], req_pool_indices_cpu=req, seq_lens=b["seq"],
                            seq_lens_cpu=seq, extend_lens_cpu=ext, qo_indptr=b["qo"], qo_indptr_cpu=qo,
                            out_cache_loc=b["loc"][:tokens], positions=b["pos"][:tokens])

    def _capture_host(self, tokens: int) -> tuple[torch.Tensor, ...]:
        none = torch.zeros(0, dtype=torch.int64)
        return padded_layout(tokens, self.slots, self.padding_row, none, none.int(), none.int())

    def init_state(self) -> None:
        """Static inputs for the largest count, and the hooks' static metadata (``slots`` requests)."""
        n, r, dev = self.max_tokens, self.slots, self.device
        self._bufs = {
            "ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "req": torch.full((r,), self.padding_row, dtype=torch.int64, device=dev),
            "seq": torch.zeros(r, dtype=torch.int32, device=dev),
            "qo": torch.zeros(r + 1, dtype=torch.int32, device=dev),
            "loc": torch.zeros(n, dtype=torch.int64, device=dev),
            "pos": torch.zeros(n, dtype=torch.int64, device=dev),  # the padding request's rows: position 0
        }
        self.hooks.init_graph_state(self._static_batch(n, self._capture_host(n)))

    def capture(self, pool) -> object:
        """Capture every count (largest first, so smaller graphs reuse its memory); returns the memory pool."""
        b = self._bufs
        for tokens in sorted(self.decision.sizes, reverse=True):
            host = self._capture_host(tokens)
            _, seq, _, qo = host
            b["seq"].copy_(seq)
            b["qo"].copy_(qo)
            b["req"].fill_(self.padding_row)
            b["loc"].zero_()
            b["pos"].zero_()
            batch = self._static_batch(tokens, host)
            self.hooks.init_forward_metadata_capture(batch)
            self.graphs[tokens], self.collectives[tokens], pool = capture_copies(
                self.fn, b["ids"][:tokens], batch, self.copies, pool, self.stats, self.device)
        return pool

    def prepare(self, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """Copy the step into the static inputs of the smallest captured count >= its tokens, padded as
        :func:`padded_layout` says (device-to-device copies and fills, stream-ordered: no sync), and let the
        backend refresh its static metadata."""
        n, t = batch.batch_size, batch.num_tokens
        tokens = min(s for s in self.graphs if s >= t)
        self._prepared = (tokens, t)
        b, pad = self._bufs, tokens - t
        b["ids"][:t].copy_(input_ids, non_blocking=True)
        b["loc"][:t].copy_(batch.out_cache_loc, non_blocking=True)
        b["pos"][:t].copy_(batch.positions, non_blocking=True)
        if pad:
            b["ids"][t:tokens].zero_()
            b["loc"][t:tokens].zero_()
            b["pos"][t:tokens].zero_()
        b["req"][:n].copy_(batch.req_pool_indices, non_blocking=True)
        b["req"][n:].fill_(self.padding_row)
        b["seq"][:n].copy_(batch.seq_lens, non_blocking=True)
        b["seq"][n:].zero_()
        b["seq"][n : n + 1].fill_(pad)
        b["qo"][: n + 1].copy_(batch.qo_indptr, non_blocking=True)
        b["qo"][n + 1 :].fill_(tokens)
        host = padded_layout(tokens, self.slots, self.padding_row, batch.req_pool_indices_cpu, batch.seq_lens_cpu,
                             batch.extend_lens_cpu)
        self.hooks.init_forward_metadata_replay(self._static_batch(tokens, host))

    def replay(self) -> torch.Tensor:
        """Replay the graph ``prepare`` chose; the rows of the step's tokens (the padding's are dropped)."""
        tokens, t = self._prepared
        out = replay_copies(self.graphs[tokens], self.replays, self.stats, self.collectives[tokens])
        self.replays += 1
        return out[:t]
