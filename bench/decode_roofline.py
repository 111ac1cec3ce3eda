"""Decode roofline: what a decode step must read, how long its kernels take, how long the GPU idles.

``python -m bench.decode_roofline [--preset h100_dsv3_tp8] [--batches 1 32 256] [--layers auto]
[--overlap on off] [--fused off auto] [--gemv-rows 16 0] [--pdl on off] [--kernels]``

Per (overlap mode, batch size), on a decode-heavy workload (every request prefilled at once, then decoded
together under CUDA-graph replay):

* kernel us/step: union of GPU activity (kernels, copies, memsets; torch.profiler, CUDA activity only) over
  the decode window, per decode step. The window is placed on the profiler's clock from the run's own CUDA
  events: it ends at the run's last GPU activity and lasts from the first decode step's start event to the
  last step's end event;
* period us/step: median start-to-start time of the decode steps (CUDA events) in a second, unprofiled run
  (the profiler's activity tracing slows every launch on the host); idle us/step: that period minus the
  kernel time; bubble us/step: the gaps under BUBBLE_US (10 us) between GPU activities of the profiled window,
  the GPU's own launch latency between the graph's kernels; host_idle us/step: idle minus bubbles, what the
  host costs a served step (the goal column judges it: <= 30 us); idle_profiled: the profiled window minus
  the union;
* bytes/step: weights the step reads (what the model object reports: every tensor of every layer, the
  final norm and LM head, one embedding row per request; with MoE the routed experts only, once the model
  reports them), KV read (every request's cached rows, every MLA layer) and KV written;
* roofline us = bytes / copy bandwidth measured in the same run; ratio = roofline / kernel time; step_ratio =
  roofline / period (what a served step gets: the bubbles between kernels count, and so does the time a kernel
  launched early with PDL spends waiting for its predecessor, which the union counts as busy);
* kernels per layer: kernels in the window per step, divided by the layer count;
* tok_s: batch / period (tokens a served decode step gives per second); peak_gib: the most device memory the
  run's allocator held (weights, KV pool, workspaces, graphs' pools: what the deployment needs);
* ``--fused off auto``: ``model.fused`` values to measure (the unfused torch decoder and the fused kernels in
  one run);
* ``--gemv-rows 16 0``: ``model.gemv_rows`` values to measure (the few-row Triton products and cuBLAS / the
  grouped expert GEMM in one run);
* ``--weights bf16 fp8``: ``model.weights`` values to measure (the preset's weights in bf16, or block-fp8 as the
  V3 release stores them; bytes/step counts the fp8 values and their scales as stored);
* ``--pdl on off``: ``model.pdl`` values to measure (programmatic dependent launch of the fused kernels and of
  triton_mla's decode kernels);
* ``--kernels``: a per-kernel breakdown of the decode window (from the same profile's trace: kernel name,
  launches per step and per layer, us per step, share of the kernel time), one table per row, top 40 by time.

``--layers auto`` fits the layer count to the GPU: weights and KV pool for the largest batch in 80% of the
free memory, at most the model's full depth (DeepSeek-V3: 61). ``--quick``: batches 1 and 32, 8 layers,
16 steps. Prints the table and the ``BENCH_JSON`` line (bench/harness.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a file: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import runtime.core.config  # noqa: E402, F401  (registers the schemas)
from bench.engine_config import compose_config, decode_periods_us, preset_overrides  # noqa: E402
from bench.harness import Table, measure_ceilings, report  # noqa: E402
from containers import build  # noqa: E402
from runtime.model.deepseek.weights import AttentionWeights, MoEWeights  # noqa: E402
from runtime.model.quantized import BlockFP8  # noqa: E402

FULL_DEPTH = 61  # DeepSeek-V3


def overrides(preset: str, bs: int, layers: int, prompt: int, out_len: int, overlap: str,
              fused: str = "auto", gemv_rows: int = 16, pdl: str = "on", extra: tuple[str, ...] = ()) -> list[str]:
    """The preset's run at one point of the sweep; ``extra``: more Hydra overrides (``--set``), applied last."""
    return [*preset_overrides(preset, bs, layers, prompt, out_len), "workload.chunked_prefill_size=8192",
            "workload.max_tokens_per_batch=16384", f"engine.overlap={overlap}", f"model.fused={fused}",
            f"model.gemv_rows={gemv_rows}", f"model.pdl={pdl == 'on'}", *extra]


