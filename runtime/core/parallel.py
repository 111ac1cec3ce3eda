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

Which all-reduce (``parallel.allreduce``, docs/parallelism.md): the model talks to :class:`Collectives`, which
routes each all-reduce by its size to NCCL (gloo on the CPU) or to an injected :class:`PeerAllReduce` (the one-shot
and fused kernels of ``backends/kernels/comm`` over symmetric CUDA IPC buffers), and offers
``reduce_add_rms_norm`` (the decoder layer's all-reduce + residual add + RMSNorm, one kernel under ``fused``).
The choice depends on shapes and dtypes only, so every rank takes the same path, and a captured graph keeps it.
NVLink multicast (NVLS, multimem) is never used: :func:`multicast_off` sets ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` before any process group exists.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

TIMEOUT = datetime.timedelta(minutes=10)
#: NVLink multicast stays off in every process (a program that turns it on can take shared GPUs out of service)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def multicast_off(env: dict | None = None) -> None:
    """Set :data:`MULTICAST_OFF` in ``env`` (the process environment), overriding any other value."""
    (os.environ if env is None else env).update(MULTICAST_OFF)


@dataclass(frozen=True)
class LaunchEnv:
    """What torchrun told this process (all defaults: a plain ``python -m runtime`` run, one rank)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False  # WORLD_SIZE is set: started by torchrun (or an equivalent launcher)
    local_world_size: int | None = None  # LOCAL_WORLD_SIZE: ranks on this node (None: not told, one node assumed)

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> LaunchEnv:
        env = os.environ if env is None else env
        local = env.get("LOCAL_WORLD_SIZE")
        return cls(rank=int(env.get("RANK", 0)), world_size=int(env.get("WORLD_SIZE", 1)),
                   local_rank=int(env.get("LOCAL_RANK", 0)), launched="WORLD_SIZE" in env,
                   local_world_size=int(local) if local else None)

    @property
    def one_node(self) -> bool:
        return self.local_world_size is None or self.local_world_size == self.world_size


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
        multicast_off()
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
        return self.time_ops([self._probe_op(op, b) for (op, _, _), b in zip(sample.ops, bufs)], iters)

    def time_ops(self, ops: list[Callable[[], object]], iters: int = 20) -> float:
        """Median seconds of one run of ``ops`` in order, of ``iters`` timed runs after 3 warm-ups (collective)."""
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


# ------------------------------------------------------------------------------------------ all-reduce routing
ONESHOT, FUSED = "all_reduce:oneshot", "all_reduce:fused"  # op names in the statistics (the NCCL one: all_reduce)
#: tensor-parallel sizes the one-shot kernels take (a power of two: the signal pads are indexed by a tl.arange)
PEER_WORLD_SIZES = (2, 4, 8)


class PeerAllReduce(Protocol):
    """One-shot all-reduce over symmetric (CUDA IPC) buffers (``backends/kernels/comm``): every rank copies its
    input into its own buffer, the ranks meet at a barrier of signal flags, and each reads every peer's buffer and
    sums in float32, in rank order (the same bits on every rank). No multicast."""

    max_bytes: int  # the largest message the buffer holds

    def fits(self, x: torch.Tensor) -> bool:
        """``x`` (contiguous [T, D] or [N], a dtype of the kernels) fits the buffer."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of ``x`` (same shape and dtype; a new tensor)."""

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """partial, residual [T, D], weight [D] -> (residual + sum(partial), RMSNorm(that) * weight), one kernel."""


def resolve_allreduce(mode: str, tp: int, device_kind: str, peer_ok: bool) -> str:
    """What ``parallel.allreduce`` runs as: ``auto`` is ``fused`` where the kernels can run (CUDA, tp in
    :data:`PEER_WORLD_SIZES`, one node with peer access: ``peer_ok``), else ``nccl``; one rank: ``nccl`` (nothing to
    reduce). Validation refuses ``oneshot`` / ``fused`` where they cannot run, before this is asked."""
    mode = str(mode)  # the plain config holds the names
    if tp == 1:
        return "nccl"
    if mode == "auto":
        return "fused" if device_kind == "cuda" and tp in PEER_WORLD_SIZES and peer_ok else "nccl"
    return mode


class Collectives:
    """What the model calls: the group's collectives, each all-reduce routed by its size.

    Parameters
    ----------
    group : SingleRank or TPGroup
        NCCL / gloo, and the statistics every collective is recorded in.
    peer : PeerAllReduce or None
        The one-shot kernels (None: every all-reduce goes to the group).
    mode : str
        ``parallel.allreduce`` resolved (:func:`resolve_allreduce`): nccl | oneshot | fused; ``auto`` keeps its
        name here: the fused kernel up to ``fused_max_bytes``, the one-shot kernel (then the norm) up to
        ``oneshot_max_bytes``, NCCL above.
    oneshot_max_bytes : int
        ``auto``: the largest message the kernels take (NCCL above); oneshot / fused: the buffer bounds it.
    fused_max_bytes : int
        ``auto``: the largest message of the fused all-reduce + add + RMSNorm kernel (on two H200s it beat NCCL
        plus the norm kernel at 1-2 tokens only); ``fused``: every message that fits.
    """

    def __init__(self, group, peer: PeerAllReduce | None = None, mode: str = "nccl",
                 oneshot_max_bytes: int = 0, fused_max_bytes: int = 0):
        self.group, self.peer, self.mode = group, peer, str(mode)
        self.rank, self.size, self.device, self.backend = group.rank, group.size, group.device, group.backend
        self.stats = group.stats
        limit = oneshot_max_bytes if self.mode == "auto" else (peer.max_bytes if peer is not None else 0)
        self.limit = min(limit, peer.max_bytes) if peer is not None else 0
        self.fused_limit = {"fused": self.limit, "auto": min(fused_max_bytes, self.limit)}.get(self.mode, 0)
        self._fused_dims: dict[int, int] = {}  # numel -> hidden size of the fused calls (the probe replays them)

    def route(self, x: torch.Tensor) -> str:
        """'oneshot' or 'nccl' for an all-reduce of ``x`` (a function of shape and dtype only)."""
        ok = self.peer is not None and x.numel() * x.element_size() <= self.limit and self.peer.fits(x)
        return "oneshot" if ok else "nccl"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks (NCCL in place, or the one-shot kernel's new tensor): use the returned tensor."""
        if self.route(x) == "nccl":
            return self.group.all_reduce(x)
        n = x.numel() * x.element_size()
        return self.stats.run(ONESHOT, x, n, lambda: self.peer.all_reduce(x))

    def reduce_add_rms_norm(self, x, partial, weight, eps, ops):
        """(x + sum(partial), RMSNorm(x + sum(partial)) * weight): the fused kernel under ``fused`` / ``auto`` when
        the message fits (CUDA, the same dtype everywhere), else the all-reduce then ``ops.add_rms_norm``."""
        if partial is None:
            return ops.add_rms_norm(x, None, weight, eps)
        n = partial.numel() * partial.element_size()
        fused = (n <= self.fused_limit and self.route(partial) == "oneshot" and partial.dim() == 2
                 and x.dtype == partial.dtype == weight.dtype and x.shape == partial.shape)
        if not fused:
            return ops.add_rms_norm(x, self.all_reduce(partial), weight, eps)
        self._fused_dims[partial.numel()] = partial.shape[-1]
        return self.stats.run(FUSED, partial, n, lambda: self.peer.all_reduce_add_rms_norm(partial, x, weight, eps))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.group.all_gather(x, dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self.group.broadcast(x, src)

    def gather_objects(self, obj) -> list:
        return self.group.gather_objects(obj)

    def probe(self, sample: CollectiveSample, iters: int = 20) -> float:
        """:meth:`TPGroup.probe` with the one-shot and fused ops replayed through the kernels (collective)."""
        if self.size == 1:
            return 0.0
        fns = []
        for op, n, dt in sample.ops:
            buf = torch.zeros(n, dtype=dt, device=self.device)
            if op == ONESHOT:
                fns.append(lambda b=buf: self.peer.all_reduce(b))
            elif op == FUSED:
                d = self._fused_dims.get(n, n)
                part, res, w = buf.view(-1, d), torch.zeros(n // d, d, dtype=dt, device=self.device), \
                    torch.ones(d, dtype=dt, device=self.device)
                fns.append(lambda p=part, r=res, w=w: self.peer.all_reduce_add_rms_norm(p, r, w, 1e-6))
            else:
                fns.append(self.group._probe_op(op, buf))
        return self.group.time_ops(fns, iters)


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
