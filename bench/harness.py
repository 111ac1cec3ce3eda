"""The one bench harness: ceilings measured in the same run, timers, ratio helpers, and the output.

Every benchmark under ``bench/`` uses this module, so their figures compare like with like:

* **Ceilings** (:func:`measure_ceilings`): device-to-device ``copy_`` bandwidth of a large uint8 buffer, bytes
  counted as read + write (2x the size), and a bf16 ``8192 x 8192 x 8192`` ``torch.matmul`` on random normal
  data, FLOPs counted as ``2 * n^3``. Both are :func:`eager_ms` medians after warm-up. :func:`h2d_copy_gbs` is
  the pinned host -> device ceiling for benches that move rows from the host.
* **Timers** (CUDA events on a CUDA device; ``time.perf_counter`` on the CPU, for the ``--smoke`` runs):
  :func:`eager_ms` (per-call median after warm-up, L2 flushed before each timed call), :func:`graph_ms` (the
  calls captured once in a CUDA graph and replayed: the GPU time of code made of many small launches),
  :func:`loop_ms` (back-to-back calls between two events), :func:`host_us` (host time of calls that only
  enqueue work). :func:`copies_for_l2` and :func:`rotating` rotate input sets that L2 would otherwise serve.
* **Ratios**: :func:`gb_per_s`, :func:`tflop_per_s`, and :meth:`Ceilings.pct_copy` / :meth:`Ceilings.pct_matmul`.
* **Output** (:func:`report`): the result :class:`Table` (aligned columns) printed last, then one line
  ``BENCH_JSON {"bench", "device", "ceilings", "rows", "meta"}`` (non-finite numbers become ``null``).

The module imports on a CPU-only machine: torch's CUDA calls run only inside the functions that time on a CUDA
device, and nothing here imports triton.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

MiB, GiB = 1 << 20, 1 << 30
L2_FLUSH_BYTES = 256 * MiB  # larger than any current GPU's L2 (H100: 50 MiB, H200: 60 MiB)
JSON_PREFIX = "BENCH_JSON "

Cell = str | int | float | bool | None


# ------------------------------------------------------------------------------------------------ clocks
class _HostEvent:
    """``torch.cuda.Event``'s two methods on the host clock (the CPU runs work when it is called)."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.t - self.t) * 1e3


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _event(dev: torch.device):
    return torch.cuda.Event(enable_timing=True) if dev.type == "cuda" else _HostEvent()


def sync(device: str | torch.device | None = None) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------------------------------ timers
def eager_ms(
    fn: Callable[[], object],
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    flush_l2: bool = True,
    device: str | torch.device | None = None,
) -> float:
    """Median time of one call of ``fn``, in ms, after warm-up.

    ``fn`` is called once (compile, JIT, allocator), then up to 5 times, synchronized, to estimate its time
    (flush included); then ``warmup_ms / estimate`` warm-up calls and ``rep_ms / estimate`` timed calls, each
    between two events; before each timed call a 256 MiB buffer is zeroed so L2 holds none of ``fn``'s inputs
    (as ``triton.testing.do_bench`` does). When the estimate alone already spans ``rep_ms`` (slow calls, e.g.
    the Triton interpreter), the median of its calls is returned.

    Parameters
    ----------
    fn : callable
        One call of the work; it enqueues device work or runs on the CPU.
    warmup_ms, rep_ms : float
        Time budgets of the warm-up and of the timed calls.
    flush_l2 : bool
        Zero a 256 MiB buffer before each timed call (CUDA only).
    device : str or torch.device, optional
        Where ``fn`` runs: CUDA events there, or the host clock on the CPU. Default: CUDA when available.

    Returns
    -------
    float
        Median milliseconds per call.
    """
    dev = _device(device)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev) if flush_l2 and dev.type == "cuda" else None
    fn()
    sync(dev)
    # the estimate counts the flush too (the timed loop pays it), and stops early for slow calls
    per_call: list[float] = []
    with_flush: list[float] = []
    e0, e1, e2 = _event(dev), _event(dev), _event(dev)
    while len(per_call) < 5 and sum(with_flush) < rep_ms:
        e0.record()
        if flush is not None:
            flush.zero_()
        e1.record()
        fn()
        e2.record()
        sync(dev)
        per_call.append(e1.elapsed_time(e2))
        with_flush.append(e0.elapsed_time(e2))
    if sum(with_flush) >= rep_ms:
        return statistics.median(per_call)
    per = max(statistics.median(with_flush), 1e-4)
    n_warm, n_rep = int(warmup_ms / per), max(1, min(100_000, int(rep_ms / per)))
    starts, ends = [_event(dev) for _ in range(n_rep)], [_event(dev) for _ in range(n_rep)]
    for _ in range(n_warm):
        fn()
    for s, e in zip(starts, ends):
        if flush is not None:
            flush.zero_()
        s.record()
        fn()
        e.record()
    sync(dev)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def graph_ms(
    calls: Sequence[Callable[[], object]],
    *,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    device: str | torch.device | None = None,
) -> float:
    """GPU time of one call, in ms: ``calls`` captured in turn into one CUDA graph, replayed.

    The calls run once on a side stream (warm-up, as capture requires), are captured in order, and the graph's
    replay is timed with :func:`eager_ms`; the result is the replay median over ``len(calls)``. Pass one call per
    input set (or the same rotating call several times) to keep L2 from serving repeated reads.

    Parameters
    ----------
    calls : sequence of callables
        The calls to capture; each enqueues device work only (no host synchronization, no allocation that the
        graph cannot own).
    warmup_ms, rep_ms : float
        Passed to :func:`eager_ms` for the replays.
    device : str or torch.device, optional
        Default: CUDA when available.

    Returns
    -------
    float
        Milliseconds per call; NaN on the CPU (there is no graph to capture).
    """
    dev = _device(device)
    if dev.type != "cuda":
        return float("nan")
    if not calls:
        raise ValueError("graph_ms: got no calls; expected at least one callable to capture")
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = eager_ms(graph.replay, warmup_ms=warmup_ms, rep_ms=rep_ms, device=dev) / len(calls)
    del graph
    return ms


