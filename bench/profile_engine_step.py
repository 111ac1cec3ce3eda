"""Where does a decode step's host time go? torch.profiler over a short engine run (device only).

Prints the CUDA runtime calls and Python-side ops with the most host time, per decode step, so a blocking
call (stream/event synchronize, a pageable memcpy, a graph launch) shows up by name. ``--quick``: 8 layers,
8 output tokens.

Run: ``python -m bench.profile_engine_step [--quick] [--preset h100_dsv3_tp8] [--batch 1] [--layers 61]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_config import compose_config, fixed_workload  # noqa: E402
from bench.harness import Table, measure_ceilings, report  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 layers, 8 steps")
    ap.add_argument("--preset", default="h100_dsv3_tp8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=None, help="default 61 (--quick: 8)")
    ap.add_argument("--steps", type=int, default=None, help="output tokens per request; default 24 (--quick: 8)")
    ap.add_argument("--top", type=int, default=28, help="rows printed")
    ap.add_argument("--trace", default=None, help="also write the chrome trace (with Python stacks) to this file")
    return ap


def main(argv: list[str] | None = None) -> None:
    from torch.profiler import ProfilerActivity, profile

    from containers import build

    args = build_parser().parse_args(argv)
    layers = args.layers or (8 if args.quick else 61)
    steps_wanted = args.steps or (8 if args.quick else 24)
    ceil = measure_ceilings()
    print(f"[ceilings] {ceil.summary()}", flush=True)
    b = args.batch
    cfg = compose_config([f"+deploy={args.preset}", "check=off", "progress=false", f"model.num_layers={layers}",
                          *fixed_workload(b, 512, steps_wanted),
                          f"kv.num_pages={b * 10 + 16}", f"kv.max_requests={max(b, 8)}", f"graph.batch_sizes=[{b}]"])
    rt = build(cfg)
    rt.engine.run(record_hidden=False)  # warm-up: capture, JIT, allocator caches
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.trace is not None) as prof:
        res = rt.engine.run(record_hidden=False)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    steps = len(res.steps)
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    rows = [{"op": e.key[:59], "calls": e.count, "self_cpu_us_per_step": e.self_cpu_time_total / steps} for e in top]
    table = Table(rows, title=f"{args.preset} batch {b}, {layers} layers: {steps} steps profiled; host time per "
                              "step (us)", formats={"self_cpu_us_per_step": ".1f"})
    report("profile_engine_step", ceil, table,
           meta={"preset": args.preset, "batch": b, "layers": layers, "steps": steps, "quick": args.quick})


if __name__ == "__main__":
    main()
