"""CUDA graphs, backend-agnostic: which forward modes are graphed is decided from capability data, and each
graphed mode is captured once per padded batch size and replayed with padded batches.

Modes the runner knows (``GRAPH_MODES``): plain ``decode``; and with speculative decoding ``draft_decode``
(all draft decode steps of a round in one graph), ``target_verify`` and ``draft_extend`` (uniform
``num_steps + 1`` tokens per request). A mode is graphed iff ``graph.enabled``, the device is CUDA, and the
*minimum* graph level for its forward mode over every backend in use (target, every draft step, the linear
backend of a hybrid) reaches the level the mode needs. No backend type is looked at: only
``capabilities.graph_level``. The report carries each decision and, when off, why.

The runner owns static input buffers per mode; the backends' :class:`GraphHooks` own static metadata and
refresh it on the host before each replay (nothing is planned or allocated inside a graph). Padding
entries (up to the captured size) use the request table's padding row (never a live request's), positions
``0..t-1`` (``seq_len`` t for t tokens per request), write their KV to slot 0 (the padding page), and their
outputs are dropped.

With the overlap scheduler (``copies=2``) every size is captured twice, over the same static buffers, and
replays alternate between the two executable graphs: the host never relaunches an executable graph whose
previous launch may still be running (a launch of a busy graph exec can hold the host until it finishes).
All replays and the copies into the static buffers are ordered on one stream, so sharing buffers is safe.

Capture never dumps attention (the values at capture time are padding): the runner pauses the dumper, and
the engine runs a step eagerly while the dumper still wants its mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from backends.base import CudaGraphLevel, GraphHooks
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.parallel import CollectiveSample, CollectiveStats
from runtime.engine.graph_capture import GraphDecision, capture_copies, replay_copies
from runtime.engine.prefill_graphs import PrefillGraphs
from runtime.model.dump import AttentionDumper

if TYPE_CHECKING:
    from backends.multi_step_draft import MultiStepDraftBackend
    from runtime.model.mla_model import MLAModel

# name -> (forward mode of its batches, graph level every backend in use must reach)
GRAPH_MODES: dict[str, tuple[ForwardMode, CudaGraphLevel]] = {
    "prefill": (ForwardMode.EXTEND, CudaGraphLevel.ALWAYS),  # any tokens per request: padded token counts
    "decode": (ForwardMode.DECODE, CudaGraphLevel.SINGLE_TOKEN_DECODE),
    "draft_decode": (ForwardMode.DECODE, CudaGraphLevel.SINGLE_TOKEN_DECODE),
    "target_verify": (ForwardMode.TARGET_VERIFY, CudaGraphLevel.UNIFORM_BATCH),
    "draft_extend": (ForwardMode.DRAFT_EXTEND, CudaGraphLevel.UNIFORM_BATCH),
}
PLAIN_MODES = ("prefill", "decode")  # prefill first: its larger graphs are captured first into the shared pool
SPECULATIVE_MODES = ("draft_decode", "target_verify", "draft_extend")


def decide_graphs(enabled: bool, device_type: str, backends_in_use: list, speculative: bool,
                  sizes: list[int], prefill_tokens: list[int] = ()) -> dict[str, GraphDecision]:
    """One decision per mode the engine runs (``SPECULATIVE_MODES`` when speculating, else ``PLAIN_MODES``).

    Parameters
    ----------
    enabled : graph.enabled
    device_type : "cuda" or "cpu"
    backends_in_use : every attention backend object the engine runs (levels are read from
        ``type(b).capabilities``)
    speculative : speculative.enabled
    sizes : graph.batch_sizes (the decode modes' padded batch sizes)
    prefill_tokens : graph.prefill_tokens (the prefill mode's padded token counts; empty: prefill is not graphed)
    """
    out = {}
    for mode in SPECULATIVE_MODES if speculative else PLAIN_MODES:
        fmode, need = GRAPH_MODES[mode]
        levels = [(type(b).__name__, type(b).capabilities.graph_level(fmode)) for b in backends_in_use]
        lowest = min(level for _, level in levels)
        mode_sizes = prefill_tokens if fmode == ForwardMode.EXTEND else sizes
        if not enabled:
            out[mode] = GraphDecision(mode, False, reason="graph.enabled=false")
        elif device_type != "cuda":
            out[mode] = GraphDecision(mode, False, reason=f"device is {device_type}")
        elif not mode_sizes:  # (validation refuses an empty graph.batch_sizes)
            out[mode] = GraphDecision(mode, False, reason="graph.prefill_tokens=[]")
        elif lowest < need:
            why = ", ".join(f"{name}: {lvl.name}" for name, lvl in dict.fromkeys(levels))
            out[mode] = GraphDecision(mode, False, reason=(
                f"{fmode.value} graph level of the backends in use is {lowest.name} ({why}); needs {need.name}"))
        else:
            out[mode] = GraphDecision(mode, True, sizes=sorted(set(mode_sizes)))
    return out


class ModeGraphs:
    """Captured graphs of one mode: ``fn(ids, batch)`` per padded batch size.

    Parameters
    ----------
    decision : GraphDecision
    forward_mode : ForwardMode of the batches
    fn : callable (ids [bs * t] int64, batch) -> tensor whose first dim is bs * rows_per_request
    hooks : GraphHooks (the attention object ``fn`` runs through)
    tokens_per_request : t (1 for decode modes, num_steps + 1 for verify / draft extend)
    rows_per_request : output rows per request (t for hidden states, 1 for draft_decode's [bs, steps])
    padding_row : the request table's padding row
    device : torch.device
    copies : executable graphs captured per size (2 with the overlap scheduler: replays alternate)
    stats : CollectiveStats
        The tensor-parallel group's statistics: the collectives captured in each size's graph are recorded and
        added to the step of every replay (untimed; see runtime/core/parallel.py).
    """

    def __init__(self, decision: GraphDecision, forward_mode: ForwardMode, fn: Callable, hooks: GraphHooks,
                 tokens_per_request: int, rows_per_request: int, padding_row: int, device: torch.device,
                 copies: int = 1, stats: CollectiveStats | None = None):
        self.decision, self.mode, self.fn, self.hooks = decision, forward_mode, fn, hooks
        self.t, self.rows, self.padding_row, self.device = tokens_per_request, rows_per_request, padding_row, device
        self.copies = copies
        # size -> [(graph, output, batch)] * copies
        self.graphs: dict[int, list[tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardBatch]]] = {}
        self.max_bs = max(decision.sizes) if decision.graphed else 0
        self.replays = 0
        self._bufs: dict[str, torch.Tensor] = {}
        self._extend_cpu = self._qo_cpu = torch.empty(0, dtype=torch.int32)  # set by init_state
        self.stats = stats if stats is not None else CollectiveStats(device)
        self.collectives: dict[int, CollectiveSample] = {}  # size -> the collectives its graph captured

    def can_run(self, batch: ForwardBatch) -> bool:
        return (self.decision.graphed and batch.mode == self.mode and 0 < batch.batch_size <= self.max_bs
                and batch.num_tokens == batch.batch_size * self.t)

    def _static_batch(self, bs: int, host: dict[str, torch.Tensor]) -> ForwardBatch:
        b, t = self._bufs, self.t
        extend_cpu, qo_cpu = self._extend_cpu[:bs], self._qo_cpu[: bs + 1]
        return ForwardBatch(
            mode=self.mode, req_pool_indices=b["req"][:bs], req_pool_indices_cpu=host["req"],
            seq_lens=b["seq"][:bs], seq_lens_cpu=host["seq"], extend_lens_cpu=extend_cpu,
            qo_indptr=b["qo"][: bs + 1], qo_indptr_cpu=qo_cpu,
            out_cache_loc=b["loc"][: bs * t], positions=b["pos"][: bs * t],
        )

    def _padding_host(self, bs: int) -> dict[str, torch.Tensor]:
        return {"req": torch.full((bs,), self.padding_row, dtype=torch.int64),
                "seq": torch.full((bs,), self.t, dtype=torch.int32)}

    def init_state(self) -> None:
        """Static inputs for the largest size, and the hooks' static metadata for this mode."""
        n, t, dev = self.max_bs, self.t, self.device
        self._bufs = {
            "ids": torch.zeros(n * t, dtype=torch.int64, device=dev),
            "req": torch.full((n,), self.padding_row, dtype=torch.int64, device=dev),
            "seq": torch.full((n,), t, dtype=torch.int32, device=dev),
            "qo": torch.arange(0, (n + 1) * t, t, dtype=torch.int32, device=dev),
            "loc": torch.zeros(n * t, dtype=torch.int64, device=dev),
            "pos": torch.arange(t, device=dev).repeat(n),
            "pad_pos": torch.arange(t, device=dev).repeat(n),  # padding entries' positions (never written)
        }
        # host mirrors that are the same every step (never written; sliced per size); pinned on CUDA, so a
        # plan that copies them to the device (FlashInfer) needs no pinned staging copy per step
        pin = dev.type == "cuda"
        self._extend_cpu = torch.full((n,), t, dtype=torch.int32, pin_memory=pin)
        qo = torch.arange(0, (n + 1) * t, t, dtype=torch.int32)
        self._qo_cpu = qo.pin_memory() if pin else qo
        self.hooks.init_graph_state(self._static_batch(n, self._padding_host(n)))

    def capture(self, pool) -> object:
        """Capture every size (largest first, so smaller graphs reuse its memory); returns the memory pool."""
        for bs in sorted(self.decision.sizes, reverse=True):
            batch = self._static_batch(bs, self._padding_host(bs))
            ids = self._bufs["ids"][: bs * self.t]
            self.hooks.init_forward_metadata_capture(batch)
            self.graphs[bs], self.collectives[bs], pool = capture_copies(
                self.fn, ids, batch, self.copies, pool, self.stats, self.device)
        return pool

    def prepare(self, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
        """Copy the step's inputs into the static buffers of the smallest captured size >= the batch and let
        the backend refresh its static metadata (host planning; stream-ordered copies, no sync)."""
        n, t = batch.batch_size, self.t
        bs = min(s for s in self.graphs if s >= n)
        self._prepared = (bs, n)
        b = self._bufs
        b["ids"][: n * t].copy_(input_ids, non_blocking=True)
        b["req"][:n].copy_(batch.req_pool_indices, non_blocking=True)
        b["seq"][:n].copy_(batch.seq_lens, non_blocking=True)
        b["loc"][: n * t].copy_(batch.out_cache_loc, non_blocking=True)
        b["pos"][: n * t].copy_(batch.positions, non_blocking=True)
        if bs > n:
            b["req"][n:bs].fill_(self.padding_row)
            b["seq"][n:bs].fill_(t)
            b["loc"][n * t : bs * t].zero_()
            b["pos"][n * t : bs * t].copy_(b["pad_pos"][: (bs - n) * t])
        host = self._padding_host(bs)
        host["req"][:n], host["seq"][:n] = batch.req_pool_indices_cpu, batch.seq_lens_cpu
        self.hooks.init_forward_metadata_replay(self._static_batch(bs, host))

    def replay(self) -> torch.Tensor:
        """Replay the graph ``prepare`` chose; the output rows of the real (unpadded) requests."""
        bs, n = self._prepared
        out = replay_copies(self.graphs[bs], self.replays, self.stats, self.collectives[bs])
        self.replays += 1
        return out[: n * self.rows]


class GraphRunner:
    """The graphed modes of one engine. ``capture`` sets up every mode's static state first (a backend may
    size one buffer for several modes), then captures them all into one memory pool.

    Parameters
    ----------
    modes : list of ModeGraphs / PrefillGraphs (graphed or not; an ungraphed one never captures)
    device : torch.device
    dumper : AttentionDumper or None (paused while capturing)
    """

    def __init__(self, modes: list[ModeGraphs | PrefillGraphs], device: torch.device,
                 dumper: AttentionDumper | None = None):
        self.modes = {m.decision.mode: m for m in modes}
        self.device, self.dumper = device, dumper
        self._captured = False

    @property
    def decisions(self) -> dict[str, GraphDecision]:
        return {name: m.decision for name, m in self.modes.items()}

    def get(self, mode: str) -> ModeGraphs | PrefillGraphs | None:
        return self.modes.get(mode)

    def capture(self) -> None:
        if self._captured:
            return
        self._captured = True
        graphed = [m for m in self.modes.values() if m.decision.graphed]
        if not graphed:
            return
        for m in graphed:
            m.init_state()
        pool = None
        with AttentionDumper.paused_if(self.dumper):
            for m in graphed:
                pool = m.capture(pool)
        torch.cuda.synchronize(self.device)


# ------------------------------------------------------------------ the modes a run graphs (container glue)

def overlap_enabled(mode: str, device) -> bool:
    """``engine.overlap``: on / off as given; auto is on for CUDA (the host plans ahead of the GPU), off on
    the CPU (there is nothing to overlap with)."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def copies_per_size(overlap: bool) -> int:
    """Executable graphs per captured size: 2 with overlap (replays alternate, see ModeGraphs)."""
    return 2 if overlap else 1


def plain_mode_graphs(decisions: dict, model: MLAModel, hook: GraphHooks | None, padding_row: int,
                      device, copies: int, stats, prefill_requests: int = 8) -> list[ModeGraphs | PrefillGraphs]:
    """Without speculation: the target model's prefill graphs (per padded token count, ``prefill_requests``
    request slots; where decided) and its decode graphs."""
    prefill = [PrefillGraphs(decisions["prefill"], model.forward, hook, prefill_requests, padding_row, device, copies,
                             stats)] if "prefill" in decisions else []
    return [*prefill, ModeGraphs(decisions["decode"], ForwardMode.DECODE, model.forward, hook, 1, 1, padding_row,
                                 device, copies, stats)]


def speculative_mode_graphs(decisions: dict, model: MLAModel, target_hooks: GraphHooks, draft_model: MLAModel,
                            draft_attention: MultiStepDraftBackend,
                            draft_steps: Callable[[torch.Tensor, ForwardBatch], torch.Tensor], num_steps: int,
                            padding_row: int, device, copies: int, stats) -> list[ModeGraphs]:
    """With speculation: the draft's decode steps, the target's verify and the draft's extend, each graphed as
    its decision says (``num_steps + 1`` tokens per request in verify and extend). ``draft_steps``: the draft
    decode steps of a round as one callable, ``(ids [B] int64, batch) -> tokens [B, num_steps] int64`` (the
    speculative driver's ``DraftSteps``; the runner graphs it like any forward, whatever it is)."""
    t = num_steps + 1
    return [
        ModeGraphs(decisions["draft_decode"], ForwardMode.DECODE, draft_steps, draft_attention, 1, 1, padding_row,
                   device, copies, stats),
        ModeGraphs(decisions["target_verify"], ForwardMode.TARGET_VERIFY, model.forward, target_hooks, t, t,
                   padding_row, device, copies, stats),
        ModeGraphs(decisions["draft_extend"], ForwardMode.DRAFT_EXTEND, draft_model.forward, draft_attention, t, t,
                   padding_row, device, copies, stats),
    ]
