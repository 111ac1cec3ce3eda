#!/usr/bin/env python
"""GPU check + timing of the Triton MLA kernels (backends/kernels), meant for one H100 run.

    python -m bench.triton_mla_kernels_gpu                      # ceilings, every row, focused config sweeps
    python -m bench.triton_mla_kernels_gpu --quick              # default configs only
    python -m bench.triton_mla_kernels_gpu --rows var,b1,h128   # some rows (h16, b1, h128, var, scratch, extend)
    python -m bench.triton_mla_kernels_gpu --smoke --quick      # this script's code paths on the CPU interpreter

What it does, in order:
 1. Ceilings measured in the same run (bench.harness): device-to-device copy bandwidth (a 1 GiB torch
    copy, read + write bytes counted) and bf16 8192^3 matmul TFLOP/s.
 2. For every row and every kernel config tried: run once, compare with a float32 torch reference on the GPU
    (relative error printed; a config whose error is >= 2e-2 is reported and not timed), then time it twice:
    eagerly with bench.harness.eager_ms (median; the launcher's Python time is hidden behind the L2 flush
    only when it is shorter) and as a CUDA graph of the calls (bench.harness.graph_ms: how the backend runs
    decode; the graph time is the GPU time). Inputs are rotated over several copies when one copy of the KV
    cache would fit in L2.
 3. Decode runs with the workspace the backend gives it: a flat buffer of ``split_slots`` float32 slots
    viewed as [B, H, S, 512] with ``S = min(max_splits, split_slots // B)`` (``--max-splits``,
    ``--split-slots``; a config's ``ws=`` overrides max_splits). Each config line also gives the stage-1
    programs (``P``), the split pieces and the partial-output bytes they write and the merge reads.
 4. Prints the best config per row, FlashInfer's BatchMLAPagedAttentionWrapper (backend="fa3") on the same
    decode tensors when flashinfer imports (``--no-fi`` skips it: its JIT build takes minutes on a fresh
    machine), and the summary table (bench.harness.report) last.

Problems and references: bench/triton_mla_problems.py; the config grid: bench/triton_mla_sweep.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# --smoke: exercise this script's code paths on the CPU through Triton's interpreter with tiny sizes
# (no meaningful numbers); it must be decided before the kernels are imported.
SMOKE = __name__ == "__main__" and "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from backends.kernels.mla_decode.mla_decode import (  # noqa: E402
    PROGRAMS_PER_SM,
    PROGRAMS_PER_SM_TMA,
    default_decode_config,
)
from backends.kernels.mla_extend.mla_extend import default_extend_config  # noqa: E402
from bench.harness import (  # noqa: E402
    Ceilings,
    MiB,
    Table,
    gb_per_s,
    l2_bytes,
    measure_ceilings,
    report,
    tflop_per_s,
)
from bench.triton_mla_problems import D_CKV, DTYPE, DecodeProblem, ExtendProblem  # noqa: E402
from bench.triton_mla_sweep import (  # noqa: E402
    decode_configs,
    flashinfer_decode_ms,
    fmt_cfg,
    graph_call_ms,
    log,
    sweep,
    try_config,
)

DEV = "cpu" if SMOKE else "cuda"
ROWS = ("h16", "b1", "h128", "var", "scratch", "extend")


def S(n, smoke=None):
    """A size: n normally, tiny with --smoke (n // 64, at least 1, unless given)."""
    if not SMOKE:
        return n
    return smoke if smoke is not None else max(1, n // 64)


@dataclass
class Run:
    """What every row needs: the ceilings, the GPU's SM count, the options, and the table being built."""

    ceil: Ceilings
    sms: int
    quick: bool
    ws_kw: dict
    use_fi: bool
    table: list[dict] = field(default_factory=list)

    def fi_ms(self, prob):
        return flashinfer_decode_ms(prob) if self.use_fi else None

    def bw_metric(self, prob):
        return lambda ms: f"{gb_per_s(prob.kv_bytes, ms):5.0f} GB/s {self.ceil.pct_copy(prob.kv_bytes, ms):5.1f}%bw"

    def mm_metric(self, prob):
        return lambda ms: f"{tflop_per_s(prob.flops, ms):5.1f} TF/s {self.ceil.pct_matmul(prob.flops, ms):5.1f}%mm"

    def add(self, name, config, goal, eager_ms=None, graph_ms=None, value=None, unit="", pct_eager=None,
            pct_graph=None, of="", err=None, fi=None, note=""):
        """One summary row; times in ms here, in us in the table."""
        self.table.append({"row": name, "config": config, "eager_us": None if eager_ms is None else eager_ms * 1e3,
                           "graph_us": None if graph_ms is None else graph_ms * 1e3, "value": value, "unit": unit,
                           "pct_eager": pct_eager, "pct_graph": pct_graph, "of": of, "goal": goal, "rel_err": err,
                           "t_fi_over_triton": fi, "note": note})


def decode_row(run: Run, name, row, prob, goal, bandwidth=True):
    """Sweep a decode row's configs; add the best to the table; -> (cfg, eager ms, graph ms) or None."""
    metric = run.bw_metric(prob) if bandwidth else run.mm_metric(prob)
    cfg, ms, gms, err = sweep(name, prob, decode_configs(row, run.quick, run.sms), metric, run.sms)
    if cfg is None:
        run.add(name, "all failed", goal)
        return None
    fi = run.fi_ms(prob)
    fi_s = "n/a" if fi is None else f"{fi[0] / ms:.2f}x (fi {fi[0] * 1e3:.1f}us err {fi[1]:.1e})"
    log(f"  flashinfer fa3: {fi_s}   (ratio = t_flashinfer / t_triton eager; > 1 means triton is faster)")
    P, pieces, pbytes = prob.plan(cfg, run.sms)
    if bandwidth:
        run.add(name, fmt_cfg(cfg) or "default", goal, ms, gms, gb_per_s(prob.kv_bytes, gms), "GB/s",
                run.ceil.pct_copy(prob.kv_bytes, ms), run.ceil.pct_copy(prob.kv_bytes, gms), "copy", err,
                None if fi is None else fi[0] / ms)
    else:
        run.add(name, fmt_cfg(cfg) or "default", goal, ms, gms, tflop_per_s(prob.flops, gms), "TFLOP/s",
                run.ceil.pct_matmul(prob.flops, ms), run.ceil.pct_matmul(prob.flops, gms), "matmul", err,
                None if fi is None else fi[0] / ms)
    log(f"  best plan: P={P} pieces={pieces}, partials written+read {pbytes / MiB:.1f} MiB "
        f"({100 * pbytes / prob.kv_bytes:.1f}% of the KV bytes)")  # fmt: skip
    if not SMOKE:
        g1 = graph_call_ms(prob, prob.runner(**cfg, _skip_merge=True))
        log(f"  stage 1 alone (graph): {g1 * 1e3:.1f} us -> merge + its launch {1e3 * (gms - g1):.1f} us")
    return cfg, ms, gms


def var_rows(run: Run, r1):
    """Variable lengths ~ N(mean, mean/2) vs uniform lengths of the same total, batch 128, 16 heads."""
    var_cfgs = [dict(r1[0])] if r1 else [{}]
    if not run.quick:
        for c in ({}, dict(use_tma=False), dict(use_tma=False, target_programs=run.sms)):
            if c not in var_cfgs:
                var_cfgs.append(c)
    nb = S(128, 3)
    for mean in (4096,) if run.quick else (4096, 8192):
        mean = S(mean)
        g = torch.Generator().manual_seed(mean)
        lens = torch.normal(float(mean), mean / 2, (nb,), generator=g).round().clamp(1, 2 * mean).int().tolist()
        total = sum(lens)
        uni = [total // nb + (1 if i < total % nb else 0) for i in range(nb)]
        name = f"decode H16 B{nb} var mean {mean}"
        probs = {tag: DecodeProblem(ls, 16, DEV, seed=mean + len(tag), **run.ws_kw)
                 for tag, ls in (("normal", lens), ("uniform", uni))}
        log(f"\n== {name} (total {total} tokens, max {max(lens)}, min {min(lens)}; normal vs uniform of the same "
            "total)")
        best = None
        kvb = probs["normal"].kv_bytes
        for cfg in var_cfgs:
            res = {tag: try_config(pr, cfg) for tag, pr in probs.items()}
            (mv, gv, ev, fv), (mu, gu, eu, fu) = res["normal"], res["uniform"]
            if fv or fu:
                log(f"  {fmt_cfg(cfg) or 'default':52s} FAIL {fv or fu}")
                continue
            P, pieces, pbytes = probs["normal"].plan(cfg, run.sms)
            chg, gchg = 100 * (mv - mu) / mu, 100 * (gv - gu) / gu
            log(f"  {fmt_cfg(cfg) or 'default':52s} normal {mv * 1e3:7.1f} us, uniform {mu * 1e3:7.1f} us -> "
                f"{chg:+5.1f}% | graph normal {gv * 1e3:7.1f} us, uniform {gu * 1e3:7.1f} us -> {gchg:+5.1f}%"
                f"  normal {run.ceil.pct_copy(kvb, gv):.1f}% bw (graph)  err {ev:.1e}/{eu:.1e}  P={P} pieces={pieces}")
            if best is None or gv < best[2]:
                best = (cfg, mv, gv, ev, mu, gu)
        if best is None:
            run.add(name, "all failed", "within 8% of uniform")
            continue
        cfg, mv, gv, ev, mu, gu = best
        fi_ratio = None
        fiv, fiu = run.fi_ms(probs["normal"]), run.fi_ms(probs["uniform"])
        if fiv is not None and fiu is not None:
            fi_ratio = fiv[0] / mv
            log(f"  flashinfer fa3: normal {fiv[0] * 1e3:.1f} us, uniform {fiu[0] * 1e3:.1f} us "
                f"({100 * (fiv[0] - fiu[0]) / fiu[0]:+.1f}%), t_fi/t_triton on normal {fiv[0] / mv:.2f}x")
        run.add(name, fmt_cfg(cfg) or "default", "within 8% of uniform", mv, gv, 100 * (gv - gu) / gu,
                "% vs uniform (graph)", run.ceil.pct_copy(kvb, mv), run.ceil.pct_copy(kvb, gv), "copy", ev, fi_ratio,
                f"eager {100 * (mv - mu) / mu:+.1f}% vs uniform")
        del probs
        if not SMOKE:
            torch.cuda.empty_cache()


def extend_row(run: Run):
    """Extend, 16 heads, 4 requests x 2048 new tokens over a 2048-token prefix."""
    pe = ExtendProblem([S(2048)] * S(4, 2), [2 * S(2048)] * S(4, 2), 16, DEV, seed=6)
    d = default_extend_config(16, DTYPE)
    cfgs = [d]
    if not run.quick:
        cfgs += [c for c in (dict(block_m=bm, block_h=bh, block_n=bn, num_warps=w, num_stages=s)
                             for bm in (32, 64) for bh in (1, 16) for bn in (32, 64) for w in (4, 8) for s in (2,))
                 if c != d]  # fmt: skip
    best = guarded(sweep, "extend H16 4x2048 new over 2048 prefix", pe, cfgs, run.mm_metric(pe))
    if best and best[0] is not None and not run.quick:
        more = [dict(best[0], num_stages=s) for s in (1, 3)]
        b2 = guarded(sweep, "extend H16 [stages]", pe, more, run.mm_metric(pe))
        if b2 and b2[0] is not None and b2[2] < best[2]:
            best = b2
    if best and best[0] is not None:
        cfg, ms, gms, err = best
        run.add("extend H16 4x2048 / 2048 prefix", fmt_cfg(cfg), "-", ms, gms, tflop_per_s(pe.flops, gms), "TFLOP/s",
                run.ceil.pct_matmul(pe.flops, ms), run.ceil.pct_matmul(pe.flops, gms), "matmul", err)


def guarded(fn, *a):
    try:
        return fn(*a)
    except Exception:
        traceback.print_exc()
        return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="default configs only")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter dry run of this script (tiny sizes)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of rows: {','.join(ROWS)}")
    ap.add_argument("--max-splits", type=int, default=2048, help="backend.max_splits (workspace S cap)")
    ap.add_argument("--split-slots", type=int, default=2048, help="backend.split_slots (workspace slots)")
    ap.add_argument("--no-fi", action="store_true", help="skip FlashInfer")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    quick = args.quick
    rows_wanted = set(args.rows.split(","))
    bad = rows_wanted - set(ROWS)
    if bad:
        sys.exit(f"unknown rows {sorted(bad)}; choose from {ROWS}")
    if SMOKE:
        sms, name = 4, "cpu (--smoke: Triton interpreter, tiny sizes, numbers meaningless)"
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU")
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("unset TRITON_INTERPRET")
        props = torch.cuda.get_device_properties(0)
        sms, name = props.multi_processor_count, props.name
    log(f"device: {name}, {sms} SMs, L2 {l2_bytes(DEV) / MiB:.2f} MiB; torch {torch.__version__}, "
        f"triton {triton.__version__}; quick={quick}; backend workspace max_splits={args.max_splits} "
        f"split_slots={args.split_slots}")
    use_fi = not args.no_fi
    if use_fi:
        try:
            import flashinfer

            log(f"flashinfer {getattr(flashinfer, '__version__', '?')}")
        except Exception:
            log("flashinfer: not importable (n/a)")

    ceil = measure_ceilings(DEV)
    log(f"ceilings: {ceil.summary()}")
    run = Run(ceil, sms, quick, dict(max_splits=args.max_splits, split_slots=args.split_slots), use_fi)

    def free():
        if not SMOKE:
            torch.cuda.empty_cache()

    r1 = None
    if "h16" in rows_wanted:  # 1. decode 16 heads, batch 128 x 8192
        p1 = DecodeProblem([S(8192)] * S(128, 2), 16, DEV, seed=1, **run.ws_kw)
        r1 = guarded(decode_row, run, "decode H16 B128 L8192", "h16", p1, ">=80% bw")
        del p1
        free()
    if "var" in rows_wanted:  # 4. variable lengths vs uniform of the same total
        guarded(var_rows, run, r1)
    if "b1" in rows_wanted:  # 2. decode batch 1 x 32768
        p2 = DecodeProblem([S(32768, 300)], 16, DEV, seed=2, **run.ws_kw)
        guarded(decode_row, run, "decode H16 B1 L32768", "b1", p2, ">=50% bw")
        del p2
        free()
    if "h128" in rows_wanted:  # 3. decode 128 heads, batch 64 x 4096
        p3 = DecodeProblem([S(4096)] * S(64, 2), S(128, 32), DEV, seed=3, **run.ws_kw)
        guarded(decode_row, run, "decode H128 B64 L4096", "h128", p3, ">=50% mm", False)
        del p3
        free()
    if "scratch" in rows_wanted:  # 5. split-KV scratch (the backend's: split_slots x H x 513 float32)
        for h in (16, 128):
            nbytes = args.split_slots * h * (D_CKV + 1) * 4
            log(f"\n== split-KV scratch, {h} heads, split_slots={args.split_slots}: {nbytes / MiB:.1f} MiB (any batch)")
            run.add(f"scratch H{h}", f"split_slots={args.split_slots}", "<=128 MiB" if h == 16 else "-",
                    value=nbytes / MiB, unit="MiB")
    if "extend" in rows_wanted:  # 6. extend 16 heads, 4 requests x 2048 new over 2048 prefix
        guarded(extend_row, run)
        free()

    title = (f"decode defaults: {default_decode_config(16, DTYPE)} (16 heads), {default_decode_config(128, DTYPE)} "
             f"(128 heads), programs per SM by block_h {PROGRAMS_PER_SM} (pointer loads), {PROGRAMS_PER_SM_TMA} (TMA); "
             f"workspace max_splits={args.max_splits} split_slots={args.split_slots} (tp = target_programs, "
             "mt = min_tokens_per_split, ws = workspace max_splits, reg = maxnreg); pct_*: % of the ceiling in 'of'; "
             "t_fi_over_triton: FlashInfer fa3 eager time / Triton eager time")
    table = Table(run.table, title=title, formats={"eager_us": ".1f", "graph_us": ".1f", "value": ".1f",
                                                   "pct_eager": ".1f", "pct_graph": ".1f", "rel_err": ".1e",
                                                   "t_fi_over_triton": ".2f"})
    report("triton_mla_kernels_gpu", ceil, table,
           meta={"quick": quick, "smoke": SMOKE, "sms": sms, "max_splits": args.max_splits,
                 "split_slots": args.split_slots, "rows": sorted(rows_wanted)})


if __name__ == "__main__":
    main()
