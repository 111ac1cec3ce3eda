"""Decode CUDA graphs, backend-agnostic: capture once per padded batch size, replay with padded batches.

Whether decode is graphed is decided from data: ``graph.enabled``, the device, and the backend's
``capabilities.graph_level(DECODE)``; the report carries the decision and, when off, why. The runner owns
static input buffers; the backend's :class:`DecodeGraph` hooks own static metadata and refresh it on the
host before each replay (nothing is planned or allocated inside the graph).

Padding entries (up to the captured size) use the request table's padding row (never a live request's) with
``seq_len`` 1, write their KV to slot 0 (the padding page) and their outputs are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backends.base import AttentionBackend, CudaGraphLevel, DecodeGraph
from runtime.batch import ForwardBatch, ForwardMode
from runtime.model import MLAModel


@dataclass
class GraphDecision:
    mode: str
    graphed: bool
    sizes: list[int] = field(default_factory=list)
    reason: str = ""


def decide_decode_graphs(enabled: bool, device: torch.device, backends_in_use: list[AttentionBackend],
                         hook: DecodeGraph | None, sizes: list[int]) -> GraphDecision:
    """Graph decode iff asked for, on CUDA, and the *minimum* decode graph level over every backend in use
    (full + linear for a hybrid model) allows single-token decode."""
    levels = [(type(b).__name__, type(b).capabilities.graph_level(ForwardMode.DECODE)) for b in backends_in_use]
    lowest = min(level for _, level in levels)
    if not enabled:
        return GraphDecision("decode", False, reason="graph.enabled=false")
    if device.type != "cuda":
        return GraphDecision("decode", False, reason=f"device is {device.type}")
    if lowest < CudaGraphLevel.SINGLE_TOKEN_DECODE or hook is None:
        why = ", ".join(f"{name}: {lvl.name}" for name, lvl in levels)
        return GraphDecision("decode", False, reason=f"decode graph level of the backends in use ({why})")
    return GraphDecision("decode", True, sizes=sorted(set(sizes)))


class DecodeGraphRunner:
    """Captures ``model.forward`` for DECODE batches of each size in ``decision.sizes``.

    Parameters
    ----------
    model : MLAModel
    hook : DecodeGraph or None
        The backend's graph hooks (None when the decision is off).
    decision : GraphDecision
    padding_row : int
        The request-table row padded entries use (``ReqToTokenPool.padding_row``).
    device : torch.device
    """

    def __init__(self, model: MLAModel, hook: DecodeGraph | None, decision: GraphDecision, padding_row: int,
                 device: torch.device):
        self.model, self.hook, self.decision, self.device = model, hook, decision, device
        self.padding_row = padding_row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardBatch]] = {}
        self.max_bs = max(decision.sizes) if decision.graphed else 0
        self.replays = 0

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.decision.graphed and batch.mode == ForwardMode.DECODE and batch.batch_size <= self.max_bs

    def _static_batch(self, bs: int, host: dict[str, torch.Tensor]) -> ForwardBatch:
        b = self._bufs
        return ForwardBatch(
            mode=ForwardMode.DECODE, req_pool_indices=b["req"][:bs], req_pool_indices_cpu=host["req"],
            seq_lens=b["seq"][:bs], seq_lens_cpu=host["seq"], extend_lens_cpu=torch.ones(bs, dtype=torch.int32),
            qo_indptr=b["qo"][: bs + 1], qo_indptr_cpu=torch.arange(bs + 1, dtype=torch.int32),
            out_cache_loc=b["loc"][:bs], positions=b["pos"][:bs],
        )

    def _padding_host(self, bs: int) -> dict[str, torch.Tensor]:
        return {"req": torch.full((bs,), self.padding_row, dtype=torch.int64),
                "seq": torch.ones(bs, dtype=torch.int32)}

    def capture(self) -> None:
        """Capture every size (largest first, so smaller graphs reuse its memory pool)."""
        if not self.decision.graphed or self.graphs:
            return
        n, dev = self.max_bs, self.device
        self._bufs = {
            "ids": torch.zeros(n, dtype=torch.int64, device=dev),
            "req": torch.full((n,), self.padding_row, dtype=torch.int64, device=dev),
            "seq": torch.ones(n, dtype=torch.int32, device=dev),
            "qo": torch.arange(n + 1, dtype=torch.int32, device=dev),
            "loc": torch.zeros(n, dtype=torch.int64, device=dev),
            "pos": torch.zeros(n, dtype=torch.int64, device=dev),
        }
        self.hook.init_graph_state(self._static_batch(n, self._padding_host(n)))
        pool = None
        for bs in sorted(self.decision.sizes, reverse=True):
            batch = self._static_batch(bs, self._padding_host(bs))
            self.hook.init_forward_metadata_capture(batch)
            stream = torch.cuda.Stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up (autotuning, lazy module loads) outside the capture
                    self.model.forward(self._bufs["ids"][:bs], batch)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model.forward(self._bufs["ids"][:bs], batch)
            pool = graph.pool()
            self.graphs[bs] = (graph, out, batch)
        torch.cuda.synchronize(dev)

    def prepare(self, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """Copy the step's inputs into the static buffers of the smallest captured size >= the batch and let
        the backend refresh its static metadata (host planning; stream-ordered copies, no sync)."""
        n = batch.batch_size
        bs = min(s for s in self.graphs if s >= n)
        self._prepared = (bs, n)
        b = self._bufs
        b["ids"][:n].copy_(input_ids, non_blocking=True)
        b["req"][:n].copy_(batch.req_pool_indices, non_blocking=True)
        b["seq"][:n].copy_(batch.seq_lens, non_blocking=True)
        b["loc"][:n].copy_(batch.out_cache_loc, non_blocking=True)
        b["pos"][:n].copy_(batch.positions, non_blocking=True)
        if bs > n:
            b["req"][n:bs].fill_(self.padding_row)
            b["seq"][n:bs].fill_(1)
            b["loc"][n:bs].zero_()
            b["pos"][n:bs].zero_()
        host = self._padding_host(bs)
        host["req"][:n], host["seq"][:n] = batch.req_pool_indices_cpu, batch.seq_lens_cpu
        self.hook.init_forward_metadata_replay(self._static_batch(bs, host))

    def replay(self) -> torch.Tensor:
        """Replay the graph ``prepare`` chose; hidden [B, hidden] for the real (unpadded) requests."""
        bs, n = self._prepared
        graph, out, _ = self.graphs[bs]
        graph.replay()
        self.replays += 1
        return out[:n]
