"""Block-fp8 linear layers (``backends/kernels/gemm/fp8_gemm.py``) against bf16 cuBLAS and the fp8 libraries.

Shapes: one TP8 rank of DeepSeek-V3 (hidden 7168), weights ``[N, K]`` e4m3 with 128 x 128 float32 block scales.
Per (shape, M), all timed in CUDA graphs (bench/harness.py ``graph_ms``) captured over enough weight copies that
L2 never serves a repeated read (``copies_for_l2``):

* ``ours_us``: :func:`fp8_linear` on the path it picks (``path``), ``--path`` forces one; split-K partials summed
  by each column tile's last program, as the model's fused ops run it (``counters``; ``--no-fold``: a second kernel);
* ``bf16_us``: ``F.linear`` over the dequantized bf16 weight (what a model expanded at load time runs);
* ``fi_us``: FlashInfer ``fp8_blockscale_gemm_sm90(x_bf16, w, None, scale)`` (it quantizes x itself);
* ``tsm_us``: torch's blockwise scaled mm (``fp8_linear(path="scaled_mm")``: ``F.scaled_mm`` 1x128 x 128x128,
  cuBLAS), our ``quantize_act`` included in its time (torch has no activation quantizer);
* ``*_err``: relative error against float64 (x times the dequantized weight); ``n/a`` + the reason when a
  library cannot run;
* ``copy_pct``: ours as % of the copy bandwidth, bytes = fp8 weight + scales + x + y;
* ``read_us`` / ``read_pct``: the time to only read the fp8 weight's bytes (``bench.read_ceiling``, best of 7
  tilings, the same rotation of copies) and ours as % of that: at a few megabytes a plain read is itself far
  from the copy bandwidth (qkv_a 53%, q_b 28% on an H200), so this is the ceiling few-row products are judged by;
* for M >= 1024: ``fp8_pct`` / ``bf16_pct``: ours as % of the fp8 matmul ceiling (``torch._scaled_mm``,
  per-tensor scales, 8192^3 e4m3, measured in this run) and of the bf16 one.

    python -m bench.fp8_gemm_bench                    # every shape, M = 1 2 4 8 16 32 64 4096
    python -m bench.fp8_gemm_bench --m 1,16 --shapes qkv_a,q_b
    python -m bench.fp8_gemm_bench --sweep            # also every few-row / GEMM tile config (best printed)
    python -m bench.fp8_gemm_bench --path split --m 32 --sweep   # the 17-32-row W8A8 kernel's tiles and splits
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import (  # noqa: E402
    Table,
    copies_for_l2,
    eager_ms,
    graph_ms,
    measure_ceilings,
    rel_err,
    report,
    tflop_per_s,
)
from bench.read_ceiling import read_us  # noqa: E402

BF = torch.bfloat16
FP8 = torch.float8_e4m3fn
#: one TP8 rank of DeepSeek-V3 (hidden 7168): (name, N, K)
SHAPES = [("qkv_a", 2112, 7168), ("q_b", 3072, 1536), ("o_proj", 7168, 2048), ("gate_up", 4608, 7168),
          ("down", 7168, 2304), ("shared_gate_up", 512, 7168), ("shared_down", 7168, 256)]
DEFAULT_M = [1, 2, 4, 8, 16, 32, 64, 4096]


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from e


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``--m`` rows list, ``--shapes`` names (of :data:`SHAPES`), ``--path``, ``--sweep``,
    ``--quick`` (M 1, 16, 64, 4096 over qkv_a, o_proj and gate_up)."""
    p = argparse.ArgumentParser(prog="python -m bench.fp8_gemm_bench", description=__doc__.split("\n")[0])
    p.add_argument("--m", type=_ints, default=DEFAULT_M, help="rows (tokens), comma-separated")
    p.add_argument("--shapes", default="", help=f"comma-separated names of {[s[0] for s in SHAPES]} (default all)")
    p.add_argument("--path", choices=["few", "split", "w8a8", "w8a16"], default=None, help="force fp8_linear's path")
    p.add_argument("--sweep", action="store_true", help="time every tile config of the path taken")
    p.add_argument("--no-fold", action="store_true", help="split-K partials summed by a second kernel")
    p.add_argument("--no-libs", action="store_true", help="skip FlashInfer and torch's scaled mm")
    p.add_argument("--quick", action="store_true", help="M 1, 16, 64, 4096 over qkv_a, o_proj and gate_up")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.quick:
        args.m, args.shapes = [1, 16, 64, 4096], "qkv_a,o_proj,gate_up"
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in {n for n, _, _ in SHAPES}]
    if unknown:
        p.error(f"unknown shape(s) {unknown}; expected names of {[s[0] for s in SHAPES]}")
    return args


