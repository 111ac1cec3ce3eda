"""Tensor parallelism at the end of a run: the ranks' agreement check and the report's ``parallel`` section.

Every rank runs these (they are collectives: each rank calls them in the same order), and only rank 0 writes.

* :func:`disagreements`: the output ids of every rank (and, with HiSparse, each coordinator's decision digest)
  gathered and compared. Every rank schedules on its own from the same inputs (no per-step broadcast), so the
  run is only right if they all produced the same tokens; any difference fails the run, loudly.
* :func:`parallel_section`: tp, moe, world size, the all-reduce mode (asked, and what it runs as); memory per rank
  (gathered); the collectives per step by phase: count, bytes each rank sent into all-reduces and all-gathers (and
  into all-reduces alone; and per op: all_reduce (NCCL / gloo), all_reduce:oneshot, all_reduce:fused (all-reduce +
  residual add + RMSNorm), all_gather (the greedy top 2 or the sampled logits)), time of the eager
  (timed) steps, and for steps
  that replayed a CUDA graph the time of the same collectives run by the probe (runtime/core/parallel.py).
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.app.report import memory_plan
from runtime.core.parallel import CollectiveSample
from runtime.engine.engine import RunResult

PROBE_SIZES = 4  # distinct graphed steps (by their collectives) probed at most, the most frequent first


def disagreements(runtime, res: RunResult) -> list[str]:
    """What differs between the ranks (empty when they agree, and always for one rank)."""
    group = runtime.container.tp_group()
    every = group.gather_objects(sorted(res.outputs.items()))
    out = []
    for rank, other in enumerate(every[1:], 1):
        ref, got = dict(every[0]), dict(other)
        differ = sorted(rid for rid in ref.keys() | got.keys() if ref.get(rid) != got.get(rid))
        if differ:
            rid = differ[0]
            out.append(f"rank {rank} generated different tokens than rank 0 for {len(differ)} request(s), first "
                       f"request {rid}: rank 0 {ref.get(rid)} vs rank {rank} {got.get(rid)}")
    coordinator = runtime.container.hisparse_coordinator()
    hisparse = coordinator.disagreement() if coordinator is not None else None
    return out + ([hisparse] if hisparse else [])


def _rank_memory(runtime) -> dict:
    plan = memory_plan(runtime.container)
    device = runtime.container.device()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"weights_bytes": plan["weights_bytes"], "kv_pool_bytes": plan["kv_pool_bytes"],
            "total_bytes": plan["total_bytes"], "cuda_peak_allocated_bytes": peak}


def phase_collectives(steps: list, probes: dict[tuple, float]) -> dict:
    samples = [s.collectives for s in steps if s.collectives is not None]
    n = len(samples)
    eager = [c.seconds() for c in samples if c.timed]
    graphed = [c for c in samples if not c.timed]
    probe = [probes[c.signature()] for c in graphed if c.signature() in probes]
    reduced = [sum(k * dt.itemsize for op, k, dt in c.ops if op.startswith("all_reduce")) for c in samples]
    by_op: dict[str, list[float]] = {}  # op -> [count per step, bytes per step] (mean over the steps)
    for c in samples:
        for op, k, dt in c.ops:
            row = by_op.setdefault(op, [0.0, 0.0])
            row[0] += 1 / n
            row[1] += k * dt.itemsize / n
    return {
        "steps": n,
        "count_per_step": float(np.mean([c.count for c in samples])) if n else 0.0,
        "bytes_per_step": float(np.mean([c.nbytes for c in samples])) if n else 0.0,
        "all_reduce_bytes_per_step": float(np.mean(reduced)) if n else 0.0,
        "by_op": {op: {"count_per_step": c, "bytes_per_step": b} for op, (c, b) in sorted(by_op.items())},
        "eager_steps": len(eager),
        "ms_per_eager_step": float(np.mean(eager) * 1e3) if eager else None,
        "graphed_steps": len(graphed),
        "probe_ms_per_graphed_step": float(np.mean(probe) * 1e3) if probe else None,
    }


def probe_graphed(group, steps: list) -> dict[tuple, float]:
    """Seconds per graphed step's collectives, by probe, for the most frequent distinct graphed samples (every
    rank has the same samples, so every rank probes the same ones in the same order)."""
    counts: dict[tuple, list[CollectiveSample]] = {}
    for s in steps:
        if s.collectives is not None and not s.collectives.timed and s.collectives.count:
            counts.setdefault(s.collectives.signature(), []).append(s.collectives)
    top = sorted(counts, key=lambda k: (-len(counts[k]), len(k)))[:PROBE_SIZES]
    return {sig: group.probe(counts[sig][0]) for sig in top}


def parallel_section(runtime, res: RunResult) -> dict:
    """The report's ``parallel`` section (see the module docstring); a collective call."""
    cfg, group = runtime.config, runtime.container.tp_group()
    probes = probe_graphed(runtime.container.collectives(), res.steps)  # the one-shot / fused ops through their kernels
    phases = {}
    for phase in dict.fromkeys(s.phase for s in res.steps):
        phases[phase] = phase_collectives([s for s in res.steps if s.phase == phase], probes)
    return {
        "tp": cfg["parallel"]["tp"], "moe": cfg["parallel"]["moe"], "world_size": group.size,
        "allreduce": {"config": cfg["parallel"].get("allreduce", "auto"), "runs_as": runtime.container.collectives().mode,
                      "oneshot_max_bytes": runtime.container.collectives().limit,
                      "fused_max_bytes": runtime.container.collectives().fused_limit},
        "backend": group.backend,
        "memory_per_rank": group.gather_objects(_rank_memory(runtime)),
        "collectives": phases,
        "collective_totals": {"count": group.stats.total_count, "bytes": group.stats.total_bytes},
    }
