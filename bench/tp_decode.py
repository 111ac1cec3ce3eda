"""Tensor-parallel decode: tokens/s at several batch sizes, the collectives' time per step, the all-reduce bus
bandwidth of the same process group, and the generated tokens (for parity against tp=1).

One launch per configuration (``torchrun --nproc-per-node N`` for tp = N, plain ``python`` for tp=1)::

    python -m bench.tp_decode --out r1.json --model-path DIR [--dtype bfloat16] [--backend flashinfer_mla]
    torchrun --nproc-per-node 2 -m bench.tp_decode --out r2.json --model-path DIR --moe ep --sweep
    python -m bench.tp_decode --table r1.json r2.json ...       # the first file is the tp=1 reference

A run builds the runtime once (weights loaded once, graphs captured for every batch size), then per batch size
serves that many requests of ``--prompt`` tokens decoding ``--out-len`` tokens together, twice (the first run
warms up: autotuning, graph capture), and times the second: decode tokens/s from the engine's step records, and
per decode step the collectives' count, bytes and time (graphed steps: the probe of runtime/core/parallel.py,
the same collectives run alone). ``--sweep``: ``all_reduce`` of bf16 tensors from 64 KiB to ``--sweep-max``,
bus bandwidth = 2 (n - 1) / n x bytes / time (NCCL's convention), and per ``parallel.allreduce`` mode (nccl, nccl+norm,
oneshot, fused) the microseconds per call inside CUDA graphs for 1 .. 512 tokens x 7168 bf16 (14 KiB .. 7.3 MiB),
with the smallest message where NCCL wins: the measured crossing for ``parallel.oneshot_max_bytes``.
``--sweep-only``: that per-mode sweep alone, no model. ``--allreduce MODE``: the run's ``parallel.allreduce``.
``--profile`` (CUDA): per batch size one more serve under torch.profiler, read as the GPU ran the graphs: kernel
time per decode step, the collective kernels' part of it, and the costliest kernels. Rank 0 writes ``--out``.

``--table`` prints one row per file: tp, moe, dtype, tokens/s per batch, collective ms per decode step (and the
all-reduce bytes), the sweep's peak bus bandwidth, and token parity against the first file (requests whose
tokens differ, and whether the first difference of each is a near-tie of the reference: top-2 logit margin
below the parity check's tie margin for the dtype). Then the ``BENCH_JSON`` line (bench/harness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from dependency_injector import providers  # noqa: E402

from bench.engine_config import compose_config, fixed_workload  # noqa: E402
from bench.harness import Ceilings, Table, report  # noqa: E402
from containers import build  # noqa: E402
from runtime.app.parallel_report import phase_collectives, probe_graphed  # noqa: E402
from runtime.app.parity import TIE_MARGIN  # noqa: E402
from runtime.app.report import _phases  # noqa: E402
from runtime.core.parallel import LaunchEnv, shutdown  # noqa: E402
from runtime.engine.workload import Workload, synthetic_specs  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
#: kernels the --profile table names (the rest are one row)
TOP_KERNELS = 24


def overrides(a: argparse.Namespace, tp: int) -> list[str]:
    bs = max(a.batches)
    pages = bs * -(-(a.prompt + a.out_len + 1) // a.page_size) + 16
    out = [f"model.dtype={a.dtype}", f"backend={a.backend}", "check=off", "progress=false",
           f"parallel.tp={tp}", f"parallel.moe={a.moe}", f"parallel.allreduce={a.allreduce}", f"device={a.device}",
           *fixed_workload(bs, a.prompt, a.out_len), "workload.chunked_prefill_size=8192",
           "workload.max_tokens_per_batch=16384", f"kv.page_size={a.page_size}", f"kv.num_pages={pages}",
           f"kv.max_requests={max(bs, 8)}"]
    out += ["model=hf", f"model.path={a.model_path}"] if a.model_path else [f"model={a.preset}"]
    if a.layers:
        out.append(f"model.num_layers={a.layers}")
    if a.graphs:
        out += ["graph=decode", f"graph.batch_sizes=[{','.join(map(str, sorted(set(a.batches))))}]"]
    return out + a.extra


def serve(rt, specs) -> tuple[object, object]:
    """A fresh engine over the built model and graphs, serving ``specs``; (warm-up result, timed result)."""
    c = rt.container
    c.workload.override(providers.Object(Workload(tuple(specs))))
    c.engine.reset()
    engine = c.engine()
    return engine.run(record_hidden=False), engine.run(record_hidden=False)


#: the collectives' kernels by name: NCCL's, and the one-shot / fused all-reduce of backends/kernels/comm
COLLECTIVE_KERNELS = ("nccl", "oneshot_kernel", "fused_add_rms_norm_kernel")


def profile_decode(rt, specs, layers: int) -> dict:
    """One more serve of ``specs`` under torch.profiler (CUDA activity), the timed run's decode window read from
    the trace as the GPU ran the replayed graphs (the probe times the collectives eagerly between steps): per
    decode step the GPU's busy time, the collective kernels' (NCCL's and ours: the time they hold the GPU, waits
    for the peer included) and the rest's, and the costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    from bench.decode_roofline import decode_window, kernel_breakdown, union_us

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, res = serve(rt, specs)
    torch.cuda.synchronize()
    dec = [s for s in res.steps if s.phase == "decode"]
    ev, lo, end = decode_window(prof, dec)
    n = len(dec)
    busy = union_us([(s, e, c) for s, e, c, _ in ev], lo, end)
    coll = union_us([(s, e, c) for s, e, c, name in ev
                     if c == "kernel" and any(k in name.lower() for k in COLLECTIVE_KERNELS)], lo, end)
    return {"kernel_us_per_step": busy / n, "collective_us_per_step": coll / n,
            "other_us_per_step": (busy - coll) / n,
            "top": kernel_breakdown(ev, lo, end, n, layers, top=TOP_KERNELS)}