def loop_ms(
    fn: Callable[[], object], iters: int, *, warmup: int = 0, device: str | torch.device | None = None
) -> float:
    """Mean time of ``iters`` back-to-back calls between two events, in ms (after ``warmup`` calls).

    Use it for work that the device runs back to back in a real loop (graph replays of whole steps), where a
    per-call median with L2 flushes would not be the figure wanted.
    """
    if iters < 1:
        raise ValueError(f"loop_ms: got iters={iters}; expected >= 1")
    dev = _device(device)
    for _ in range(warmup):
        fn()
    start, end = _event(dev), _event(dev)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    sync(dev)
    return start.elapsed_time(end) / iters


def host_us(fn: Callable[[], object], n: int, *, sync_each: bool = False,
            device: str | torch.device | None = None) -> float:
    """Median host time of one call of ``fn``, in microseconds (``time.perf_counter``).

    The device is drained before the first call (and before every call with ``sync_each``), so the figure is
    the host cost of enqueueing, not a wait for earlier work.
    """
    if n < 1:
        raise ValueError(f"host_us: got n={n}; expected >= 1")
    dev = _device(device)
    sync(dev)
    times = []
    for _ in range(n):
        if sync_each:
            sync(dev)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    sync(dev)
    return statistics.median(times) * 1e6


def l2_bytes(device: str | torch.device | None = None) -> int:
    """The device's L2 cache size in bytes (64 KiB on the CPU, for the ``--smoke`` runs)."""
    dev = _device(device)
    if dev.type != "cuda":
        return 64 * 1024
    return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * MiB))


def copies_for_l2(nbytes: int, device: str | torch.device | None = None, *, factor: int = 3, cap: int = 8) -> int:
    """How many copies of ``nbytes`` of inputs to rotate over so L2 never serves a repeated read: enough that
    they span ``factor`` x L2, between 1 and ``cap``."""
    return max(1, min(cap, math.ceil(factor * l2_bytes(device) / max(nbytes, 1))))


def rotating(calls: Sequence[Callable[[], object]]) -> Callable[[], None]:
    """One callable that runs ``calls[0]``, ``calls[1]``, ... in turn, one per call (rotates input sets)."""
    if not calls:
        raise ValueError("rotating: got no calls; expected at least one")
    state = [0]

    def run() -> None:
        calls[state[0] % len(calls)]()
        state[0] += 1

    return run


