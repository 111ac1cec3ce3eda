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

``--quick``: 100 interleaved samples, 4 layers, draft of 1 layer, outputs of 32, one run per tokens/s row.

Run: ``python -m bench.bench_speculative [--quick] [--backends flashinfer_mla triton_mla] [--batch 32]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.engine_config import compose_config as _cfg  # noqa: E402
from bench.engine_config import fixed_workload  # noqa: E402
from bench.harness import Table, host_us, loop_ms, measure_ceilings, report  # noqa: E402
from containers import build  # noqa: E402
from runtime.app.report import SPEC_PHASES, _phases  # noqa: E402
from runtime.core.batch import ForwardMode, make_batch  # noqa: E402


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
        kernels = statistics.median(loop_ms(graphs.graphs[bs][0].replay, 100) for _ in range(5)) * 1e3
        kv_pass = rt.container.draft_kv_indices()
        pass_gpu = pass_host = 0.0
        if kv_pass is not None:
            step_batches = rt.container.draft_attention().step_batches
            pass_gpu = statistics.median(loop_ms(lambda p=kv_pass, sb=step_batches: p.run(sb), 100)
                                         for _ in range(5)) * 1e3
            pass_host = host_us(lambda p=kv_pass, sb=step_batches: p.run(sb), iters, sync_each=True)
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
        *fixed_workload(bs, prompt, out_len), f"kv.max_requests={max(bs, 8)}",
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="100 samples, 4 layers, draft of 1 layer, outputs of 32, one run per tokens/s row")
    ap.add_argument("--backends", nargs="+", default=["flashinfer_mla", "triton_mla"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4, help="speculative.num_steps (draft decode steps = steps - 1)")
    ap.add_argument("--layers", type=int, default=None, help="default 8 (--quick: 4)")
    ap.add_argument("--draft-layers", nargs="+", type=int, default=None, help="default 1 2 (--quick: 1)")
    ap.add_argument("--out-len", type=int, default=None, help="default 128 (--quick: 32)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    quick = args.quick
    layers = args.layers or (4 if quick else 8)
    draft_layers = args.draft_layers or ([1] if quick else [1, 2])
    out_len = args.out_len or (32 if quick else 128)
    iters, runs = (100, 1) if quick else (400, 2)
    ceil = measure_ceilings()
    print(f"[ceilings] {ceil.summary()}", flush=True)

    rows = [r for b in args.backends for r in draft_step(b, args.batch, args.context, args.steps, iters)]
    draft_rows = []
    for b in args.backends:
        on, off = [r for r in rows if r["backend"] == b]
        for r in (on, off):
            saved = on["period_us"] - off["period_us"] if r is off else None
            draft_rows.append({"backend": b, "kv_pass": r["mode"], "step_us": r["period_us"],
                               "prepare_us": r["prepare_us"], "kernels_us": r["kernels_us"],
                               "pass_gpu_us": r["pass_us"], "pass_host_us": r["pass_host_us"], "saved_us": saved,
                               "saved_pct_of_step": None if saved is None else 100 * saved / on["period_us"]})
    one_decimal = {k: ".1f" for k in draft_rows[0] if k.endswith(("_us", "_step"))}
    draft = Table(draft_rows, name="draft_step", formats=one_decimal,
                  title=f"draft decode phase per round: DeepSeek-V3 TP8 shapes, draft = 1 layer, batch {args.batch}, "
                        f"context {args.context}, {args.steps - 1} draft steps in one CUDA graph\n"
                        "draft step = host prepare (plans of every step, + the shared pass when on) + the draft "
                        "graph's kernels")
    print(draft.render(), flush=True)

    def mean_of_runs(*a) -> dict:  # host-bound rounds are noisy: the mean of two runs (one with --quick)
        results = [tokens_per_s(*a) for _ in range(runs)]
        out = dict(results[0])
        for key in ("tokens_per_s", "span_tokens_per_s", "acceptance_length"):
            out[key] = statistics.mean(r[key] for r in results)
        return out

    tps = []
    for b in args.backends:
        tps.append(mean_of_runs(b, False, args.batch, args.context, out_len, layers, 1))
        for d in draft_layers:
            r = mean_of_runs(b, True, args.batch, args.context, out_len, layers, d)
            r["draft_layers"] = d
            tps.append(r)
    tok_rows = []
    for b in args.backends:
        base = next(r for r in tps if r["backend"] == b and not r["spec"])
        for r in [x for x in tps if x["backend"] == b]:
            tok_rows.append({
                "backend": b, "speculation": f"k={args.steps} draft {r['draft_layers']}L" if r["spec"] else "off",
                "accept_len": r["acceptance_length"], "tok_s": r["tokens_per_s"],
                "vs_plain": r["tokens_per_s"] / base["tokens_per_s"], "wall_tok_s": r["span_tokens_per_s"],
                "wall_vs_plain": r["span_tokens_per_s"] / base["span_tokens_per_s"],
                "graphed": ",".join(m for m, g in r["graphed"].items() if g) or "none"})
    tok = Table(tok_rows, name="tokens_per_s",
                formats={"accept_len": ".2f", "tok_s": ".0f", "vs_plain": ".2f", "wall_tok_s": ".0f",
                         "wall_vs_plain": ".2f"},
                title=f"decode tokens/s, {layers} layers DeepSeek-V3 TP8, batch {args.batch}, prompt {args.context}, "
                      f"output {out_len}, CUDA graphs\ntok/s: tokens over the decode steps' summed GPU time; wall: "
                      "over the GPU-timeline span from the first decode step to the last (host gaps included)")
    report("bench_speculative", ceil, [draft, tok],
           meta={"batch": args.batch, "context": args.context, "steps": args.steps, "layers": layers,
                 "draft_layers": draft_layers, "out_len": out_len, "quick": quick})


if __name__ == "__main__":
    main()
