"""Engine decode steps under CUDA-graph replay: GPU idle time per step (device only).

For each backend preset and batch size, runs the engine on a decode-heavy workload (prompts of 1024,
outputs of 64, every request running at once) and measures, on the GPU timeline:

* step period: median time between the end events of consecutive decode steps of the full batch (what a
  step costs, host work and gaps included);
* kernel time: the same step's captured graph replayed back to back 50 times (the GPU never waits;
  :func:`bench.harness.loop_ms`);
* idle = period - kernel time. Goal: <= 30 us at batch <= 256.

The model is DeepSeek-V3 at TP8 (16 heads) with all 61 layers by default (seeded random weights, 4.5 GB).
``--quick``: 8 layers, batches 1 and 32, outputs of 32 (a smoke run of the same measurement).

Run: ``python -m bench.bench_engine_decode [--quick] [--presets h100_dsv3_tp8 h100_triton_tp8] [--batches 1 32 256]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.engine_config import compose_config, fixed_workload  # noqa: E402
from bench.harness import Table, loop_ms, measure_ceilings, report  # noqa: E402

GOAL_IDLE_US = 30.0


def run_one(preset: str, bs: int, layers: int, prompt: int, out_len: int) -> dict:
    """One engine run of ``bs`` requests; the decode step's period, graph kernel time and idle, in us."""
    from containers import build

    pages = bs * -(-(prompt + out_len) // 64) + 16
    cfg = compose_config([
        f"+deploy={preset}", "check=off", "progress=false", f"model.num_layers={layers}",
        *fixed_workload(bs, prompt, out_len),
        "workload.chunked_prefill_size=8192", "workload.max_tokens_per_batch=16384",
        f"kv.num_pages={pages}", f"kv.max_requests={max(bs, 8)}", f"graph.batch_sizes=[{bs}]",
    ])
    rt = build(cfg)
    res = rt.engine.run(record_hidden=False)
    full = [s for s in res.steps if s.phase == "decode" and s.batch_size == bs]
    ends = [s.marks[1] for s in full]
    periods = [a.elapsed_time(b) for a, b in zip(ends[:-1], ends[1:])][2:]  # skip the first steps
    runner = rt.container.graph_runner().get("decode")
    graph = runner.graphs[bs][0][0]
    kernel_ms = loop_ms(graph.replay, 50, warmup=5)
    period_ms = statistics.median(periods)
    out = {"preset": preset, "batch": bs, "step_us": period_ms * 1e3, "kernels_us": kernel_ms * 1e3,
           "idle_us": (period_ms - kernel_ms) * 1e3, "steps": len(periods), "replays": runner.replays}
    out["goal"] = "ok" if out["idle_us"] <= GOAL_IDLE_US else "MISS"
    del rt
    torch.cuda.empty_cache()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 layers, batches 1 and 32, outputs of 32")
    ap.add_argument("--presets", nargs="+", default=["h100_dsv3_tp8", "h100_triton_tp8"])
    ap.add_argument("--batches", nargs="+", type=int, default=None, help="default 1 32 256 (--quick: 1 32)")
    ap.add_argument("--layers", type=int, default=None,
                    help="default 61, DeepSeek-V3's (the whole model's decode step); --quick: 8")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--out-len", type=int, default=None, help="default 64 (--quick: 32)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    batches = args.batches or ([1, 32] if args.quick else [1, 32, 256])
    layers = args.layers or (8 if args.quick else 61)
    out_len = args.out_len or (32 if args.quick else 64)
    ceil = measure_ceilings()
    print(f"[ceilings] {ceil.summary()}", flush=True)
    rows = []
    for p in args.presets:
        for bs in batches:
            rows.append(run_one(p, bs, layers, args.prompt, out_len))
            r = rows[-1]
            print(f"[{p} batch {bs}] step {r['step_us']:.1f} us, kernels {r['kernels_us']:.1f} us, "
                  f"idle {r['idle_us']:.1f} us", flush=True)
    table = Table(rows, title=f"engine decode step, {layers} layers, CUDA graph replay, prompt {args.prompt}, "
                              f"output {out_len} (goal: idle <= {GOAL_IDLE_US:.0f} us)",
                  columns=["preset", "batch", "step_us", "kernels_us", "idle_us", "goal"],
                  formats={"step_us": ".1f", "kernels_us": ".1f", "idle_us": ".1f"})
    report("bench_engine_decode", ceil, table,
           meta={"layers": layers, "prompt": args.prompt, "out_len": out_len, "quick": args.quick})


if __name__ == "__main__":
    main()
