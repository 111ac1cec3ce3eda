"""Prefill step time of a preset as the engine runs prefill (eager, or replayed from a CUDA graph), per batch
shape and per fp8 GEMM variant.

``python -m bench.prefill_bench [--preset h100_triton_tp8] [--layers 16] [--shapes 1x1024 2x1024 4x1024 8x1000]
[--weights fp8] [--variants default no_tma no_cublas cublas_2048] [--graphs off on] [--runs 3] [--kernels]
[--host N] [--quick]``

Why: the fp8 GEMM benches time one product in CUDA graphs; an eager prefill also waits on the host, whose
launches at prompts up to ~2048 tokens take longer than the GPU's kernels (docs/kernels.md, "Prefill"). This
bench times the prefill, splits it into kernel and idle time, and says where the host's time goes; ``--graphs
on`` runs the same steps with graphed prefill (``graph.prefill_tokens``, the preset's counts: a step of up to
4096 tokens over at most 7 requests replays the graph of the next count up), ``off`` with ``graph.prefill_tokens=[]``.

Per (shape ``BxP``: B requests of P prompt tokens, all prefilled in one step; graphs; variant):

* gc n / gc ms: Python's garbage collections per run (all of it, the decode step too) and their host ms (on an
  H100, 2026-11-28: none, so the idle time below is not the collector's);
* prefill ms: the prefill steps' GPU time from their CUDA-event marks, the median over ``--runs`` engine runs
  after one warm-up run (the engine runs each request to 2 output tokens, so a run is its prefill and one decode);
* tok/s: prompt tokens / prefill time; steps: prefill steps per run (1 unless the batch exceeds the chunk size);
  graphed: of those, the steps a graph replayed;
* host ms: the host's time to enqueue the eager prefill forwards of a run (``MLAModel.forward`` timed on the
  host; no sync inside): near or above prefill ms, the prefill waits on the host (0 where graphs replayed them);
* ``--kernels``: one more, profiled run: the union of GPU activity inside the prefill window (kernel ms), the
  window's idle rest (idle ms: the GPU waiting for the host's launches; the profiler adds host time), and a
  table of its top kernels;
* ``--host N``: one more run under ``cProfile`` (the first variant, each shape): the N functions of most host
  time (own time, calls), which is what the idle ms above waits for at prompt lengths where the host is slower
  than the GPU.

Variants set module constants of the runtime for their runs and restore them after:

* ``default``: the runtime's choice (TMA weight tiles at every size, cuBLAS from 4096 rows);
* ``no_tma``: the grouped expert GEMM's weight tiles by plain loads (``fp8_moe.TMA_ROWS`` 0);
* ``no_cublas`` / ``cublas_2048``: dense fp8 products by torch's block-scaled ``scaled_mm`` never / from 2048
  rows, where it serves (``fp8_gemm.SCALED_MM_ROWS``); FlashInfer's kernel (or ours) below.

Prints the ceilings, the table and the ``BENCH_JSON`` line (bench/harness.py). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import runtime.core.config  # noqa: E402, F401  (registers the schemas)
from bench.decode_roofline import (  # noqa: E402
    BREAKDOWN_COLUMNS,
    BREAKDOWN_FORMATS,
    gpu_events,
    kernel_breakdown,
    overrides,
    union_us,
)
from bench.engine_config import compose_config  # noqa: E402
from bench.harness import Table, measure_ceilings, report  # noqa: E402
from bench.host_step import profile_top  # noqa: E402
from containers import build  # noqa: E402
from runtime.core.batch import ForwardMode  # noqa: E402

#: variant -> {(module, constant): value}
VARIANTS = {"default": {}, "no_tma": {("fp8_moe", "TMA_ROWS"): 0},
            "no_cublas": {("fp8_gemm", "SCALED_MM_ROWS"): None}, "cublas_2048": {("fp8_gemm", "SCALED_MM_ROWS"): 2048}}


@contextlib.contextmanager
def variant(name: str):
    """The launchers' constants of ``name`` (:data:`VARIANTS`) for the block, restored after."""
    from backends.kernels.gemm import fp8_gemm, fp8_moe

    mods = {"fp8_gemm": fp8_gemm, "fp8_moe": fp8_moe}
    saved = {key: getattr(mods[key[0]], key[1]) for key in VARIANTS[name]}
    try:
        for (mod, const), value in VARIANTS[name].items():
            setattr(mods[mod], const, value)
        yield
    finally:
        for (mod, const), value in saved.items():
            setattr(mods[mod], const, value)


class CollectorTime:
    """Python's garbage collections while active: how many, and their host ms (``gc.callbacks``)."""

    def __init__(self):
        self.count, self.ms, self._t0 = 0, 0.0, 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.ms += (time.perf_counter() - self._t0) * 1e3

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


class HostTime:
    """Host ms of the model's eager prefill forwards while active: the time Python takes to enqueue a prefill's
    kernels (no sync inside), wrapped around the model instance's ``forward`` and restored after."""

    def __init__(self, model):
        self.model, self.ms = model, []

    def __enter__(self):
        forward = self.model.forward

        def timed(ids, batch):
            t0 = time.perf_counter()
            out = forward(ids, batch)
            if batch.mode == ForwardMode.EXTEND:
                self.ms.append((time.perf_counter() - t0) * 1e3)
            return out

        self.model.forward = timed
        return self

    def __exit__(self, *exc):
        del self.model.forward  # the class's method again


def parse_shape(text: str) -> tuple[int, int]:
    """``BxP`` -> (B requests, P prompt tokens)."""
    b, sep, p = text.partition("x")
    if not sep or not b.isdigit() or not p.isdigit() or int(b) < 1 or int(p) < 1:
        raise argparse.ArgumentTypeError(f"shape BxP (requests x prompt tokens, e.g. 4x1024); got {text!r}")
    return int(b), int(p)


