"""Tensor parallelism on torch.distributed: the launch environment, the process group the model talks through,
how a tensor is split over the ranks, and what the collectives cost.

One process per GPU, started by ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` /
``MASTER_PORT`` in the environment). The container builds the group first (:func:`make_group`): NCCL when the
device is CUDA (the GPU is ``cuda:LOCAL_RANK``), gloo on the CPU. Model code calls ``group.all_reduce(x)`` and
``group.all_gather(x, dim)`` unconditionally: :class:`SingleRank` (tp=1) has the same interface and does no
communication.

Collective statistics (:class:`CollectiveStats`): every collective issued eagerly is timed, with CUDA events
around it on the current stream (read once, at the end) or ``perf_counter`` on the CPU (gloo is synchronous).
A collective issued while a CUDA graph is being captured is not timed (an event recorded there would be part
of the graph); its size is recorded instead, and each replay of that graph adds the captured sizes to the step
it runs in, untimed. The time of a graphed step's collectives is then measured by a separate *probe*
(:meth:`TPGroup.probe`): the same sequence of collectives (sizes, dtypes, order), run eagerly and timed on
their own, after the workload. The probe measures them without the step's compute around them, as a serial
TP step runs them (no overlap with compute is implemented).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun told this process (all defaults: a plain ``python -m runtime`` run, one rank)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False  # WORLD_SIZE is set: started by torchrun (or an equivalent launcher)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if env is None else env
        return cls(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)),
                   local_rank=int(env.get("LOCAL_RANK", 0)), launched="WORLD_SIZE" in env)


def torchrun_command(tp: int) -> str:
    return f"torchrun --nproc-per-node {tp} -m runtime parallel.tp={tp} ..."


# ------------------------------------------------------------------------------------------ statistics
@dataclass
class CollectiveSample:
    """The collectives of one step (or of one captured graph).

    Attributes
    ----------
    ops : (op name, numel, dtype) of each collective, in issue order (the probe replays them)
    nbytes : bytes each rank contributed (all-reduce: the tensor; all-gather: the local part)
    timers : per timed collective, a (start, end) CUDA event pair or elapsed seconds (CPU)
    timed : False when a collective of this sample ran inside a graph replay (no time of its own)
    """

    ops: list[tuple[str, int, torch.dtype]] = field(default_factory=list)
    nbytes: int = 0
    timers: list = field(default_factory=list)
    timed: bool = True

    @property
    def count(self) -> int:
        return len(self.ops)

    def add(self, other: CollectiveSample) -> None:
        self.ops += other.ops
        self.nbytes += other.nbytes
        self.timers += other.timers
        self.timed = self.timed and other.timed

    def seconds(self) -> float | None:
        """Time in the timed collectives (waits for their end events); None when the sample has none timed."""
        if not self.timers:
            return None if self.ops else 0.0
        total = 0.0
        for t in self.timers:
            if isinstance(t, tuple):
                t[1].synchronize()
                total += t[0].elapsed_time(t[1]) / 1e3
            else:
                total += t
        return total

    def signature(self) -> tuple:
        return tuple(self.ops)


class CollectiveStats:
    """Collectives since the last :meth:`take` (the engine takes one sample per step)."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._current = CollectiveSample()
        self.total_count = 0  # every collective since the group was built (warm-ups and captures too)
        self.total_bytes = 0

    def run(self, op: str, t: torch.Tensor, nbytes: int, fn: Callable[[], object]):
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        entry = CollectiveSample(ops=[(op, t.numel(), t.dtype)], nbytes=nbytes, timed=not capturing)
        if capturing:
            out = fn()
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            entry.timers.append((start, end))
        else:
            t0 = time.perf_counter()
            out = fn()
            entry.timers.append(time.perf_counter() - t0)
        self.add(entry)
        return out

    def add(self, sample: CollectiveSample) -> None:
        self._current.add(sample)
        self.total_count += sample.count
        self.total_bytes += sample.nbytes

    def take(self) -> CollectiveSample:
        out, self._current = self._current, CollectiveSample()
        return out