def fit_layers(preset: str, bs: int, prompt: int, out_len: int) -> int:
    """Layers whose weights and KV pool (for ``bs``) fit in 80% of the free GPU memory. A build of the dense
    layers plus one MoE layer reports each kind's bytes (a MoE layer holds every expert: ~16x a dense one in
    DeepSeek-V3's TP8 shapes)."""
    first_k = compose_config(overrides(preset, bs, 1, prompt, out_len, "off")).model.get("first_k_dense_replace")
    n0 = min(FULL_DEPTH, int(first_k or 0) + 1)
    rt = build(compose_config(overrides(preset, bs, n0, prompt, out_len, "off")))
    model, kv = rt.container.model(), rt.container.kv_pool()
    w = model.weights
    head = _nbytes(w.embed, w.final_norm, w.lm_head)
    layer_bytes = [_nbytes(*lw.tensors) for lw in w.layers]
    kv_per_layer = kv.nbytes / n0
    del rt, model, kv, w
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    return layers_that_fit(layer_bytes, kv_per_layer, 0.8 * free - head, FULL_DEPTH)


def layers_that_fit(layer_bytes: list[int], kv_per_layer: float, budget: float, max_layers: int) -> int:
    """The most layers (at least 1, at most ``max_layers``) whose weights and KV fit ``budget`` bytes; layers
    past ``len(layer_bytes)`` weigh as the last one (the model's remaining layers are of its kind)."""
    n, used = 0, 0.0
    while n < max_layers:
        cost = layer_bytes[min(n, len(layer_bytes) - 1)] + kv_per_layer
        if used + cost > budget:
            break
        used, n = used + cost, n + 1
    return max(1, n)


def _nbytes(*tensors) -> int:
    """Bytes of tensors and block-fp8 weights (values and scales) as stored; None counts 0."""
    return sum(t.nbytes if isinstance(t, BlockFP8) else t.numel() * t.element_size()
               for t in tensors if t is not None)


