"""What the graphed modes share: the decision of one mode (graphed at which padded sizes, or why not), the
capture of one padded size (the warm-ups outside the capture, then ``copies`` executable graphs over the same static
inputs) and its replay (alternating between those copies with the overlap scheduler). Used by the decode modes
(:class:`runtime.engine.graph_runner.ModeGraphs`) and graphed prefill (:mod:`runtime.engine.prefill_graphs`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runtime.core.batch import ForwardBatch
from runtime.core.parallel import CollectiveSample, CollectiveStats

WARMUPS = 2  # eager runs before a capture (autotuning, lazy module loads, first-use allocations)


@dataclass
class GraphDecision:
    """One mode's decision (:func:`runtime.engine.graph_runner.decide_graphs`): its padded ``sizes`` (batch sizes,
    or token counts for prefill) when ``graphed``, else the ``reason`` the report prints."""

    mode: str
    graphed: bool
    sizes: list[int] = field(default_factory=list)
    reason: str = ""


def capture_copies(fn: Callable, ids: torch.Tensor, batch: ForwardBatch, copies: int, pool, stats: CollectiveStats,
                   device: torch.device) -> tuple[list[tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardBatch]],
                                                  CollectiveSample, object]:
    """Warm ``fn(ids, batch)`` up on a side stream, then capture it ``copies`` times into ``pool``. Returns the
    [(graph, output, batch)] copies, the collectives one replay runs (captured, untimed; every copy captures the
    same) and the memory pool for the next capture."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUPS):
            fn(ids, batch)
    torch.cuda.current_stream(device).wait_stream(stream)
    stats.take()  # the warm-ups' (eager) collectives
    graphs, sample = [], None
    for _ in range(copies):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn(ids, batch)
        pool = graph.pool()
        graphs.append((graph, out, batch))
        sample = stats.take()
    return graphs, sample, pool


def replay_copies(copies: list[tuple[torch.cuda.CUDAGraph, torch.Tensor, ForwardBatch]], replays: int,
                  stats: CollectiveStats, sample: CollectiveSample) -> torch.Tensor:
    """Replay one size's executable graph number ``replays % len(copies)`` (they alternate, see
    :func:`capture_copies`) and add the collectives it captured to the step's (``stats``); its whole output."""
    graph, out, _ = copies[replays % len(copies)]
    graph.replay()
    stats.add(sample)
    return out