# ------------------------------------------------------------------------------------------ groups
class SingleRank:
    """tp=1: the group interface without communication (every call returns its input)."""

    rank = 0
    size = 1
    backend = "none"

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stats = CollectiveStats(self.device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x

    def gather_objects(self, obj) -> list:
        return [obj]

    def probe(self, sample: CollectiveSample, iters: int = 20) -> float:
        return 0.0


class TPGroup:
    """The tensor-parallel group: every rank of the job (``WORLD_SIZE`` = ``parallel.tp``).

    Parameters
    ----------
    launch : LaunchEnv
    device : torch.device
        ``cuda:LOCAL_RANK`` (NCCL) or the CPU (gloo).

    The default process group is initialised here once per process (the parity reference and the speculative
    baseline build further runtimes in the same process: they reuse it); :func:`shutdown` ends it.
    """

    def __init__(self, launch: LaunchEnv, device: torch.device):
        import torch.distributed as dist

        self.dist, self.device = dist, torch.device(device)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not dist.is_initialized():
            kwargs = {"device_id": self.device} if self.device.type == "cuda" else {}
            dist.init_process_group(self.backend, rank=launch.rank, world_size=launch.world_size, timeout=TIMEOUT,
                                    **kwargs)
        if dist.get_world_size() != launch.world_size:
            raise RuntimeError(f"process group of {dist.get_world_size()} ranks, expected {launch.world_size}")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.stats = CollectiveStats(self.device)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; every rank gets the same bits."""
        self.stats.run("all_reduce", x, x.numel() * x.element_size(), lambda: self.dist.all_reduce(x))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Each rank's ``x`` concatenated along ``dim``, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.stats.run("all_gather", x, x.numel() * x.element_size(), lambda: self.dist.all_gather(parts, x))
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.stats.run("broadcast", x, x.numel() * x.element_size(), lambda: self.dist.broadcast(x, src))
        return x

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable), on every rank, in rank order (for report data and checks; not timed)."""
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def probe(self, sample: CollectiveSample, iters: int = 20) -> float:
        """Seconds one run of ``sample``'s collectives takes on their own (same sizes, dtypes and order; zero
        data), median of ``iters`` timed runs after 3 warm-ups. Collective: every rank must call it with the same
        sample."""
        bufs = [torch.zeros(n, dtype=dt, device=self.device) for _, n, dt in sample.ops]
        ops = [self._probe_op(op, b) for (op, _, _), b in zip(sample.ops, bufs)]
        times = []
        for i in range(iters + 3):
            self.dist.barrier()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            for fn in ops:
                fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def _probe_op(self, op: str, buf: torch.Tensor) -> Callable[[], object]:
        if op == "all_gather":
            parts = [torch.empty_like(buf) for _ in range(self.size)]
            return lambda: self.dist.all_gather(parts, buf)
        if op == "broadcast":
            return lambda: self.dist.broadcast(buf, 0)
        return lambda: self.dist.all_reduce(buf)


def device_for(kind: str, index: int, launch: LaunchEnv, tp: int) -> tuple[str, int]:
    """(device kind, index) this rank runs on: ``auto`` resolves as :func:`runtime.core.device.probe_device`
    does; with tp > 1 on CUDA the index is LOCAL_RANK (one GPU per process), ``device.index`` otherwise."""
    resolved = ("cuda" if torch.cuda.is_available() else "cpu") if kind == "auto" else kind
    return resolved, (launch.local_rank if tp > 1 and resolved == "cuda" else index)


def make_group(tp: int, device_kind: str, device_index: int, launch: LaunchEnv | None = None):
    """The container's first provider: :class:`SingleRank` for tp=1, else :class:`TPGroup` over
    ``torch.distributed`` (validation has checked WORLD_SIZE == tp before anything was allocated)."""
    launch = launch or LaunchEnv.from_environ()
    kind, index = device_for(device_kind, device_index, launch, tp)
    device = torch.device(kind, index) if kind == "cuda" else torch.device("cpu")
    if tp == 1:
        return SingleRank(device)
    if kind == "cuda":
        torch.cuda.set_device(device)
    return TPGroup(launch, device)


def shutdown() -> None:
    """End the default process group if this process started one (the CLI calls it once, at exit)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ sharding
@dataclass(frozen=True)
class Sharding:
    """How this rank's slice of each tensor is cut (Megatron style; see runtime/model/deepseek/sharding.py).

    ``rank`` of ``size``; ``moe``: ``tp`` (every routed expert's intermediate dim split) or ``ep`` (each rank
    owns n_routed_experts / size whole experts)."""

    rank: int = 0
    size: int = 1
    moe: str = "tp"

    def part(self, n: int, unit: int = 1) -> slice:
        """This rank's contiguous share of ``n`` items of ``unit`` elements each (``n`` divisible by size)."""
        k = n // self.size
        return slice(self.rank * k * unit, (self.rank + 1) * k * unit)

    @property
    def expert_parallel(self) -> bool:
        return self.moe == "ep"


ONE_RANK = Sharding()  # no tensor parallelism: every tensor whole