def expected_experts_hit(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts ``tokens`` tokens route to, in expectation under uniform routing:
    E (1 - (1 - k/E)^T)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def step_bytes(rt, bs: int, mean_len: float) -> dict:
    """Bytes one decode step of ``bs`` requests of ``mean_len`` cached tokens must move: every attention and
    dense weight, of the routed experts only those the step's tokens are expected to reach (uniform routing),
    the shared experts, the LM head, ``bs`` embedding rows, and the KV read and written."""
    model, kv = rt.container.model(), rt.container.kv_pool()
    spec, w = model.spec, model.weights
    row = kv.row_dim * kv.dtype.itemsize
    mla_layers = len(spec.kv_cache_layers)
    layer_weights = 0
    for lw in w.layers:
        layer_weights += sum(_nbytes(t) for t in vars(lw.attn).values() if isinstance(t, (torch.Tensor, BlockFP8)))
        if isinstance(lw.attn, AttentionWeights) and lw.attn.indexer is not None:
            layer_weights += _nbytes(*lw.attn.indexer.tensors)
        layer_weights += _nbytes(lw.mlp_norm)
        mlp = lw.mlp
        if mlp is None:
            continue
        if isinstance(mlp, MoEWeights):  # router, the routed experts reached, the shared experts
            e = mlp.gate_up.shape[0]
            hit = expected_experts_hit(e, spec.num_experts_per_tok, bs)
            layer_weights += _nbytes(mlp.gate, mlp.bias) + int(_nbytes(mlp.gate_up, mlp.down) * hit / e)
            if mlp.shared is not None:
                layer_weights += _nbytes(mlp.shared.gate_up, mlp.shared.down)
        else:
            layer_weights += _nbytes(mlp.gate_up, mlp.down)
    head = _nbytes(w.final_norm, w.lm_head)
    embed_rows = bs * w.embed.shape[1] * w.embed.element_size()
    return {"weights": layer_weights + head + embed_rows, "kv_read": int(bs * mean_len * row * mla_layers),
            "kv_written": bs * row * mla_layers}


def gpu_events(prof) -> list[tuple[float, float, str, str]]:
    """(start us, end us, category, name) of every GPU activity in the profile, sorted."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    out = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e["cat"], e.get("name", "?")) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(out)


def gpu_intervals(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, category) of every GPU activity in the profile, sorted."""
    return [(s, e, c) for s, e, c, _ in gpu_events(prof)]


def short_name(name: str, width: int = 70) -> str:
    """A kernel's name without template arguments and parameter lists, clipped to ``width``."""
    out, depth = [], 0
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    s = "".join(out).strip() or name
    return s if len(s) <= width else s[: width - 1] + "~"


def kernel_breakdown(events, lo: float, hi: float, steps: int, layers: int, top: int = 40) -> list[dict]:
    """Kernels that start in [lo, hi), grouped by (short) name: launches per step and per layer, µs per step from
    start to end (``us_per_step``: a PDL launch starts while the kernel ahead of it runs and waits for it, so its
    span counts that wait) and the time it alone adds (``own_us_per_step``: from the later of its start and the end
    of every GPU activity that started before it, to its end; the own times sum to the union of GPU activity),
    ``share`` of the summed own time; the ``top`` by own time, then one row for the rest."""
    acc: dict[str, list[float]] = {}
    covered = float("-inf")
    for s, e, c, name in events:  # sorted by start
        if c == "kernel" and lo <= s < hi:
            a = acc.setdefault(short_name(name), [0, 0.0, 0.0])
            a[0] += 1
            a[1] += e - s
            a[2] += max(0.0, min(e, hi) - max(s, covered))
        covered = max(covered, e)
    total = sum(own for _, _, own in acc.values()) or 1.0
    rows = [{"kernel": k, "per_step": n / steps, "per_layer": n / steps / layers, "us_per_step": t / steps,
             "own_us_per_step": own / steps, "share": own / total}
            for k, (n, t, own) in sorted(acc.items(), key=lambda kv: -kv[1][2])]
    if len(rows) > top:
        rest = rows[top:]
        rows = rows[:top] + [{"kernel": f"({len(rest)} others)",
                              **{key: sum(r[key] for r in rest) for key in ("per_step", "per_layer", "us_per_step",
                                                                            "own_us_per_step", "share")}}]
    return rows


#: kernel_breakdown's columns and their formats in the benches' tables
BREAKDOWN_COLUMNS = ["kernel", "per_step", "per_layer", "us_per_step", "own_us_per_step", "share"]
BREAKDOWN_FORMATS = {"per_step": ".1f", "per_layer": ".2f", "us_per_step": ".1f", "own_us_per_step": ".1f",
                     "share": ".3f"}


def union_us(iv: list[tuple[float, float, str]], lo: float, hi: float) -> float:
    busy, cur_s, cur_e = 0.0, None, None
    for s, e, _ in iv:
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            busy += (cur_e - cur_s) if cur_e is not None else 0.0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + ((cur_e - cur_s) if cur_e is not None else 0.0)


#: A gap between GPU activities shorter than this is a bubble between kernels inside the replayed graph (the
#: GPU's own launch latency); a longer one is the GPU waiting for the host.
BUBBLE_US = 10.0


def gaps_us(iv: list[tuple[float, float, str]], lo: float, hi: float) -> list[float]:
    """The idle gaps between GPU activities (their union) inside [lo, hi)."""
    gaps, cur_e = [], None
    for s, e, _ in iv:
        s, e = max(s, lo), min(e, hi)
        if e <= s:
            continue
        if cur_e is not None and s > cur_e:
            gaps.append(s - cur_e)
        cur_e = e if cur_e is None else max(cur_e, e)
    return gaps


def decode_window(prof, dec) -> tuple[list[tuple[float, float, str, str]], float, float]:
    """(the profile's GPU events, start us, end us) of the window the decode steps ``dec`` (their CUDA-event marks)
    span, placed at the end of the trace: the profiled run ends with them."""
    span_us = dec[0].marks[0].elapsed_time(dec[-1].marks[1]) * 1e3
    ev = gpu_events(prof)
    end = max(e for _, e, _, _ in ev)
    return ev, end - span_us, end


def run_one(preset: str, bs: int, layers: int, prompt: int, out_len: int, overlap: str, fused: str = "auto",
            kernels: bool = False, gemv_rows: int = 16, pdl: str = "on", extra: tuple[str, ...] = ()) -> dict:
    torch.cuda.reset_peak_memory_stats()
    rt = build(compose_config(overrides(preset, bs, layers, prompt, out_len, overlap, fused, gemv_rows, pdl, extra)))
    rt.engine.run(record_hidden=False)  # warm-up: capture, JIT, allocator caches
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        res = rt.engine.run(record_hidden=False)
    torch.cuda.synchronize()
    dec = [s for s in res.steps if s.phase == "decode" and s.batch_size == bs]
    ev, lo, end = decode_window(prof, dec)
    span_us = end - lo
    iv = [(s, e, c) for s, e, c, _ in ev]
    busy = union_us(iv, lo, end)
    n_kernels = sum(1 for s, _, c in iv if c == "kernel" and s >= lo)
    n = len(dec)
    # The profiler's CUDA activity tracing slows every launch on the host, so the profiled window's idle time
    # overstates what the host costs. One more run without it: the median start-to-start period of its decode
    # steps (CUDA events), minus the profiled kernel time, is the idle a served step sees.
    periods = decode_periods_us(rt.engine.run(record_hidden=False), bs)
    period = statistics.median(periods) if periods else span_us / n  # one decode step: the profiled span
    b = step_bytes(rt, bs, prompt + out_len / 2)
    total = sum(b.values())
    kernel_us = busy / n
    bubble_us = sum(g for g in gaps_us(iv, lo, end) if g < BUBBLE_US) / n
    out = {"overlap": overlap, "fused": fused, "gemv_rows": gemv_rows, "pdl": pdl, "bs": bs, "layers": layers,
           "steps": n, "kernel_us": kernel_us,
           "idle_us": max(0.0, period - kernel_us), "period_us": period, "bubble_us": bubble_us,
           "host_idle_us": max(0.0, period - kernel_us - bubble_us),
           "idle_profiled_us": (span_us - busy) / n, **{f"{k}_bytes": v for k, v in b.items()},
           "bytes": total, "kernels_per_layer": n_kernels / n / layers,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "tok_s": bs * 1e6 / period,
           "graphed": sum(s.graphed for s in dec)}
    if kernels:
        out["breakdown"] = kernel_breakdown(ev, lo, end, n, layers)
    del rt, res, prof
    torch.cuda.empty_cache()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_roofline", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="h100_dsv3_tp8")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32, 256])
    ap.add_argument("--layers", default="auto", help="a number, or auto (fit the GPU, at most 61)")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--overlap", nargs="+", default=["on"], help="engine.overlap values to measure")
    ap.add_argument("--fused", nargs="+", default=["auto"], help="model.fused values to measure (off auto on)")
    ap.add_argument("--gemv-rows", nargs="+", type=int, default=[16],
                    help="model.gemv_rows values to measure (0: cuBLAS and the grouped expert GEMM)")
    ap.add_argument("--pdl", nargs="+", default=["on"], choices=["on", "off"],
                    help="model.pdl values to measure (programmatic dependent launch of the fused kernels and of "
                         "triton_mla's decode kernels)")
    ap.add_argument("--weights", nargs="+", default=["bf16"], choices=["bf16", "fp8"],
                    help="model.weights values to measure (a preset's weights in bf16 or block-fp8)")
    ap.add_argument("--kernels", action="store_true", help="per-kernel breakdown of the decode window")
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                    help="more Hydra overrides for every run, e.g. backend.kernel=fa2")
    ap.add_argument("--quick", action="store_true", help="batches 1 and 32, 8 layers, 16 steps")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.batches, args.layers, args.out_len = [1, 32], "8", 16
    layers = (fit_layers(args.preset, max(args.batches), args.prompt, args.out_len) if args.layers == "auto"
              else int(args.layers))
    ceilings = measure_ceilings()
    rows = [{"weights": wf, **run_one(args.preset, bs, layers, args.prompt, args.out_len, ov, fu, args.kernels, g,
                                      pdl, (*args.set, f"model.weights={wf}"))}
            for wf in args.weights for fu in args.fused for g in args.gemv_rows for pdl in args.pdl
            for ov in args.overlap for bs in args.batches]
    breakdowns = [r.pop("breakdown") for r in rows if "breakdown" in r]
    for r in rows:
        r["roofline_us"] = r["bytes"] / (ceilings.copy_gbs * 1e3)
        r["ratio"] = r["roofline_us"] / r["kernel_us"]
        r["step_ratio"] = r["roofline_us"] / r["period_us"]
        r["mb_per_step"] = r["bytes"] / 1e6
        r["idle_goal"] = "ok" if r["host_idle_us"] <= 30 else "MISS"
    cols = ["weights", "fused", "gemv_rows", "pdl", "overlap", "bs", "kernel_us", "period_us", "idle_us", "bubble_us",
            "host_idle_us", "idle_profiled_us", "mb_per_step", "roofline_us", "ratio", "step_ratio",
            "kernels_per_layer", "tok_s", "peak_gib", "idle_goal"]
    fmt = {"kernel_us": ".1f", "period_us": ".1f", "idle_us": ".1f", "bubble_us": ".1f", "host_idle_us": ".1f",
           "idle_profiled_us": ".1f", "mb_per_step": ".1f", "roofline_us": ".1f", "ratio": ".2f", "step_ratio": ".2f",
           "kernels_per_layer": ".1f", "tok_s": ".1f", "peak_gib": ".1f"}
    title = (f"decode roofline: {args.preset}{''.join(' ' + o for o in args.set)}, {layers} layers, prompt "
             f"{args.prompt}, {args.out_len} steps, CUDA graphs; roofline = bytes / copy bandwidth")
    tables = [Table(b, f"kernels of the decode window: weights={r['weights']} fused={r['fused']} "
                       f"gemv_rows={r['gemv_rows']} pdl={r['pdl']} "
                       f"overlap={r['overlap']} bs={r['bs']}, "
                       f"{layers} layers", BREAKDOWN_COLUMNS, BREAKDOWN_FORMATS, name="kernels")
              for r, b in zip(rows, breakdowns)]
    report("decode_roofline", ceilings, tables + [Table(rows, title, cols, fmt, name="roofline")],
           meta={"preset": args.preset, "set": args.set, "layers": layers, "prompt": args.prompt,
                 "out_len": args.out_len})


if __name__ == "__main__":
    main()