# ------------------------------------------------------------------------------------------------ ratios
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN when ``out`` holds a NaN (a NaN never passes a bound)."""
    if torch.isnan(out).any():
        return float("nan")
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def gb_per_s(nbytes: float, ms: float) -> float:
    """``nbytes`` moved in ``ms`` milliseconds, in GB/s (1e9 bytes/s)."""
    return nbytes / (ms * 1e-3) / 1e9


def tflop_per_s(flops: float, ms: float) -> float:
    """``flops`` done in ``ms`` milliseconds, in TFLOP/s (1e12 FLOP/s)."""
    return flops / (ms * 1e-3) / 1e12


@dataclass(frozen=True)
class Ceilings:
    """Hardware ceilings measured in this run.

    Attributes
    ----------
    device : str
        The device's name (``torch.cuda.get_device_name``, or ``"cpu"``).
    copy_gbs : float
        Device-to-device copy bandwidth, GB/s, read + write bytes counted.
    matmul_tflops : float
        bf16 ``n^3`` matmul rate on random data, TFLOP/s.
    extra : mapping of str to float
        Further ceilings a bench measured (e.g. ``h2d_gbs``); they go into the JSON line's ``ceilings``.
    """

    device: str
    copy_gbs: float
    matmul_tflops: float
    extra: Mapping[str, float] = field(default_factory=dict)

    def pct_copy(self, nbytes: float, ms: float) -> float:
        """``nbytes`` (counted as the bench counts them) in ``ms``, as % of the copy bandwidth."""
        return 100 * gb_per_s(nbytes, ms) / self.copy_gbs

    def pct_matmul(self, flops: float, ms: float) -> float:
        """``flops`` in ``ms``, as % of the matmul rate."""
        return 100 * tflop_per_s(flops, ms) / self.matmul_tflops

    def with_extra(self, **values: float) -> Ceilings:
        """A copy with more ``extra`` ceilings."""
        return Ceilings(self.device, self.copy_gbs, self.matmul_tflops, {**self.extra, **values})

    def as_dict(self) -> dict[str, Any]:
        """``{"device", "copy_gbs", "matmul_tflops", **extra}`` (the dict ``bench/ceilings.py`` returns)."""
        return {"device": self.device, "copy_gbs": self.copy_gbs, "matmul_tflops": self.matmul_tflops, **self.extra}

    def summary(self) -> str:
        """One line for the log: device, copy GB/s, matmul TFLOP/s and the extras."""
        extra = "".join(f", {k} {v:.1f}" for k, v in self.extra.items())
        return (f"{self.device}: copy {self.copy_gbs:.0f} GB/s (read+write), "
                f"bf16 matmul {self.matmul_tflops:.0f} TFLOP/s{extra}")


def copy_bandwidth_gbs(nbytes: int | None = None, device: str | torch.device | None = None, *,
                       warmup_ms: float = 100, rep_ms: float = 300) -> float:
    """Device-to-device ``copy_`` GB/s of an ``nbytes`` uint8 buffer (default 1 GiB; 1 MiB on the CPU), counting
    read + write bytes (2 x ``nbytes``)."""
    dev = _device(device)
    n = nbytes if nbytes is not None else (GiB if dev.type == "cuda" else MiB)
    src = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    dst = torch.empty_like(src)
    return gb_per_s(2 * n, eager_ms(lambda: dst.copy_(src), warmup_ms=warmup_ms, rep_ms=rep_ms, device=dev))


def matmul_tflops(n: int | None = None, dtype: torch.dtype = torch.bfloat16,
                  device: str | torch.device | None = None, *, warmup_ms: float = 100, rep_ms: float = 300) -> float:
    """Dense ``n x n x n`` matmul TFLOP/s (default n = 8192; 256 on the CPU) on random normal data."""
    dev = _device(device)
    n = n if n is not None else (8192 if dev.type == "cuda" else 256)
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    c = torch.empty(n, n, dtype=dtype, device=dev)
    ms = eager_ms(lambda: torch.matmul(a, b, out=c), warmup_ms=warmup_ms, rep_ms=rep_ms, device=dev)
    return tflop_per_s(2 * n**3, ms)


def h2d_copy_gbs(nbytes: int, device: str | torch.device | None = None) -> float:
    """Pinned host -> device ``copy_`` GB/s of one contiguous ``nbytes`` buffer (bytes counted once); the median of
    three :func:`eager_ms` medians. NaN on the CPU."""
    dev = _device(device)
    if dev.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    ms = statistics.median(eager_ms(lambda: dst.copy_(src, non_blocking=True), rep_ms=200, device=dev)
                           for _ in range(3))
    return gb_per_s(nbytes, ms)


def measure_ceilings(device: str | torch.device | None = None, *, copy_nbytes: int | None = None,
                     matmul_n: int | None = None) -> Ceilings:
    """Measure the copy bandwidth and the bf16 matmul rate now, on ``device`` (small sizes on the CPU).

    Returns
    -------
    Ceilings
        Frees the cached blocks it used before returning.
    """
    dev = _device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    out = Ceilings(name, copy_bandwidth_gbs(copy_nbytes, dev), matmul_tflops(matmul_n, device=dev))
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------------ output
def _cell(value: Cell, spec: str | None) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and spec:
        return format(value, spec)
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Cell]], columns: Sequence[str] | None = None,
                 formats: Mapping[str, str] | None = None) -> str:
    """The rows as an aligned text table: a header, a rule of dashes, one line per row.

    Parameters
    ----------
    rows : sequence of mappings
        Column name -> value (str, int, float, bool or None; None prints empty, bools print yes/no).
    columns : sequence of str, optional
        Column order; default: every key in the order first seen.
    formats : mapping of str to str, optional
        A ``format()`` spec per column for its numbers (e.g. ``{"us": ".1f"}``); default: ``.4g``, and no
        decimals from 1e4 up.

    Returns
    -------
    str
        Columns of numbers are right-aligned, others left-aligned; two spaces between columns; no trailing
        spaces.
    """
    formats = formats or {}
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(c), formats.get(c)) for c in columns] for r in rows]
    numeric = [all(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)
                   for r in rows if r.get(c) is not None) and any(r.get(c) is not None for r in rows)
               for c in columns]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line(list(columns)), "  ".join("-" * w for w in widths)]
    out += [line(c) for c in cells]
    return "\n".join(out)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return str(value)


@dataclass(frozen=True)
class Table:
    """One result table of a bench.

    Attributes
    ----------
    rows : sequence of mappings
        Column name -> value; see :func:`format_table`. The JSON line carries the values unformatted.
    title : str
        Printed above the table.
    columns, formats
        Passed to :func:`format_table`.
    name : str
        Short name; in the JSON line each row of a bench with several tables carries it as ``"table"``.
    """

    rows: Sequence[Mapping[str, Cell]]
    title: str = ""
    columns: Sequence[str] | None = None
    formats: Mapping[str, str] | None = None
    name: str = ""

    def render(self) -> str:
        """The title (if any) and the aligned table."""
        table = format_table(self.rows, self.columns, self.formats)
        return f"{self.title}\n{table}" if self.title else table


def json_line(bench: str, ceilings: Ceilings, tables: Table | Sequence[Table],
              meta: Mapping[str, Any] | None = None) -> str:
    """``BENCH_JSON {"bench", "device", "ceilings", "rows", "meta"}`` on one line; NaN and infinities become
    ``null`` (the line is strict JSON after the prefix). With several tables, each row gets ``"table": name``."""
    tables = [tables] if isinstance(tables, Table) else list(tables)
    rows = [dict(r) if len(tables) == 1 else {"table": t.name or str(i), **r}
            for i, t in enumerate(tables) for r in t.rows]
    ceil = {k: v for k, v in ceilings.as_dict().items() if k != "device"}
    doc = {"bench": bench, "device": ceilings.device, "ceilings": ceil, "rows": rows, "meta": dict(meta or {})}
    return JSON_PREFIX + json.dumps(_jsonable(doc), allow_nan=False, separators=(",", ":"))


def parse_json_line(line: str) -> dict[str, Any]:
    """The document of a ``BENCH_JSON`` line (the inverse of :func:`json_line`)."""
    if not line.startswith(JSON_PREFIX):
        raise ValueError(f"not a bench JSON line: expected it to start with {JSON_PREFIX!r}, got {line[:40]!r}")
    return json.loads(line[len(JSON_PREFIX):])


def report(bench: str, ceilings: Ceilings, tables: Table | Sequence[Table], *,
           meta: Mapping[str, Any] | None = None, file: TextIO | None = None) -> None:
    """Print the result tables (after a blank line and the ceilings), then the JSON line.

    A bench calls this last, so its tables and the ``BENCH_JSON`` line are the tail of its output.
    """
    out = file or sys.stdout
    tables = [tables] if isinstance(tables, Table) else list(tables)
    print(f"\nceilings: {ceilings.summary()}", file=out)
    for t in tables:
        print(t.render(), file=out)
    print(json_line(bench, ceilings, tables, meta), file=out, flush=True)
