"""Engine decode steps under CUDA-graph replay: GPU idle time per step (device only).

For each backend preset and batch size, runs the engine on a decode-heavy workload (prompts of 1024,
outputs of 64, every request running at once) and measures, on the GPU timeline:

* step period: median time between the end events of consecutive decode steps of the full batch (what a
  step costs, host work and gaps included);
* kernel time: the same step's captured graph replayed back to back 50 times (the GPU never waits);
* idle = period - kernel time. Goal: <= 30 us at batch <= 256.

The model is DeepSeek-V3 at TP8 (16 heads) with all 61 layers by default (seeded random weights, 4.5 GB).

Run: ``python bench/bench_engine_decode.py [--presets h100_dsv3_tp8 h100_triton_tp8] [--batches 1 32 128 256]``
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import runtime.core.config  # noqa: F401
from containers import build

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def run_one(preset: str, bs: int, layers: int, prompt: int, out_len: int) -> dict:
    pages = bs * -(-(prompt + out_len) // 64) + 16
    overrides = [
        f"+deploy={preset}", "check=off", "progress=false", f"model.num_layers={layers}",
        f"workload.num_requests={bs}", f"workload.max_running_requests={bs}",
        "workload.prompt_len.dist=fixed", f"workload.prompt_len.mean={prompt}", f"workload.prompt_len.min={prompt}",
        f"workload.prompt_len.max={prompt}", "workload.output_len.dist=fixed", f"workload.output_len.mean={out_len}",
        f"workload.output_len.min={out_len}", f"workload.output_len.max={out_len}",
        "workload.chunked_prefill_size=8192", "workload.max_tokens_per_batch=16384",
        f"kv.num_pages={pages}", f"kv.max_requests={max(bs, 8)}", f"graph.batch_sizes=[{bs}]",
    ]
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    rt = build(cfg)
    res = rt.engine.run(record_hidden=False)
    full = [s for s in res.steps if s.phase == "decode" and s.batch_size == bs]
    ends = [s.marks[1] for s in full]
    periods = [a.elapsed_time(b) for a, b in zip(ends[:-1], ends[1:])][2:]  # skip the first steps
    runner = rt.container.graph_runner().get("decode")
    graph = runner.graphs[bs][0][0]
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    end.synchronize()
    kernel_ms = start.elapsed_time(end) / 50
    period_ms = statistics.median(periods)
    out = {"preset": preset, "bs": bs, "period_us": period_ms * 1e3, "kernel_us": kernel_ms * 1e3,
           "idle_us": (period_ms - kernel_ms) * 1e3, "steps": len(periods), "replays": runner.replays}
    del rt
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["h100_dsv3_tp8", "h100_triton_tp8"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    ap.add_argument("--layers", type=int, default=61, help="DeepSeek-V3 has 61 (the whole model's decode step)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--out-len", type=int, default=64)
    args = ap.parse_args()
    rows = [run_one(p, bs, args.layers, args.prompt, args.out_len) for p in args.presets for bs in args.batches]
    print(f"\nengine decode step, {args.layers} layers, CUDA graph replay, prompt {args.prompt} "
          f"({torch.cuda.get_device_name()})")
    print(f"{'preset':<18}{'batch':>6}{'step us':>10}{'kernels us':>12}{'idle us':>10}{'goal':>8}")
    for r in rows:
        ok = "ok" if r["idle_us"] <= 30 else "MISS"
        print(f"{r['preset']:<18}{r['bs']:>6}{r['period_us']:>10.1f}{r['kernel_us']:>12.1f}{r['idle_us']:>10.1f}{ok:>8}")


if __name__ == "__main__":
    main()