def selected_shapes(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    names = [s for s in args.shapes.split(",") if s]
    return [s for s in SHAPES if not names or s[0] in names]


def fp8_matmul_tflops(n: int = 8192) -> float:
    """torch._scaled_mm e4m3 x e4m3 -> bf16, per-tensor scales, n^3: TFLOP/s (NaN if it cannot run)."""
    try:
        a = torch.randn(n, n, device="cuda").to(FP8)
        b = torch.randn(n, n, device="cuda").to(FP8)
        one = torch.ones((), device="cuda")
        ms = eager_ms(lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=BF), rep_ms=300)
        return tflop_per_s(2 * n**3, ms)
    except Exception as e:  # noqa: BLE001 - no fp8 GEMM in this torch / on this GPU
        print(f"fp8 ceiling n/a: {e!r}"[:200])
        return float("nan")


def _flashinfer():
    """FlashInfer's SM90 block-scale GEMM, or the reason it is not there."""
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
    except Exception as e:  # noqa: BLE001
        return None, f"import: {e!r}"[:120]
    return (lambda x, w, s: fp8_blockscale_gemm_sm90(x, w, None, s, out_dtype=BF)), ""


def _try(fn, ref, copies, label):
    """(us, rel_err) of fn graph-timed over the copies, or ("n/a", reason) when it fails."""
    try:
        err = rel_err(fn(*copies[0]), ref)
        return graph_ms([lambda c=c: fn(*c) for c in copies]) * 1e3, err
    except Exception as e:  # noqa: BLE001 - a library that cannot take this shape / GPU
        reason = f"{type(e).__name__}: {e}".replace("\n", " ")[:100]
        print(f"  {label} n/a: {reason}", flush=True)
        return "n/a", reason


#: (block_m, block_n, warps, stages) of the sweep's TMA configs at M >= 256
TMA_TILES = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (128, 256, 8, 3), (64, 256, 4, 4),
             (64, 128, 4, 5))


