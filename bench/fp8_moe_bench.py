"""Block-fp8 MoE experts (``backends/kernels/gemm/fp8_moe.py``) against the bf16 path of the same routing and
FlashInfer.

DeepSeek-V3 shapes, D 7168, top-8 over 256 experts with random routing, one shared expert:

* ``moe=tp``: every rank holds all 256 experts cut to I 256 (shared I_s 256);
* ``moe=ep``: rank 0 of 8 holds experts 0..31 whole (I 2048), other ranks' pairs carry id 32 (shared I_s 2048).

Per case and token count (1, 4, 16: ``fp8_moe_experts``; 64, 512, 4096: ``moe_dispatch`` + ``fp8_grouped_expert_mlp``
+ ``moe_combine``, the shared expert as a one-expert grouped MLP): ours µs, the bf16 path µs (``skinny.moe_experts``
for T <= 16, else ``routed_expert_sum(grouped_mm=True)`` + the shared MLP, on the dequantized weights rounded to
bf16), FlashInfer's ``cutlass_fused_moe(use_deepseek_fp8_block_scale=True)`` µs when importable (routed experts
only: n/a and the reason otherwise), ours as % of the copy bandwidth for the expert bytes the routing touches
(fp8 + scales, each touched expert once), and the relative error of each against float64 on the dequantized
weights. Everything is timed as CUDA-graph replays (``bench/harness.py graph_ms``) rotating over enough routings
that L2 never serves an expert twice.

    python -m bench.fp8_moe_bench                 # both cases, every token count
    python -m bench.fp8_moe_bench --tokens 1 16   # some token counts
    python -m bench.fp8_moe_bench --sweep         # also the few-token kernels' tile configs at the first count
    python -m bench.fp8_moe_bench --profile       # also each path's kernels by device time
    python -m bench.fp8_moe_bench --tokens 32 --cases tp --grouped-sweep   # each grouped GEMM alone, its tiles
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Table, copies_for_l2, graph_ms, measure_ceilings, rel_err, report  # noqa: E402

D, TOP_K, N_EXPERTS, EP = 7168, 8, 256, 8
CASES = {"tp": dict(n_local=256, inter=256, s_inter=256), "ep": dict(n_local=32, inter=2048, s_inter=2048)}


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, R, C] (or [R, C]) float -> e4m3 and float32 128 x 128 block scales (random weights, quantized)."""
    from runtime.model.quantized import quantize_fp8

    if w.dim() == 2:
        return quantize_fp8(w)
    pairs = [quantize_fp8(wi) for wi in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from runtime.model.quantized import dequantize_fp8

    if q.dim() == 2:
        return dequantize_fp8(q, s, dtype)
    return torch.stack([dequantize_fp8(a, b, dtype) for a, b in zip(q, s)])


def make_case(n_local: int, inter: int, s_inter: int) -> dict:
    torch.manual_seed(0)
    gu = _quantize(torch.randn(n_local, 2 * inter, D, device="cuda") / D**0.5)
    dn = _quantize(torch.randn(n_local, D, inter, device="cuda") / inter**0.5)
    sgu = _quantize(torch.randn(2 * s_inter, D, device="cuda") / D**0.5)
    sdn = _quantize(torch.randn(D, s_inter, device="cuda") / s_inter**0.5)
    return {"n_local": n_local, "inter": inter, "routed": (*gu, *dn), "shared": (*sgu, *sdn),
            "bf16": (_dequantize(*gu, torch.bfloat16), _dequantize(*dn, torch.bfloat16),
                     _dequantize(*sgu, torch.bfloat16), _dequantize(*sdn, torch.bfloat16))}


def routing(t: int, n_local: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random top-8 of 256 per token -> (global ids [t, 8], local ids (n_local: another rank's), weights)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, N_EXPERTS, device="cuda", generator=g).argsort(dim=1)[:, :TOP_K].contiguous()
    local = torch.where(ids < n_local, ids, n_local).contiguous()
    return ids, local, torch.rand(t, TOP_K, device="cuda", generator=g) * 0.3


def touched_bytes(c: dict, local_sets: list[torch.Tensor], t: int) -> float:
    """Mean bytes per call: fp8 + scales of the touched experts (each once) and the shared expert, plus x / out."""
    gu, gus, dn, dns = c["routed"]
    per = sum(w[0].numel() * w.element_size() for w in (gu, gus, dn, dns))
    shared = sum(w.numel() * w.element_size() for w in c["shared"])
    mean_experts = sum(int(ids[ids < c["n_local"]].unique().numel()) for ids in local_sets) / len(local_sets)
    return mean_experts * per + shared + 2 * t * D * 2


def ours(c: dict, x: torch.Tensor, local: torch.Tensor, wts: torch.Tensor, config=None, grouped=None
         ) -> torch.Tensor:
    from backends.kernels.decoder import decoder_ops
    from backends.kernels.gemm import fp8_moe
    from runtime.model.deepseek.mlp import swiglu

    n_local, t = c["n_local"], x.shape[0]
    if t <= fp8_moe.MAX_TOKENS:
        return fp8_moe.fp8_moe_experts(x, local, wts, *c["routed"], *c["shared"], config=config)
    tokens, inv, offsets = decoder_ops.moe_dispatch(local, n_local + 1)
    offsets = offsets[:n_local]
    y = fp8_moe.fp8_grouped_expert_mlp(x, *c["routed"], offsets, swiglu, grouped, tokens=tokens)
    sgu, sgus, sdn, sdns = c["shared"]
    one = torch.full((1,), t, dtype=torch.int32, device=x.device)
    shared = fp8_moe.fp8_grouped_expert_mlp(x, sgu[None], sgus[None], sdn[None], sdns[None], one, swiglu)
    # rows past the last offset (other ranks' pairs) are not computed: the combine reads them as zeros
    return decoder_ops.moe_combine(y, inv, wts, shared, x.dtype, offsets[-1:] if n_local < N_EXPERTS else None)


def bf16_path(c: dict, x: torch.Tensor, ids: torch.Tensor, local: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    from backends.kernels.gemm import skinny
    from runtime.model.deepseek.mlp import swiglu
    from runtime.model.deepseek.moe import routed_expert_sum

    gu, dn, sgu, sdn = c["bf16"]
    if x.shape[0] <= skinny.MAX_ROWS:
        return skinny.moe_experts(x, local, wts, gu, dn, sgu, sdn, others=c["n_local"] < N_EXPERTS)
    out = routed_expert_sum(x, wts, ids, gu, dn, 0, N_EXPERTS, swiglu, True, torch.float32).to(x.dtype)
    return out + F.linear(swiglu(F.linear(x, sgu)), sdn)


def reference(c: dict, x: torch.Tensor, local: torch.Tensor, wts: torch.Tensor, shared: bool = True
              ) -> torch.Tensor:
    """float64 on the dequantized weights, one touched expert at a time."""
    from runtime.model.deepseek.mlp import swiglu

    gu, gus, dn, dns = c["routed"]
    x64 = x.double()
    out = torch.zeros_like(x64)
    for e in local[local < c["n_local"]].unique().tolist():
        tok, slot = (local == e).nonzero(as_tuple=True)
        y = F.linear(swiglu(F.linear(x64[tok], _dequantize(gu[e], gus[e], torch.float64))),
                     _dequantize(dn[e], dns[e], torch.float64))
        out.index_add_(0, tok, y * wts[tok, slot].double()[:, None])
    if shared:
        sgu, sgus, sdn, sdns = c["shared"]
        out += F.linear(swiglu(F.linear(x64, _dequantize(sgu, sgus, torch.float64))), _dequantize(sdn, sdns,
                                                                                                     torch.float64))
    return out


def flashinfer_call(c: dict):
    """(fn(x, ids, wts) -> routed experts' output, None) or (None, why not)."""
    try:
        from flashinfer.fused_moe import cutlass_fused_moe
    except Exception as exc:  # noqa: BLE001 - any import failure is reported as n/a
        return None, f"import: {type(exc).__name__}: {exc}"[:120]
    gu, gus, dn, dns = c["routed"]
    i, n_local = c["inter"], c["n_local"]
    fc1 = torch.cat([gu[:, i:], gu[:, :i]], dim=1).contiguous()  # FlashInfer's fc1 is w3_w1: up rows, then gate
    fc1_s = torch.cat([gus[:, i // 128:], gus[:, :i // 128]], dim=1).contiguous()
    ep = n_local < N_EXPERTS

    def fn(x, ids, wts):
        return cutlass_fused_moe(x, ids.to(torch.int32), wts, fc1, dn, x.dtype, quant_scales=[fc1_s, dns],
                                 ep_size=EP if ep else 1, ep_rank=0, use_deepseek_fp8_block_scale=True)[0]

    return fn, None


def _sweep_few(c, x, local_sets, wts) -> dict:
    from backends.kernels.gemm import fp8_moe

    E = fp8_moe.Fp8ExpertConfig
    cfgs = [E(bi, sub, bd, 4, 4) for bi, sub, bd in ((32, 2, 64), (64, 2, 64), (32, 4, 32))]  # tensor cores
    cfgs += [E(bi, sub, bd, wp, 3, True, dsi) for bi, sub, wp in ((4, 8, 4), (8, 4, 4), (8, 8, 8), (16, 4, 8),
                                                                   (16, 2, 4), (32, 2, 8))
             for bd, dsi in ((32, 2), (16, 4), (64, 2))]  # the CUDA-core kernels
    best, fma_best = (float("inf"), None), (float("inf"), None)
    for cfg in cfgs:
        try:
            ms = graph_ms([lambda li=li, cfg=cfg: ours(c, x, li, wts, cfg) for li in local_sets], rep_ms=40)
        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory, registers)
            print(f"  sweep {cfg}: {type(e).__name__}"[:120], flush=True)
            continue
        best = min(best, (ms, cfg), key=lambda p: p[0])
        print(f"    {ms * 1e3:7.2f} us  {cfg}", flush=True)
        if cfg.fma:
            fma_best = min(fma_best, (ms, cfg), key=lambda p: p[0])
    print(f"  sweep: best {best}, best fma {fma_best}", flush=True)

    def name(cfg):
        return None if cfg is None else (f"{'fma.' if cfg.fma else ''}i{cfg.up_block_i}.k{cfg.up_sub_k}x128."
                                         f"d{cfg.down_block_d}x{cfg.down_sub_i}.w{cfg.num_warps}.s{cfg.num_stages}")
    return {"best_us": best[0] * 1e3, "best_config": name(best[1]), "fma_best_us": fma_best[0] * 1e3}


#: (label, GroupedConfig keywords) of ``--grouped-sweep``
GROUPED_TILES = (("default", {}), ("n64", dict(block_n=64)), ("g1", dict(group_m=1)),
                 ("s2", dict(num_stages=2)), ("s4", dict(num_stages=4)), ("w8", dict(num_warps=8)),
                 ("m32", dict(block_m=32)), ("no_tma", dict(tma=False)), ("n256", dict(block_n=256)),
                 ("n256.s2", dict(block_n=256, num_stages=2)), ("n256.w8", dict(block_n=256, num_warps=8)),
                 ("n256.w8.s2", dict(block_n=256, num_warps=8, num_stages=2)))


def _sweep_grouped(c: dict, x: torch.Tensor, sets: list, ceil) -> None:
    """Each W8A8 grouped GEMM of the routed experts alone (gate_up over the tokens' rows, down over the SwiGLU's),
    CUDA-graph timed over the routings ``sets``, at every ``GROUPED_TILES`` config: µs and % of copy for the
    touched experts' bytes of that GEMM (fp8 + scales, each expert once)."""
    from backends.kernels.decoder import decoder_ops
    from backends.kernels.gemm import fp8_moe
    from runtime.model.deepseek.mlp import swiglu

    gu, gus, dn, dns = c["routed"]
    n_local = c["n_local"]
    runs = []
    for _, local, _ in sets:
        tokens, _, offsets = decoder_ops.moe_dispatch(local, n_local + 1)
        offsets = offsets[:n_local]
        q, qs = fp8_moe.quantize_rows_fp8(x)
        a = swiglu(fp8_moe.fp8_grouped_gemm(q, qs, gu, gus, offsets, x.dtype, rows=tokens))
        runs.append((tokens, offsets, q, qs, *fp8_moe.quantize_rows_fp8(a.contiguous(), limit=offsets[-1:])))
    experts = sum(int(s[1][s[1] < n_local].unique().numel()) for s in sets) / len(sets)
    for gemm, w, ws in (("gate_up", gu, gus), ("down", dn, dns)):
        nbytes = experts * (w[0].numel() + ws[0].numel() * 4)
        for label, kw in GROUPED_TILES:
            cfg = fp8_moe.GroupedConfig(**kw)
            if gemm == "gate_up":
                calls = [lambda r=r, g=cfg, w=w, ws=ws: fp8_moe.fp8_grouped_gemm(r[2], r[3], w, ws, r[1], x.dtype, g,
                                                                                rows=r[0]) for r in runs]
            else:
                calls = [lambda r=r, g=cfg, w=w, ws=ws: fp8_moe.fp8_grouped_gemm(r[4], r[5], w, ws, r[1], x.dtype, g)
                         for r in runs]
            try:
                ms = graph_ms(calls, rep_ms=40)
            except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory, registers)
                print(f"  grouped {gemm} {label}: {type(e).__name__}"[:120], flush=True)
                continue
            print(f"  grouped {gemm} {label:8s} {ms * 1e3:7.2f} us  {ceil.pct_copy(nbytes, ms):5.1f}% of copy "
                  f"({nbytes / 1e6:.0f} MB, {x.shape[0]} tokens)", flush=True)


def bench_case(name: str, args, ceil) -> list[dict]:
    from backends.kernels.gemm import fp8_moe

    c = make_case(**CASES[name])
    fi, fi_why = (None, "--no-libs") if args.no_libs else flashinfer_call(c)
    rows = []
    for t in args.tokens:
        x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        ids, local, wts = routing(t, c["n_local"], seed=t)
        probe = touched_bytes(c, [local], t)
        n_sets = copies_for_l2(int(probe))
        sets = [routing(t, c["n_local"], seed=1000 * t + j) for j in range(n_sets)]
        ref = reference(c, x, local, wts)
        row = {"case": f"moe={name}", "tokens": t, "rel_err": rel_err(ours(c, x, local, wts), ref),
               "bf16_rel_err": rel_err(bf16_path(c, x, ids, local, wts), ref)}
        nbytes = touched_bytes(c, [s[1] for s in sets], t)
        t_ours = graph_ms([lambda s=s, x=x: ours(c, x, s[1], s[2]) for s in sets])
        t_bf16 = graph_ms([lambda s=s, x=x: bf16_path(c, x, s[0], s[1], s[2]) for s in sets])
        row.update(ours_us=t_ours * 1e3, bf16_us=t_bf16 * 1e3, speedup_vs_bf16=t_bf16 / t_ours,
                   ours_copy_pct=ceil.pct_copy(nbytes, t_ours), expert_MB=nbytes / 1e6)
        if t <= 16:  # the down kernel's slot loop (Fp8ExpertConfig.down_unroll off) at the same tiles, same bits
            loop = dataclasses.replace(fp8_moe.expert_config(c["inter"]), down_unroll=False)
            row["down_loop_us"] = graph_ms([lambda s=s, x=x, p=loop: ours(c, x, s[1], s[2], p) for s in sets]) * 1e3
            assert torch.equal(ours(c, x, local, wts, loop), ours(c, x, local, wts)), "down_unroll changed the bits"
        if t > fp8_moe.MAX_TOKENS:  # the grouped GEMMs with the weight tiles by plain loads (no TMA), same bits
            plain = fp8_moe.GroupedConfig(tma=False)
            row["no_tma_us"] = graph_ms([lambda s=s, x=x, g=plain: ours(c, x, s[1], s[2], None, g) for s in sets]) * 1e3
            assert torch.equal(ours(c, x, local, wts, None, plain), ours(c, x, local, wts)), "TMA changed the bits"
        if fi is None:
            row["flashinfer_us"] = f"n/a ({fi_why})"
        else:
            try:
                row["flashinfer_rel_err"] = rel_err(fi(x, ids, wts), reference(c, x, local, wts, shared=False))
                row["flashinfer_us"] = graph_ms([lambda s=s, x=x: fi(x, s[0], s[2]) for s in sets]) * 1e3
            except Exception as exc:  # noqa: BLE001 - reported, not fatal
                row["flashinfer_us"] = f"n/a ({type(exc).__name__}: {str(exc)[:80]})"
        if args.profile:
            _profile(f"moe={name} {t} tokens, ours", lambda x=x, lo=local, w=wts: ours(c, x, lo, w))
            _profile(f"moe={name} {t} tokens, bf16", lambda x=x, i=ids, lo=local, w=wts: bf16_path(c, x, i, lo, w))
        if args.sweep and t == args.tokens[0] and t <= 16:
            row.update(_sweep_few(c, x, [s[1] for s in sets], wts))
        if args.grouped_sweep and t > fp8_moe.MAX_TOKENS:
            _sweep_grouped(c, x, sets, ceil)
        rows.append(row)
        print(row, flush=True)
    return rows


def _profile(label: str, fn, calls: int = 5, top: int = 14) -> None:
    """Print the kernels of ``fn`` (eager, after a warm-up) by device time: µs per call, share."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    print(f"profile {label}: {total / calls:.1f} us of kernels per call", flush=True)
    for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        print(f"  {e.self_device_time_total / calls:9.1f} us {100 * e.self_device_time_total / total:5.1f}%  "
              f"x{e.count // calls:<3} {e.key[:90]}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 512, 4096])
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["tp", "ep"])
    p.add_argument("--sweep", action="store_true", help="the few-token kernels' configs at the first count")
    p.add_argument("--profile", action="store_true", help="print our path's kernels by device time, per count")
    p.add_argument("--grouped-sweep", action="store_true", help="each grouped GEMM alone over GroupedConfig tiles, "
                   "at every count above the few-token kernels'")
    p.add_argument("--quick", action="store_true", help="tokens 1, 16, 512; moe=tp; no FlashInfer")
    p.add_argument("--no-libs", action="store_true", help="skip FlashInfer's cutlass_fused_moe (its first call "
                   "compiles for minutes)")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.tokens, args.cases, args.no_libs = [1, 16, 512], ["tp"], True
    if not torch.cuda.is_available():
        raise SystemExit("fp8_moe_bench: needs a CUDA GPU (got none). Fix: run it on the device machine.")
    ceil = measure_ceilings()
    rows = []
    for name in args.cases:
        rows += bench_case(name, args, ceil)
        torch.cuda.empty_cache()
    short = ["case", "tokens", "ours_us", "no_tma_us", "down_loop_us", "bf16_us", "flashinfer_us", "ours_copy_pct", "rel_err", "bf16_rel_err",
             "flashinfer_rel_err", "speedup_vs_bf16", "expert_MB"]
    full = Table(rows, title="fp8 MoE experts, all columns", name="full")
    table = Table(rows, title="fp8 MoE experts (D 7168, top-8 of 256, graph-timed, µs; copy % over the touched "
                  "fp8 experts + scales)", columns=short + (["best_us", "fma_best_us", "best_config"] if args.sweep else []),
                  formats={"ours_us": ".1f", "no_tma_us": ".1f", "down_loop_us": ".1f", "bf16_us": ".1f", "ours_copy_pct": ".0f", "rel_err": ".2e",
                           "bf16_rel_err": ".2e", "flashinfer_rel_err": ".2e", "speedup_vs_bf16": ".2f",
                           "expert_MB": ".0f"}, name="short")
    report("fp8_moe_bench", ceil, [full, table], meta={"cases": args.cases, "tokens": args.tokens})


if __name__ == "__main__":
    main()
