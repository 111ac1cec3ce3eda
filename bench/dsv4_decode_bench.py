"""DeepSeek-V4 decode attention at V4-Flash shapes (64 heads, one 512-wide KV head, window 128, CSA top-512, HCA
every 128 tokens): the Triton kernel (backends/kernels/dsv4/dsv4_decode.py) checked against the float64 reference at odd
lengths (the single pass, 3 splits and the automatic choice), then timed at 8k-128k contexts and batch 1, 4 and 64
as CUDA-graph replays (as the decode step runs it), against the copy bandwidth of the bytes it actually reads (the
gathered window and compressed rows, q and the output), measured in the same run. Rows per shape: ``auto`` (the
automatic split over the rows; ``S`` = the count it picked, 1 = the grid already fills the GPU), ``1`` (the single
pass) and ``best`` (the fastest of the forced counts in ``SWEEP`` with the two tiles that won ``auto`` and ``1``,
``S`` = that count). Each row's tile config is the fastest of ``CONFIGS`` (``--quick``: the first two).

Run: ``python bench/dsv4_decode_bench.py [--batch 1 4 64] [--quick] [--out FILE.json]`` (CUDA only; in
bench/run_all.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.kernels.dsv4.dsv4_decode import (  # noqa: E402
    decode_splits,
    decode_workspace_floats,
    dsv4_decode,
    dsv4_decode_torch,
    sm_count,
)
from bench.harness import copies_for_l2, copy_bandwidth_gbs, eager_ms, graph_ms  # noqa: E402

H, D, W, TOPK, CSA, HCA = 64, 512, 128, 512, 4, 128
#: Tile configs (the first is the kernel's default). A run that added tiles of 32 heads x 64 rows and of 64 heads (16
#: warps) did not get past compiling them in 6 minutes on an H100; they are not tried.
CONFIGS = [dict(block_h=16, block_n=64, num_warps=8, num_stages=2), dict(block_h=16, block_n=32, num_warps=8,
           num_stages=2), dict(block_h=16, block_n=16, num_warps=4, num_stages=2), dict(block_h=32, block_n=32,
           num_warps=8, num_stages=2)]
#: Forced split counts timed beside the automatic choice (the best one is reported with its count).
SWEEP = (2, 4, 8, 16, 32)


def case(b, win_fill, cmp_valid, n_cmp, pool_rows, dtype, seed=0):
    """Indices: request i sees win_fill[i] ring rows and cmp_valid[i] of n_cmp compressed slots (-1 padding)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, H, D, device="cuda", generator=g).to(dtype)
    win = torch.randn(b * W, D, device="cuda", generator=g).to(dtype)
    cmp_rows = torch.randn(pool_rows, D, device="cuda", generator=g).to(dtype)
    win_idx = torch.full((b, W), -1, dtype=torch.int32, device="cuda")
    cmp_idx = torch.full((b, max(n_cmp, 0)), -1, dtype=torch.int32, device="cuda")
    for i in range(b):
        f = win_fill[i % len(win_fill)]
        win_idx[i, :f] = torch.arange(i * W, i * W + f, device="cuda", dtype=torch.int32)
        c = cmp_valid[i % len(cmp_valid)]
        cmp_idx[i, :c] = torch.randperm(pool_rows, device="cuda", generator=g)[:c].int()
    sinks = torch.randn(H, device="cuda", generator=g)
    return q, win, win_idx, cmp_rows, cmp_idx, sinks


def launchable(configs) -> list[dict]:
    """The configs whose kernels compile and launch on this GPU (a tile too large for its registers or shared
    memory raises at launch; it is reported and left out)."""
    args = case(2, [W, 3], [7, 0], 16, 64, torch.bfloat16)
    ok = []
    for cfg in configs:
        try:
            for splits in (1, 3):
                dsv4_decode(*args, D**-0.5, num_splits=splits, **cfg)
            ok.append(cfg)
        except Exception as e:  # noqa: BLE001 (triton's OutOfResources and compile errors: report, skip)
            print(f"config {cfg} left out: {type(e).__name__}: {str(e)[:160]}")
    return ok


def check(configs) -> list[dict]:
    rows = []
    for name, fills, valid, n_cmp in (("sliding", [1, 37, 128, 77, 128], [0], 0),
                                      ("csa top-512", [128, 5, 128, 99, 128], [0, 3, 129, 512, 511], 512),
                                      ("hca 131200 tok", [128, 128, 11, 128, 1], [1, 1025, 700, 0, 64], 1025)):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
            args = case(5, fills, valid, n_cmp, 4096, dtype)
            want = dsv4_decode_torch(*(a.double() if a.is_floating_point() else a for a in args), D**-0.5)  # float64
            errs = []
            for cfg in configs:
                for splits in (None, 1, 3):  # automatic (batch 5 splits here), single pass, 3 (some tails empty)
                    got = dsv4_decode(*args, D**-0.5, num_splits=splits, **cfg)
                    errs.append(((got.double() - want).abs().max() / want.abs().max()).item())
            rows.append({"case": name, "dtype": str(dtype).removeprefix("torch."), "max_rel_err": max(errs),
                         "tol": tol, "ok": max(errs) < tol})
    return rows