def _sweep(fp8_gemm, path, m, n, kd, copies, ref, counters=None):
    if path == "few":  # split_k 1 is the kernel without split-K; the default's split is printed beside
        F_ = fp8_gemm.FewConfig
        cfgs = [F_(64, 256, 4, 4, sp) for sp in (1, 2, 3, 4, 6, 8)] + [F_(32, 512, 4, 4, sp) for sp in (1, 2, 4)]
        if m <= fp8_gemm.FMA_ROWS:  # the CUDA-core kernel
            tiles = ((4, 1024, 4), (8, 512, 4), (8, 1024, 8), (16, 512, 8), (16, 256, 4), (8, 256, 4), (32, 256, 8))
            cfgs += [F_(bn, bk // m, wp, 3, sp, True) for bn, bk, wp in tiles for sp in (1, 2, 4)]
    elif path == "split":  # weight rows a program x splits, in-kernel quantization; then the best's options
        steps = -(-kd // 128)
        cfgs = [fp8_gemm.SplitConfig(bn, sp, True, 4, 3, True) for bn in (64, 128)
                for sp in (1, 2, 3, 4, 6, 8, 12, 16) if sp <= steps]
    else:
        G = fp8_gemm.GemmConfig
        bks = (128,) if path == "w8a8" else (64, 128)
        bms = (64, 128) if path == "w8a8" or m > 64 else (16, 32, 64)
        cfgs = [G(bm, bn, bk, 8, wp, st) for bm in bms for bn in (64, 128, 256) for bk in bks
                for wp in (4, 8) for st in (3, 4)]
        if path == "w8a8" and m >= 256:  # TMA loads, plain and warp-specialized (Hopper+)
            cfgs += [G(bm, bn, 128, 8, wp, st, True, ws) for bm, bn, wp, st in TMA_TILES for ws in (False, True)]
    best = (float("inf"), None)
    for cfg in cfgs:
        t = _time_config(fp8_gemm, path, cfg, copies, counters)
        if t == float("inf"):
            continue
        x, w, s = copies[0]
        err = rel_err(fp8_gemm.fp8_linear(x, w, s, path=path, config=cfg), ref)
        best = min(best, (t, cfg), key=lambda b: b[0])
        if path == "split":
            print(f"    {t * 1e3:7.2f} us  {cfg}", flush=True)
        elif path == "few":
            print(f"    {t * 1e3:7.2f} us  {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
                  f"split {cfg.split_k}{' fma' if cfg.fma else ''}", flush=True)
        else:
            print(f"    {t * 1e3:7.2f} us  {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} "
                  f"s{cfg.num_stages}{' tma' if cfg.tma else ''}{' ws' if cfg.ws else ''}  err {err:.2e}", flush=True)
    if path == "split" and best[1] is not None:  # around the best: activations quantized first, other stages
        b = best[1]
        for cfg in (replace(b, quant=False), replace(b, num_stages=4), replace(b, num_stages=6),
                    replace(b, num_warps=8), replace(b, tma=False)):
            t = _time_config(fp8_gemm, path, cfg, copies, counters)
            print(f"    {t * 1e3:7.2f} us  {cfg}", flush=True)
            best = min(best, (t, cfg), key=lambda b: b[0])
    dev = copies[0][0].device
    default = (fp8_gemm.few_config(n, kd, dev, m) if path == "few"
               else fp8_gemm.split_config(m, n, kd, 128, dev) if path == "split" else None)
    print(f"  sweep {path} M={m} N={n} K={kd}: best {best[0] * 1e3:.2f} us with {best[1]}"
          + (f" (default {default})" if default else ""), flush=True)
    return best


def _time_config(fp8_gemm, path, cfg, copies, counters=None) -> float:
    """ms of one config graph-timed over the copies (inf when it cannot run)."""
    try:
        return graph_ms([lambda x=x, w=w, s=s: fp8_gemm.fp8_linear(x, w, s, path=path, config=cfg, counters=counters)
                         for x, w, s in copies], rep_ms=50)
    except Exception as e:  # noqa: BLE001 - out of shared memory / registers
        print(f"  sweep {cfg}: {type(e).__name__}"[:120])
        return float("inf")


def bench(args, ceil, fp8_tflops) -> list[dict]:
    from backends.kernels.gemm import fp8_gemm
    from runtime.model.deepseek.ops import GEMM_COUNTERS
    from runtime.model.quantized import dequantize_fp8, quantize_fp8

    fi, fi_reason = (None, "--no-libs") if args.no_libs else _flashinfer()
    cnt = None if args.no_fold else torch.zeros(GEMM_COUNTERS.nbytes // 4, dtype=torch.int32, device="cuda")
    rows = []
    for name, n, kd in selected_shapes(args):
        w, s = quantize_fp8(torch.randn(n, kd, device="cuda") / kd**0.5)
        wd64 = dequantize_fp8(w, s, torch.float64)
        wbf = wd64.to(BF)
        w_bytes = w.numel() + s.numel() * 4
        fp8_sets = [(w.clone(), s.clone()) for _ in range(copies_for_l2(w_bytes))]
        read = read_us([cw for cw, _ in fp8_sets])[0]
        bf_sets = [wbf.clone() for _ in range(copies_for_l2(wbf.numel() * 2))]
        for m in args.m:
            x = torch.randn(m, kd, device="cuda", dtype=BF)
            ref = x.double() @ wd64.T
            path = args.path or fp8_gemm.choose_path(m, 128, x.device, x.dtype, library=False)
            ours_sets = [(x, cw, cs) for cw, cs in fp8_sets]
            ours_us, ours_err = _try(lambda x, w, s, p=path: fp8_gemm.fp8_linear(x, w, s, path=p, counters=cnt), ref,
                                     ours_sets, "ours")
            bf_us, bf_err = _try(F.linear, ref, [(x, c) for c in bf_sets], "bf16")
            if path == "few" and m <= fp8_gemm.FMA_ROWS:  # the tensor-core kernel beside the CUDA-core default
                tc = fp8_gemm.few_config(n, kd, x.device, fp8_gemm.FEW_ROWS)
                row_tc = _try(lambda x, w, s, tc=tc: fp8_gemm.fp8_linear(x, w, s, path="few", config=tc), ref, ours_sets,
                              "tensor-core few")[0]
            else:
                row_tc = "n/a"
            if fi is None:
                fi_us, fi_err = "n/a", fi_reason
            else:
                fi_us, fi_err = _try(fi, ref, ours_sets, "flashinfer")
            if args.no_libs:
                tsm_us, tsm_err = "n/a", "--no-libs"
            else:
                tsm_us, tsm_err = _try(lambda x, w, s: fp8_gemm.fp8_linear(x, w, s, path="scaled_mm"), ref, ours_sets,
                                       "torch scaled_mm")
            nbytes = w_bytes + (m * kd + m * n) * 2
            row = {"shape": name, "N": n, "K": kd, "M": m, "path": path, "ours_us": ours_us, "bf16_us": bf_us,
                   "fi_us": fi_us, "tsm_us": tsm_us, "tc_us": row_tc}
            if isinstance(ours_us, float):
                row["copy_pct"] = ceil.pct_copy(nbytes, ours_us * 1e-3)
                row["read_us"], row["read_pct"] = read, 100 * read / ours_us
                if isinstance(bf_us, float):
                    row["vs_bf16"] = bf_us / ours_us
                if m >= 1024:
                    flops = 2 * m * n * kd
                    row["fp8_pct"] = 100 * tflop_per_s(flops, ours_us * 1e-3) / fp8_tflops
                    row["bf16_pct"] = ceil.pct_matmul(flops, ours_us * 1e-3)
            row.update({"ours_err": ours_err, "bf16_err": bf_err, "fi_err": fi_err, "tsm_err": tsm_err})
            if args.sweep and (m == args.m[0] or m > fp8_gemm.FEW_ROWS or path != "few"):
                t, cfg = _sweep(fp8_gemm, path, m, n, kd, ours_sets, ref, cnt)
                row["best_us"], row["best_config"] = t * 1e3, str(cfg)
            rows.append(row)
            print({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del fp8_sets, bf_sets
        torch.cuda.empty_cache()
    return rows


def _short(rows: list[dict]) -> list[dict]:
    """The table printed last: times and ratios; errors as numbers (a reason string becomes n/a)."""
    cols = ["shape", "M", "path", "ours_us", "tc_us", "bf16_us", "fi_us", "tsm_us", "copy_pct", "read_us", "read_pct",
            "vs_bf16", "fp8_pct",
            "bf16_pct", "ours_err", "bf16_err", "fi_err", "tsm_err", "best_us"]
    out = []
    for r in rows:
        out.append({c: ("n/a" if isinstance(r[c], str) and c not in ("shape", "path") else r[c])
                    for c in cols if c in r})
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("fp8_gemm_bench needs a CUDA GPU (fp8 weights, CUDA graphs); the CPU tests are "
                 "tests/test_fp8_gemm.py")
    ceil = measure_ceilings()
    fp8_tflops = fp8_matmul_tflops()
    ceil = ceil.with_extra(fp8_matmul_tflops=fp8_tflops)
    print(ceil.summary(), flush=True)
    rows = bench(args, ceil, fp8_tflops)
    fmt = {c: ".2f" for c in ("ours_us", "bf16_us", "fi_us", "tsm_us", "best_us", "vs_bf16")}
    fmt.update({c: ".1f" for c in ("copy_pct", "read_pct", "fp8_pct", "bf16_pct")})
    fmt["read_us"] = ".2f"
    fmt.update({c: ".2e" for c in ("ours_err", "bf16_err", "fi_err", "tsm_err")})
    report("fp8_gemm", ceil, Table(_short(rows), "block-fp8 linear, one TP8 rank of DeepSeek-V3 (us: CUDA graph, "
                                   "cold L2)", formats=fmt, name="fp8_linear"),
           meta={"m": args.m, "path": args.path, "shapes": [s[0] for s in selected_shapes(args)]})


if __name__ == "__main__":
    main()