def prefill_ms(res) -> tuple[float, int, int, int]:
    """(GPU ms, steps, tokens, graphed steps) of a run's prefill steps, from their CUDA-event marks."""
    pre = [s for s in res.steps if s.phase == "prefill"]
    torch.cuda.synchronize()
    return (sum(s.marks[0].elapsed_time(s.marks[1]) for s in pre), len(pre), sum(s.tokens for s in pre),
            sum(s.graphed for s in pre))


def host_profile(rt, top: int, label: str) -> None:
    """One engine run under cProfile: the ``top`` functions by own host time, printed."""
    print(f"host profile of one run (prefill + one decode step), {label}:\n{profile_top(rt, top)}", flush=True)


def run_shape(args, batch: int, prompt: int, graphs: str) -> tuple[list[dict], list[Table]]:
    """Every variant at one shape, on one build of the preset (graphed prefill ``graphs``: on / off)."""
    off = ("graph.prefill_tokens=[]",) if graphs == "off" else ()
    cfg = compose_config(overrides(args.preset, batch, args.layers, prompt, 2, "on",
                                   extra=(f"model.weights={args.weights}", *off, *args.set)))
    rt = build(cfg)
    rows, tables = [], []
    for name in args.variants:
        with variant(name):
            rt.engine.run(record_hidden=False)  # warm-up: JIT, allocator caches
            with CollectorTime() as collected, HostTime(rt.container.model()) as host:
                times = [prefill_ms(rt.engine.run(record_hidden=False)) for _ in range(args.runs)]
            ms = statistics.median(t[0] for t in times)
            row = {"shape": f"{batch}x{prompt}", "graphs": graphs, "variant": name, "tokens": times[0][2],
                   "steps": times[0][1], "graphed": times[0][3],
                   "prefill_ms": ms, "min_ms": min(t[0] for t in times), "max_ms": max(t[0] for t in times),
                   "tok_s": times[0][2] / ms * 1e3, "host_ms": sum(host.ms) / args.runs,
                   "gc_n": collected.count / args.runs, "gc_ms": collected.ms / args.runs}
            if args.kernels:
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    res = rt.engine.run(record_hidden=False)
                window_ms = prefill_ms(res)[0]
                ev = gpu_events(prof)
                lo = ev[0][0]  # the run starts with its prefill
                hi = lo + window_ms * 1e3
                busy = union_us([(s, e, c) for s, e, c, _ in ev], lo, hi)
                row.update(kernel_ms=busy / 1e3, idle_ms=max(0.0, window_ms - busy / 1e3))
                tables.append(Table(kernel_breakdown(ev, lo, hi, 1, args.layers, top=args.top),
                                    f"kernels of the prefill: {batch}x{prompt}, graphs {graphs}, {name}, "
                                    f"{args.layers} layers",
                                    BREAKDOWN_COLUMNS, {**BREAKDOWN_FORMATS, "per_step": ".0f"}, name="kernels"))
            if args.host and name == args.variants[0] and graphs == args.graphs[0]:
                host_profile(rt, args.host, f"{batch}x{prompt}, {name}")
        rows.append(row)
        print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    del rt
    torch.cuda.empty_cache()
    return rows, tables


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.prefill_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="h100_triton_tp8")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=[(1, 1024), (2, 1024), (4, 1024), (8, 1000)],
                    help="BxP: B requests of P prompt tokens, prefilled in one step")
    ap.add_argument("--weights", default="fp8", choices=["bf16", "fp8"], help="model.weights")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--graphs", nargs="+", default=["off", "on"], choices=["off", "on"],
                    help="graphed prefill: off (graph.prefill_tokens=[]) and / or on (the preset's counts)")
    ap.add_argument("--runs", type=int, default=3, help="timed engine runs per variant (the median is reported)")
    ap.add_argument("--kernels", action="store_true", help="one profiled run per variant: kernel / idle time, top kernels")
    ap.add_argument("--host", type=int, default=0, metavar="N",
                    help="one cProfile'd run per shape (first variant): the N functions of most host time")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per profiled run")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more Hydra overrides for every run")
    ap.add_argument("--quick", action="store_true", help="4 layers, shapes 1x1024 and 4x1024, 1 run")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.layers, args.shapes, args.runs = 4, [(1, 1024), (4, 1024)], 1
    if not torch.cuda.is_available():
        raise SystemExit("prefill_bench: needs a CUDA GPU (got none). Fix: run it on the device machine.")
    ceilings = measure_ceilings()
    rows, tables = [], []
    for batch, prompt in args.shapes:
        for graphs in args.graphs:
            r, t = run_shape(args, batch, prompt, graphs)
            rows += r
            tables += t
    cols = ["shape", "graphs", "variant", "tokens", "steps", "graphed", "prefill_ms", "min_ms", "max_ms", "tok_s",
            "host_ms", "gc_n", "gc_ms"]
    cols += ["kernel_ms", "idle_ms"] if args.kernels else []
    fmt = {c: ".2f" for c in ("prefill_ms", "min_ms", "max_ms", "host_ms", "kernel_ms", "idle_ms", "gc_ms")}
    fmt |= {"tok_s": ".0f", "gc_n": ".1f"}
    title = (f"prefill: {args.preset}, {args.layers} layers, model.weights={args.weights}"
             f"{''.join(' ' + o for o in args.set)}; GPU time from the steps' CUDA events, median of "
             f"{args.runs} runs")
    report("prefill_bench", ceilings, tables + [Table(rows, title, cols, fmt, name="prefill")],
           meta={"preset": args.preset, "layers": args.layers, "weights": args.weights, "graphs": args.graphs,
                 "set": args.set})


if __name__ == "__main__":
    main()