def _best(calls_for, configs) -> tuple[float, dict]:
    """The fastest tile config: ``calls_for(cfg)`` gives one call per input copy, captured in one CUDA graph."""
    best = None
    for cfg in configs:
        ms = graph_ms(calls_for(cfg), rep_ms=60)
        if best is None or ms < best[0]:
            best = (ms, cfg)
    return best


def _shape_rows(batch: int, ctx: int, kind: str, n_cmp: int, copy_gbs: float, configs, sweep) -> list[dict]:
    """The automatic split, the single pass and the best forced split of one shape (see :func:`timing`)."""
    sms = sm_count(torch.device("cuda"))
    pool = batch * ctx // (CSA if kind == "csa" else HCA)
    read = batch * (W + n_cmp) * D * 2 + 2 * batch * H * D * 2 + (W + n_cmp) * 4 * batch
    copies = [case(batch, [W], [n_cmp], n_cmp, pool, torch.bfloat16, seed=i) for i in range(copies_for_l2(read))]
    outs = [torch.empty_like(c[0]) for c in copies]
    most = max([*sweep, *(decode_splits(batch, H, W + n_cmp, sms, c["block_h"], c["block_n"]) for c in configs)])
    ws = [torch.empty(decode_workspace_floats(batch, H, D, most), dtype=torch.float32, device="cuda")
          for _ in copies]

    def calls_for(splits, cfg):
        return [lambda c=c, o=o, w=w: dsv4_decode(*c, D**-0.5, out=o, num_splits=splits, workspace=w, **cfg)
                for c, o, w in zip(copies, outs, ws)]

    single = _best(lambda cfg: calls_for(1, cfg), configs)
    auto = _best(lambda cfg: calls_for(None, cfg), configs)
    forced = min(((*_best(lambda cfg, s=s: calls_for(s, cfg), [single[1], auto[1]]), s) for s in sweep),
                 key=lambda t: t[0])
    ms_torch = eager_ms(lambda: dsv4_decode_torch(*copies[0], D**-0.5, compute_dtype=torch.float32))
    picked = decode_splits(batch, H, W + n_cmp, sms, auto[1]["block_h"], auto[1]["block_n"])
    rows = []
    for label, (ms, cfg), splits in (("auto", auto, picked), ("1", single, 1), ("best", forced[:2], forced[2])):
        gbs = read / ms / 1e6
        rows.append({"context": ctx, "layer": kind, "batch": batch, "num_splits": label, "splits": splits,
                     "rows_per_req": W + n_cmp, "bytes_read": read, "us": ms * 1e3, "GB/s": gbs,
                     "of_copy": gbs / copy_gbs, "vs_single": single[0] / ms, "torch_fp32_us": ms_torch * 1e3,
                     "config": f"h{cfg['block_h']} n{cfg['block_n']} w{cfg['num_warps']}"})
    return rows


def timing(batches: list[int], copy_gbs: float, configs, quick: bool = False) -> Iterator[dict]:
    """GPU times of the calls replayed from a CUDA graph (how the engine's decode step runs them; eager timing
    counts Triton's host launch cost between the split and merge kernels), over enough input copies that L2
    never serves a repeated read. Per shape: the automatic split, the single pass, and the best of the forced
    splits in ``SWEEP`` (the data that tunes the automatic choice). The torch column is eager, float32."""
    configs = configs[:2] if quick else configs
    sweep = SWEEP[:3] if quick else SWEEP
    for batch in batches:
        for ctx in (8192, 131072) if quick else (8192, 32768, 131072):
            for kind, n_cmp in (("csa", TOPK), ("hca", ctx // HCA)):
                yield from _shape_rows(batch, ctx, kind, n_cmp, copy_gbs, configs, sweep)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 64])
    ap.add_argument("--out", type=str, default=None)
    ap.add_argument("--quick", action="store_true", help="2 contexts, 2 tile configs")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    print(torch.cuda.get_device_name())
    configs = launchable(CONFIGS)
    checks = check(configs)
    for r in checks:
        print(f"check {r['case']:<16} {r['dtype']:<9} max rel err {r['max_rel_err']:.2e} (tol {r['tol']:.0e}) "
              f"{'ok' if r['ok'] else 'FAIL'}")
    copy = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy:.0f} GB/s")
    print(f"{'ctx':>7} {'layer':>5} {'B':>3} {'split':>5} {'S':>3} {'rows':>5} {'MB read':>8} {'us':>8} {'GB/s':>7} "
          f"{'of copy':>7} {'vs 1':>5} {'torch us':>9} config")
    rows = []
    for r in timing(a.batch, copy, configs, a.quick):  # each row as it is measured
        rows.append(r)
        print(f"{r['context']:>7} {r['layer']:>5} {r['batch']:>3} {r['num_splits']:>5} {r['splits']:>3} "
              f"{r['rows_per_req']:>5} {r['bytes_read'] / 1e6:>8.2f} {r['us']:>8.1f} {r['GB/s']:>7.0f} "
              f"{r['of_copy']:>7.1%} {r['vs_single']:>5.2f} {r['torch_fp32_us']:>9.1f} {r['config']}")
    result = {"device": torch.cuda.get_device_name(), "copy_gbs": copy, "sms": sm_count(torch.device("cuda")),
              "checks": checks, "rows": rows}
    print("BENCH_JSON " + json.dumps(result))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    if not all(r["ok"] for r in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
