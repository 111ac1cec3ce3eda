"""Where does a decode step's host time go? torch.profiler over a short engine run (device only).

Prints the CUDA runtime calls and Python-side ops with the most host time, per decode step, so a blocking
call (stream/event synchronize, a pageable memcpy, a graph launch) shows up by name.
Run: ``python bench/profile_engine_step.py [--preset h100_dsv3_tp8] [--batch 1] [--layers 61]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile

import runtime.core.config  # noqa: F401
from containers import build

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="h100_dsv3_tp8")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    b = args.batch
    over = [f"+deploy={args.preset}", "check=off", "progress=false", f"model.num_layers={args.layers}",
            f"workload.num_requests={b}", f"workload.max_running_requests={b}", "workload.prompt_len.dist=fixed",
            "workload.prompt_len.mean=512", "workload.prompt_len.min=512", "workload.prompt_len.max=512",
            "workload.output_len.dist=fixed", f"workload.output_len.mean={args.steps}",
            f"workload.output_len.min={args.steps}", f"workload.output_len.max={args.steps}",
            f"kv.num_pages={b * 10 + 16}", f"kv.max_requests={max(b, 8)}", f"graph.batch_sizes=[{b}]"]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=over)
    rt = build(cfg)
    rt.engine.run(record_hidden=False)  # warm-up: capture, JIT, allocator caches
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = rt.engine.run(record_hidden=False)
    steps = len(res.steps)
    print(f"\n{args.preset} batch {b}, {args.layers} layers: {steps} steps profiled; host time per step (us)")
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:28]
    print(f"{'op':<60}{'calls':>8}{'self cpu us/step':>18}")
    for e in rows:
        print(f"{e.key[:59]:<60}{e.count:>8}{e.self_cpu_time_total / steps:>18.1f}")


if __name__ == "__main__":
    main()