def sweep(group, max_bytes: int) -> list[dict]:
    """all_reduce of bf16 tensors, 64 KiB .. max_bytes (x4 each step): median seconds of 10 after 3 warm-ups."""
    rows, n = [], 64 * KiB
    while n <= max_bytes:
        x = torch.zeros(n // 2, dtype=torch.bfloat16, device=group.device)
        times = []
        for i in range(13):
            group.dist.barrier()
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            t0 = time.perf_counter()
            group.dist.all_reduce(x)
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        s = sorted(times)[len(times) // 2]
        rows.append({"bytes": n, "us": s * 1e6, "busbw_gbs": 2 * (group.size - 1) / group.size * n / s / 1e9})
        n *= 4
    return rows


SWEEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # x 7168 bf16: 14 KiB .. 917 KiB (decode), 1.8 .. 7.3 MiB


def _graph_us(fn, reps: int, device) -> float:
    """Microseconds per call of ``fn`` replayed from one CUDA graph of ``reps`` calls (median of 5 replays)."""
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(device).wait_stream(s)
    torch.distributed.barrier()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(6):
        torch.distributed.barrier()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times[1:])[2]


def mode_sweep(group, hidden: int = 7168, reps: int = 20) -> list[dict]:
    """Per message of ``SWEEP_TOKENS`` x hidden bf16: microseconds per call inside CUDA graphs of nccl (the
    torch.distributed all-reduce), oneshot, nccl+norm (all-reduce, then the add + RMSNorm kernel) and fused, and
    the bus bandwidth of nccl and oneshot. The CPU (gloo): nccl alone, eager. A collective: every rank calls it."""
    from backends.kernels.comm.peer_allreduce import make_collectives
    from backends.kernels.decoder import decoder_ops
    from runtime.core.workspace import WorkspaceLedger

    dev, cuda = group.device, group.device.type == "cuda"
    peer = make_collectives(group, WorkspaceLedger(dev), {"tp": group.size, "allreduce": "fused",
                            "oneshot_max_bytes": 0, "fused_max_bytes": 0, "ipc_buffer_bytes": 16 << 20}).peer \
        if cuda else None
    rows = []
    for t in SWEEP_TOKENS:
        x = torch.randn(t, hidden, device=dev).to(torch.bfloat16)
        res, w = torch.randn_like(x), torch.ones(hidden, device=dev, dtype=x.dtype)
        n = x.numel() * x.element_size()
        fns = {"nccl": lambda x=x: group.dist.all_reduce(x)}
        if cuda:
            fns["nccl+norm"] = lambda x=x, r=res, w=w: decoder_ops.add_rms_norm(r, group.dist.all_reduce(x) or x, w,
                                                                                1e-6)
        if peer is not None and peer.fits(x):
            fns["oneshot"] = lambda x=x: peer.all_reduce(x)
            fns["oneshot+norm"] = lambda x=x, r=res, w=w: decoder_ops.add_rms_norm(r, peer.all_reduce(x), w, 1e-6)
            fns["fused"] = lambda x=x, r=res, w=w: peer.all_reduce_add_rms_norm(x, r, w, 1e-6)
        row = {"tokens": t, "KiB": n / KiB}
        for name, fn in fns.items():
            if cuda:
                us = _graph_us(fn, reps, dev)
            else:
                group.dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                us = (time.perf_counter() - t0) * 1e6 / reps
            row[f"{name} us"] = us
            if name in ("nccl", "oneshot"):
                row[f"{name} busbw GB/s"] = 2 * (group.size - 1) / group.size * n / us / 1e3
        rows.append(row)
    return rows


def crossing(rows: list[dict]) -> str:
    """The smallest swept message where NCCL is faster than the one-shot kernel (the measured auto threshold)."""
    for r in rows:
        if "oneshot us" in r and r["nccl us"] < r["oneshot us"]:
            return f"{r['KiB']:.0f} KiB ({r['tokens']} tokens): set parallel.oneshot_max_bytes below {int(r['KiB'] * KiB)}"
    swept = [r for r in rows if "oneshot us" in r]
    return f"none up to {swept[-1]['KiB']:.0f} KiB (oneshot faster everywhere swept)" if swept else "no oneshot rows"


def fused_crossing(rows: list[dict]) -> str:
    """The smallest swept message where the fused kernel is slower than the one-shot kernel plus the norm kernel
    (the measured ``parallel.fused_max_bytes``)."""
    for r in rows:
        if "fused us" in r and r["fused us"] > r["oneshot+norm us"]:
            return f"{r['KiB']:.0f} KiB ({r['tokens']} tokens): set parallel.fused_max_bytes below {int(r['KiB'] * KiB)}"
    return "none swept (fused faster everywhere)" if any("fused us" in r for r in rows) else "no fused rows"


def run(a: argparse.Namespace) -> int:
    launch = LaunchEnv.from_environ()
    tp = launch.world_size
    try:
        if a.sweep_only:
            from runtime.core.parallel import make_group

            group = make_group(tp, a.device, 0, launch)
            rows = mode_sweep(group) if tp > 1 else []
            if launch.rank == 0:
                out = {"tp": tp, "device": torch.cuda.get_device_name(group.device) if group.device.type == "cuda"
                       else "cpu", "mode_sweep": rows, "crossing": crossing(rows),
                       "fused_crossing": fused_crossing(rows)}
                if a.out:
                    Path(a.out).write_text(json.dumps(out))
                report("tp_allreduce_sweep", Ceilings(out["device"], float("nan"), float("nan"), {}),
                       [Table(rows, title=f"all-reduce per mode inside CUDA graphs, tp={tp}, bf16 x 7168 "
                              f"(NCCL faster from: {out['crossing']}; fused slower from: {out['fused_crossing']})",
                              name="modes")], meta={})
            return 0
        t0 = time.perf_counter()
        rt = build(compose_config(overrides(a, tp)))
        load_s = time.perf_counter() - t0
        c = rt.container
        group, spec = c.tp_group(), c.full_model_spec()
        specs = synthetic_specs(rt.config["workload"], spec.vocab_size)
        out = {"tp": tp, "moe": a.moe, "dtype": a.dtype, "backend": a.backend, "graphs": a.graphs,
               "allreduce": c.collectives().mode if tp > 1 else "-",
               "device": rt.device.name, "build_s": load_s, "batches": {}, "outputs": {}, "margins": {}}
        for bs in sorted(set(a.batches)):
            _, res = serve(rt, specs[:bs])
            dec = [s for s in res.steps if s.phase == "decode"]
            coll = phase_collectives(dec, probe_graphed(c.collectives(), dec))
            out["batches"][bs] = {"decode_tok_s": _phases(res)["decode"]["tokens_per_s"],
                                  "step_ms": _phases(res)["decode"]["mean_step_ms"],
                                  "graphed_steps": coll["graphed_steps"], "coll_per_step": coll["count_per_step"],
                                  "coll_bytes_per_step": coll["bytes_per_step"], "coll_by_op": coll["by_op"],
                                  "coll_ms_per_step": coll["probe_ms_per_graphed_step"] if coll["graphed_steps"]
                                  else coll["ms_per_eager_step"]}
            if a.profile and rt.device.kind == "cuda":
                out["batches"][bs]["profile"] = profile_decode(rt, specs[:bs], rt.config["model"]["num_layers"])
            if bs == max(a.batches):
                out["outputs"] = {str(k): v for k, v in res.outputs.items()}
                out["margins"] = {str(k): v for k, v in res.margins.items()}
        agree = group.gather_objects(sorted(out["outputs"].items()))
        out["ranks_agree"] = all(x == agree[0] for x in agree)
        out["sweep"] = sweep(group, a.sweep_max) if a.sweep and tp > 1 else []
        out["mode_sweep"] = mode_sweep(group) if a.sweep and tp > 1 else []
        if rt.device.kind == "cuda":
            out["peak_gib_per_rank"] = [m / 2**30 for m in group.gather_objects(torch.cuda.max_memory_allocated())]
        if launch.rank == 0:
            if a.out:
                Path(a.out).write_text(json.dumps(out))
            print(f"tp {tp} moe {a.moe} allreduce {out['allreduce']}: " + ", ".join(
                f"batch {b}: {r['decode_tok_s']:.1f} tok/s" for b, r in out["batches"].items()))
        return 0 if out["ranks_agree"] else 3
    finally:
        shutdown()


def parity(ref: dict, got: dict) -> str:
    """Requests whose tokens differ from the reference's, and how many of those first differ at a near-tie."""
    tie = TIE_MARGIN[ref["dtype"]]
    differ, ties = 0, 0
    for rid, want in ref["outputs"].items():
        have = got["outputs"].get(rid)
        if have == want:
            continue
        differ += 1
        i = next((j for j, (x, y) in enumerate(zip(have or [], want)) if x != y), 0)
        ties += ref["margins"][rid][i] < tie
    return f"{differ}/{len(ref['outputs'])} differ ({ties} at near-ties < {tie:g})" if differ else \
        f"equal ({len(ref['outputs'])} requests)"


def table(files: list[str]) -> int:
    results = [json.loads(Path(f).read_text()) for f in files]
    ref = results[0]
    rows = []
    for f, r in zip(files, results):
        row = {"run": Path(f).stem, "tp": r["tp"], "moe": r["moe"] if r["tp"] > 1 else "-",
               "allreduce": r.get("allreduce", "-"), "dtype": r["dtype"], "backend": r["backend"]}
        for b, x in r["batches"].items():
            row[f"tok/s b{b}"] = x["decode_tok_s"]
            row[f"x tp1 b{b}"] = x["decode_tok_s"] / ref["batches"][b]["decode_tok_s"] if b in ref["batches"] else None
            row[f"coll ms/step b{b}"] = x["coll_ms_per_step"] if r["tp"] > 1 else None
            row[f"coll KiB/step b{b}"] = x["coll_bytes_per_step"] / KiB if r["tp"] > 1 else None
            if "profile" in x:  # --profile: the graphed step as the GPU ran it
                row[f"kernels ms/step b{b}"] = x["profile"]["kernel_us_per_step"] / 1e3
                row[f"coll kernels ms/step b{b}"] = x["profile"]["collective_us_per_step"] / 1e3
        row["busbw GB/s (peak)"] = max((s["busbw_gbs"] for s in r["sweep"]), default=None)
        row["peak GiB/rank"] = max(r.get("peak_gib_per_rank") or [float("nan")])
        same_dtype = r["dtype"] == ref["dtype"] and r is not ref
        row["tokens vs first"] = parity(ref, r) if same_dtype else "-"
        row["ranks agree"] = r["ranks_agree"]
        rows.append(row)
    sweeps = [dict(run=Path(f).stem, **s) for f, r in zip(files, results) for s in r["sweep"]]
    tables = [Table(rows, title="tensor-parallel decode", name="decode")]
    tops = [dict(run=Path(f).stem, batch=b, **k) for f, r in zip(files, results) for b, x in r["batches"].items()
            for k in x.get("profile", {}).get("top", [])]
    if tops:
        from bench.decode_roofline import BREAKDOWN_FORMATS

        tables.append(Table(tops, title="costliest kernels per decode step (--profile)", name="kernels",
                            formats={**BREAKDOWN_FORMATS, "share": ".1%"}))
    if sweeps:
        tables.append(Table(sweeps, title="all_reduce sweep (bf16, same process group as the run)", name="sweep",
                            formats={"us": ".1f", "busbw_gbs": ".1f"}))
    modes = [dict(run=Path(f).stem, **s) for f, r in zip(files, results) for s in r.get("mode_sweep", [])]
    if modes:
        cross = "; ".join(f"{Path(f).stem}: {crossing(r['mode_sweep'])}" for f, r in zip(files, results)
                          if r.get("mode_sweep"))
        tables.append(Table(modes, title=f"all-reduce per mode inside CUDA graphs (NCCL faster from: {cross})",
                            name="modes"))
    peak = max((s["busbw_gbs"] for s in sweeps), default=float("nan"))
    ceilings = Ceilings(ref["device"], float("nan"), float("nan"), {"allreduce_busbw_gbs": peak})
    report("tp_decode", ceilings, tables, meta={"files": files})
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tp_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--table", nargs="+", metavar="FILE", default=None,
                   help="print the table of earlier runs' files (the first is the reference) and exit")
    p.add_argument("--out", default=None, help="where rank 0 writes this run's results (JSON)")
    p.add_argument("--model-path", default=None, help="a Hugging Face folder (default: --preset's seeded weights)")
    p.add_argument("--preset", default="deepseek_v3")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backend", default="flashinfer_mla")
    p.add_argument("--moe", default="tp", choices=["tp", "ep"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--out-len", type=int, default=32)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--sweep", action="store_true", help="also the all_reduce bus-bandwidth sweep (tp > 1)")
    p.add_argument("--sweep-max", type=int, default=256 * MiB)
    p.add_argument("--sweep-only", action="store_true",
                   help="only the per-mode all-reduce sweep (tp > 1; no model): microseconds inside CUDA graphs")
    p.add_argument("--allreduce", default="auto", choices=["auto", "nccl", "oneshot", "fused"],
                   help="parallel.allreduce of the run")
    p.add_argument("--profile", action="store_true", help="CUDA: per batch one more serve under torch.profiler: "
                   "kernel and collective-kernel time per graphed decode step, the costliest kernels")
    p.add_argument("--quick", action="store_true", help="prompt 128, 16 output tokens, 2 layers of a preset")
    p.add_argument("extra", nargs="*", help="more Hydra overrides")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.table:
        return table(a.table)
    if a.quick:
        a.prompt, a.out_len = 128, 16
        a.layers = a.layers or (None if a.model_path else 2)
    return run(a)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
