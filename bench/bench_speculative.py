"""Speculative decoding on the GPU (device only): the shared kv-indices skip, and tokens/s with vs without.

1. **Draft step with and without the shared kv-indices pass**, for backends that build their own kv indices
   (FlashInfer MLA, our Triton MLA): ``speculative.shared_kv_indices=always`` runs the multi-step draft's
   shared pass anyway (what a leading engine did), ``auto`` skips it. For each, the draft decode phase of a
   round (plan every step + the captured draft graph: ``num_steps - 1`` draft forwards) is run back to back
   and timed on the GPU timeline (period per round, host planning included, as in the engine), and the pass
   alone is timed too. The skip must remove the pass's whole cost: saved ~= pass time.
2. **Decode tokens/s with vs without speculation**, same workload, same backend, CUDA graphs on: the engine's
   decode phase (with speculation: the rounds' emitted tokens over the sum of their draft, verify and
   draft-extend times), and the acceptance length.

Run: ``python bench/bench_speculative.py [--backends flashinfer_mla triton_mla] [--batch 32] [--context 1024]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import runtime.core.config  # noqa: F401
from containers import build
from runtime.app.report import SPEC_PHASES, _phases
from runtime.core.batch import ForwardMode, make_batch

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def _cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=overrides)


def _events_ms(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def _draft_runtime(backend: str, mode: str, bs: int, context: int, steps: int):
    """A runtime whose draft has one round of ``bs`` requests at ``context`` planned-ready; returns
    (runtime, graphs of draft_decode, ids, step-0 batch)."""
    rt = build(_cfg([
        "+deploy=h100_dsv3_tp8_spec", f"backend={backend}", f"speculative.shared_kv_indices={mode}",
        f"speculative.num_steps={steps}", f"graph.batch_sizes=[{bs}]", f"kv.max_requests={max(bs, 8)}",
        f"kv.num_pages={bs * (-(-(context + steps + 2) // 64)) + 8}", f"model.max_context={context + 64}",
        "workload=smoke", "check=off", "progress=false"]))  # the workload is unused: rounds are driven here
    c = rt.container
    slots = c.token_slots()
    rows = [slots.open() for _ in range(bs)]
    slots.reserve_many([(r, 0, context + steps + 2) for r in rows])
    for buf in c.draft_kv_pool().buffers:  # any finite latent rows: timing does not depend on values
        buf.normal_()
    table = c.req_to_token_pool().req_to_token
    locs = [int(table[r, context + 1]) for r in rows]
    step0 = make_batch(ForwardMode.DECODE, rows, [context + 1] * bs, [1] * bs, locs, rt.device.torch_device)
    ids = torch.randint(0, c.model_spec().vocab_size, (bs,), device=rt.device.torch_device)
    runner = c.graph_runner()
    runner.capture()
    graphs = runner.get("draft_decode")
    assert graphs.decision.graphed, graphs.decision.reason
    return rt, graphs, ids, step0


def draft_step(backend: str, bs: int, context: int, steps: int, iters: int = 400) -> list[dict]:
    """The draft step with the shared pass forced (``always``) and skipped (``auto``), measured interleaved in
    one process (host timings drift; alternating samples cancel the drift out of the difference)."""
    runs = {m: _draft_runtime(backend, m, bs, context, steps) for m in ("always", "auto")}
    prep: dict[str, list[float]] = {m: [] for m in runs}
    for i in range(iters + 20):
        for m, (_, graphs, ids, step0) in runs.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphs.prepare(ids, step0)  # every step's plan (and the shared pass, when on): host work
            t1 = time.perf_counter()
            graphs.replay()
            if i >= 20:
                prep[m].append((t1 - t0) * 1e6)
    torch.cuda.synchronize()
    rows = []
    for m, (rt, graphs, _, _) in runs.items():
        kernels = statistics.median(_events_ms(graphs.graphs[bs][0].replay, 100) for _ in range(5)) * 1e3
        kv_pass = rt.container.draft_kv_indices()
        pass_gpu = pass_host = 0.0
        if kv_pass is not None:
            step_batches = rt.container.draft_attention().step_batches
            pass_gpu = statistics.median(_events_ms(lambda p=kv_pass, sb=step_batches: p.run(sb), 100) for _ in range(5)) * 1e3
            samples = []
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                kv_pass.run(step_batches)
                samples.append((time.perf_counter() - t0) * 1e6)
            pass_host = statistics.median(samples)
        prepare = statistics.median(prep[m])
        rows.append({"backend": backend, "mode": m, "prepare_us": prepare, "kernels_us": kernels,
                     "period_us": prepare + kernels, "pass_us": pass_gpu, "pass_host_us": pass_host,
                     "draft_steps": graphs.hooks.num_decode_steps})
    del runs
    torch.cuda.empty_cache()
    return rows


def tokens_per_s(backend: str, spec: bool, bs: int, prompt: int, out_len: int, layers: int, draft_layers: int) -> dict:
    pages = bs * -(-(prompt + out_len + 8) // 64) + 16
    rt = build(_cfg([
        "+deploy=h100_dsv3_tp8_spec", f"backend={backend}", f"speculative.enabled={str(spec).lower()}",
        f"speculative.draft_layers={draft_layers}", f"model.num_layers={layers}", "check=off", "progress=false",
        f"workload.num_requests={bs}", f"workload.max_running_requests={bs}", f"kv.max_requests={max(bs, 8)}",
        "workload.prompt_len.dist=fixed", f"workload.prompt_len.mean={prompt}", f"workload.prompt_len.min={prompt}",
        f"workload.prompt_len.max={prompt}", "workload.output_len.dist=fixed", f"workload.output_len.mean={out_len}",
        f"workload.output_len.min={out_len}", f"workload.output_len.max={out_len}",
        "workload.chunked_prefill_size=8192", "workload.max_tokens_per_batch=16384", f"kv.num_pages={pages}",
        f"graph.batch_sizes=[{bs}]"]))  # smaller batches pad up to it
    res = rt.engine.run(record_hidden=False)
    dec = _phases(res)["decode"]
    # wall clock on the GPU timeline from the first decode-phase start to the last end: counts the gaps
    # between steps too (a speculative round waits for its verify results on the host)
    recs = [s for s in res.steps if s.phase in (SPEC_PHASES if spec else ("decode",))]
    span_s = recs[0].marks[0].elapsed_time(recs[-1].marks[1]) / 1e3
    st = rt.container.speculative().stats if spec else None
    out = {"backend": backend, "spec": spec, "tokens_per_s": dec["tokens_per_s"], "tokens": dec["tokens"],
           "span_tokens_per_s": dec["tokens"] / span_s,
           "acceptance_length": st.acceptance_length if st else 1.0,
           "graphed": {m: g.decision.graphed for m, g in rt.container.graph_runner().modes.items()}}
    del rt
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", nargs="+", default=["flashinfer_mla", "triton_mla"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4, help="speculative.num_steps (draft decode steps = steps - 1)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--draft-layers", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--out-len", type=int, default=128)
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()

    rows = [r for b in args.backends for r in draft_step(b, args.batch, args.context, args.steps)]
    print(f"\ndraft decode phase per round ({dev}): DeepSeek-V3 TP8 shapes, draft = 1 layer, batch {args.batch}, "
          f"context {args.context}, {args.steps - 1} draft steps in one CUDA graph")
    print("draft step = host prepare (plans of every step, + the shared pass when on) + the draft graph's kernels")
    print(f"{'backend':<16}{'kv pass':>9}{'step us':>9}{'prepare us':>12}{'kernels us':>12}{'pass us (gpu/host)':>20}"
          f"{'saved us':>10}{'% of step':>11}")
    for b in args.backends:
        on, off = [r for r in rows if r["backend"] == b]
        for r in (on, off):
            print(f"{b:<16}{r['mode']:>9}{r['period_us']:>9.1f}{r['prepare_us']:>12.1f}{r['kernels_us']:>12.1f}"
                  f"{r['pass_us']:>11.1f}/{r['pass_host_us']:<8.1f}" + (
                      f"{on['period_us'] - off['period_us']:>10.1f}"
                      f"{100 * (on['period_us'] - off['period_us']) / on['period_us']:>11.1f}%"
                      if r is off else ""))

    def mean_of_runs(*a) -> dict:  # host-bound rounds are noisy: the mean of two runs
        runs = [tokens_per_s(*a) for _ in range(2)]
        out = dict(runs[0])
        for key in ("tokens_per_s", "span_tokens_per_s", "acceptance_length"):
            out[key] = statistics.mean(r[key] for r in runs)
        return out

    tps = []
    for b in args.backends:
        tps.append(mean_of_runs(b, False, args.batch, args.context, args.out_len, args.layers, 1))
        for d in args.draft_layers:
            r = mean_of_runs(b, True, args.batch, args.context, args.out_len, args.layers, d)
            r["draft_layers"] = d
            tps.append(r)
    print(f"\ndecode tokens/s, {args.layers} layers DeepSeek-V3 TP8, batch {args.batch}, prompt {args.context}, "
          f"output {args.out_len}, CUDA graphs ({dev})")
    print("tok/s: tokens over the decode steps' summed GPU time; wall: over the GPU-timeline span from the first "
          "decode step to the last (host gaps included)")
    print(f"{'backend':<16}{'speculation':>16}{'accept len':>12}{'tok/s':>10}{'vs plain':>10}{'wall tok/s':>12}"
          f"{'vs plain':>10}  graphed modes")
    for b in args.backends:
        base = next(r for r in tps if r["backend"] == b and not r["spec"])
        for r in [x for x in tps if x["backend"] == b]:
            name = f"k={args.steps} draft {r['draft_layers']}L" if r["spec"] else "off"
            graphed = ",".join(m for m, g in r["graphed"].items() if g) or "none"
            print(f"{b:<16}{name:>16}{r['acceptance_length']:>12.2f}{r['tokens_per_s']:>10.0f}"
                  f"{r['tokens_per_s'] / base['tokens_per_s']:>9.2f}x{r['span_tokens_per_s']:>12.0f}"
                  f"{r['span_tokens_per_s'] / base['span_tokens_per_s']:>9.2f}x  {graphed}")


if __name__ == "__main__":
    main()
