"""DeepSeek-V4's fp4 routed experts (``backends/kernels/gemm/fp4_moe.py``) against the bf16 path of the same routing
and the per-expert torch loop they replace.

DeepSeek-V4-Flash shapes, D 4096, top-6 over 256 experts with random routing, V4's clamped SwiGLU (limit 10), routed
experts only (the shared expert is an fp8 linear layer, not these kernels):

* ``tp8``: every rank holds all 256 experts cut to I 256 (moe=tp, parallel.tp=8);
* ``tp2``: all 256 experts cut to I 1024 (parallel.tp=2, the two-GPU deployment of issue 46);
* ``ep8``: rank 0 of 8 holds experts 0..31 whole (I 2048), other ranks' pairs add 0.

Per case and token count (1, 4, 16, 32, 64: ``fp4_moe_experts``; 512, 4096: the sort, ``fp4_grouped_expert_mlp``
and the weighted sum; both through ``runtime.model.deepseek.moe.routed_expert_sum`` as the model calls it): ours µs
(up to 64 tokens the CUDA-core decode kernels, ``fp4_moe.fma_config``; ``tc_us``: the tensor-core ones at T <= 16,
``Fp4ExpertConfig()``; above 64 the grouped GEMMs of ``fp4_moe.grouped_config``), the bf16 path µs (the same
``routed_expert_sum`` on the dequantized bf16 stacks with ``torch._grouped_mm``; at T <= 16 also
``skinny.moe_experts``, the bf16 decode kernels, V3's activation: same bytes), the torch loop µs (the stored path
before these kernels: each active expert dequantized, one host sync; eager, not graphable), ours as % of the copy
bandwidth for the packed bytes the routing touches (e2m1 bytes + ue8m0 scales, each touched expert once, plus
x / out), and the relative error of ours and of bf16 against float64 on the dequantized weights. ``--mx``: the
microscaled (``tl.dot_scaled``) candidates beside (decode kernels at T <= 16, grouped tiles above). Graph-timed
(``bench/harness.py graph_ms``) rotating over enough routings that L2 never serves an expert twice; the copy
ceiling is measured in the same run (``measure_ceilings``).

    python -m bench.fp4_moe_bench                 # every case, every token count
    python -m bench.fp4_moe_bench --tokens 1 16   # some token counts
    python -m bench.fp4_moe_bench --sweep         # also the CUDA-core kernels' tiles at each count up to 64
    python -m bench.fp4_moe_bench --mx            # also the microscaled kernels' candidates
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Table, copies_for_l2, eager_ms, graph_ms, measure_ceilings, rel_err, report  # noqa: E402

D, TOP_K, N_EXPERTS, LIMIT = 4096, 6, 256, 10.0
CASES = {"tp8": dict(n_local=256, inter=256), "tp2": dict(n_local=256, inter=1024),
         "ep8": dict(n_local=32, inter=2048)}


def make_case(n_local: int, inter: int) -> dict:
    """Packed fp4 experts (quantized on the device as the release stores them) and their bf16 dequantization."""
    from runtime.model.quantized import PackedFP4

    torch.manual_seed(0)
    gu = PackedFP4.quantize(torch.randn(n_local, 2 * inter, D, device="cuda") / D**0.5)
    dn = PackedFP4.quantize(torch.randn(n_local, D, inter, device="cuda") / inter**0.5)
    return {"n_local": n_local, "inter": inter, "gu": gu, "dn": dn,
            "bf16": (gu.dequantize(torch.bfloat16), dn.dequantize(torch.bfloat16))}


def routing(t: int, n_local: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-6 of 256 per token -> (global ids [t, 6], routing weights [t, 6] float32)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.rand(t, N_EXPERTS, device="cuda", generator=g).argsort(dim=1)[:, :TOP_K].contiguous()
    return ids, torch.rand(t, TOP_K, device="cuda", generator=g) * 0.3


def touched_bytes(c: dict, id_sets: list[torch.Tensor], t: int) -> float:
    """Mean bytes per call: packed bytes + scales of the touched experts (each once), plus x and out."""
    per = sum(w.nbytes for w in (c["gu"], c["dn"])) / c["n_local"]
    mean_experts = sum(int(ids[ids < c["n_local"]].unique().numel()) for ids in id_sets) / len(id_sets)
    return mean_experts * per + t * D * (2 + 4)


def ours(c: dict, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    from runtime.model.deepseek.moe import GatedAct, routed_expert_sum

    return routed_expert_sum(x, wts, ids, c["gu"], c["dn"], 0, N_EXPERTS, GatedAct(LIMIT), False, torch.float32)


def ours_few(c: dict, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, config) -> torch.Tensor:
    """The decode kernels alone with a tile config (the sweep)."""
    from backends.kernels.gemm import fp4_moe

    n = c["n_local"]
    local = torch.where(ids < n, ids, n).contiguous()
    return fp4_moe.fp4_moe_experts(x, local, wts, c["gu"].weight, c["gu"].scale, c["dn"].weight, c["dn"].scale,
                                   LIMIT, out_dtype=torch.float32, config=config)


def ours_grouped(c: dict, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, config) -> torch.Tensor:
    """``routed_expert_sum``'s grouped path with a given :class:`GroupedConfig` (the selector patched for the call)."""
    from backends.kernels.gemm import fp4_moe

    real = fp4_moe.grouped_config
    fp4_moe.grouped_config = lambda *a: config
    try:
        return ours(c, x, ids, wts)
    finally:
        fp4_moe.grouped_config = real


#: the microscaled (``tl.dot_scaled``) kernels' candidate launches: decode (T <= 16) and grouped
MX_FEW = {"mx16": dict(up_block_i=16, up_block_k=256, down_block_d=16, down_block_i=256),
          "mx32": dict(up_block_i=32, up_block_k=256, down_block_d=32, down_block_i=256),
          "mx64": dict(up_block_i=64, up_block_k=256, down_block_d=64, down_block_i=256),
          "mx32k512": dict(up_block_i=32, up_block_k=512, down_block_d=32, down_block_i=512)}
MX_GROUPED = {"mx64n128": dict(block_m=64, block_n=128, block_k=128, num_warps=8),
              "mx128n128": dict(block_m=128, block_n=128, block_k=128, num_warps=8)}


#: the CUDA-core kernels' candidate tiles (``--sweep``): up (gate / up rows, inputs per step, warps), then down
#: (output columns, hidden inputs per step, warps) with the best up tile
FMA_UP = [(4, 512, 2), (4, 512, 4), (4, 1024, 4), (8, 512, 4), (8, 1024, 4), (16, 512, 4)]
FMA_DOWN = [(4, 512, 2), (8, 512, 2), (8, 1024, 4), (16, 512, 4), (16, 1024, 4), (32, 512, 4), (32, 1024, 8)]


def _sweep_fma(c, x, sets, ref) -> dict:
    """The CUDA-core kernels' tiles (``FMA_UP`` with the first down tile, then ``FMA_DOWN`` with the best up
    one), each printed; returns the best µs, its tiles and its relative error."""
    from backends.kernels.gemm import fp4_moe

    def cfg(up, down):
        return fp4_moe.Fp4ExpertConfig(up[0], up[1], down[0], down[1], num_warps=up[2], num_stages=3, fma=True,
                                       down_warps=down[2])

    def timed(up, down):
        ms = graph_ms([lambda s=s: ours_few(c, x, s[0], s[1], cfg(up, down)) for s in sets])
        print(f"  sweep up {up} down {down}: {ms * 1e3:.1f} us", flush=True)
        return ms

    best_up = min(FMA_UP, key=lambda up: timed(up, FMA_DOWN[0]))
    best = min(((timed(best_up, d), d) for d in FMA_DOWN), key=lambda p: p[0])
    err = rel_err(ours_few(c, x, sets[0][0], sets[0][1], cfg(best_up, best[1])), ref(sets[0]))
    return {"best_us": best[0] * 1e3, "best_config": f"up{best_up} down{best[1]}", "best_rel_err": err}


def _variants(c, x, ids, wts, sets, ref, t, which: str) -> dict:
    """Each candidate launch of ``which`` (``mx``: the microscaled kernels, decode at T <= 16, grouped past the
    CUDA-core kernels' 64 tokens): µs and relative error (a launch that fails to compile is printed, not fatal)."""
    from backends.kernels.gemm import fp4_moe

    out = {}
    few = t <= fp4_moe.MAX_TOKENS
    if not few and t <= fp4_moe.FMA_MAX_TOKENS:  # the model takes the CUDA-core kernels there
        return out
    for name, kw in (MX_FEW if few else MX_GROUPED).items():
        cfg = fp4_moe.Fp4ExpertConfig(**kw, mx=True) if few else fp4_moe.GroupedConfig(**kw, mx=True)
        run = ours_few if few else ours_grouped
        try:
            out[f"{name}_rel_err"] = rel_err(run(c, x, ids, wts, cfg), ref)
            out[f"{name}_us"] = graph_ms([lambda s=s, x=x, cfg=cfg, run=run: run(c, x, s[0], s[1], cfg) for s in sets]) * 1e3
        except Exception as e:  # noqa: BLE001 - a launch that does not fit (shared memory, registers)
            print(f"  {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    return out


def bf16_path(c: dict, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    from runtime.model.deepseek.moe import GatedAct, routed_expert_sum

    gu, dn = c["bf16"]
    return routed_expert_sum(x, wts, ids, gu, dn, 0, N_EXPERTS, GatedAct(LIMIT), True, torch.float32)


def skinny_path(c: dict, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    """bf16 decode kernels (V3's plain SiLU: the same bytes and products as the clamped SwiGLU)."""
    from backends.kernels.gemm import skinny

    n = c["n_local"]
    local = torch.where(ids < n, ids, n).contiguous()
    return skinny.moe_experts(x, local, wts, *c["bf16"], None, None, others=n < N_EXPERTS)


def torch_loop(c: dict, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    """The stored path before the kernels: per active expert, dequantized, one host sync (the CPU's reference)."""
    from runtime.model.deepseek.moe import routed_expert_sum

    def act(h):  # a plain callable: not a GatedAct, so routed_expert_sum keeps its per-expert loop
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=LIMIT)) * up.clamp(min=-LIMIT, max=LIMIT)

    return routed_expert_sum(x, wts, ids, c["gu"], c["dn"], 0, N_EXPERTS, act, False, torch.float32)


def reference(c: dict, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
    """float64 on the dequantized weights, one touched expert at a time."""
    from runtime.model.deepseek.moe import GatedAct

    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in ids[ids < c["n_local"]].unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = F.linear(GatedAct(LIMIT)(F.linear(x64[tok], c["gu"][e].dequantize(torch.float64))),
                     c["dn"][e].dequantize(torch.float64))
        out.index_add_(0, tok, y * wts[tok, slot].double()[:, None])
    return out


def bench_case(name: str, args, ceil) -> list[dict]:
    from backends.kernels.gemm import fp4_moe

    c = make_case(**CASES[name])
    rows = []
    for t in args.tokens:
        x = torch.randn(t, D, device="cuda", dtype=torch.bfloat16)
        ids, wts = routing(t, c["n_local"], seed=t)
        n_sets = copies_for_l2(int(touched_bytes(c, [ids], t)))
        sets = [routing(t, c["n_local"], seed=1000 * t + j) for j in range(n_sets)]
        ref = reference(c, x, ids, wts)
        row = {"case": name, "tokens": t, "rel_err": rel_err(ours(c, x, ids, wts), ref),
               "bf16_rel_err": rel_err(bf16_path(c, x, ids, wts), ref)}
        nbytes = touched_bytes(c, [s[0] for s in sets], t)
        t_ours = graph_ms([lambda s=s, x=x: ours(c, x, *s) for s in sets])
        t_bf16 = graph_ms([lambda s=s, x=x: bf16_path(c, x, *s) for s in sets])
        row.update(ours_us=t_ours * 1e3, bf16_us=t_bf16 * 1e3, speedup_vs_bf16=t_bf16 / t_ours,
                   ours_copy_pct=ceil.pct_copy(nbytes, t_ours), packed_MB=nbytes / 1e6)
        if t <= fp4_moe.MAX_TOKENS:  # the tensor-core decode kernels beside the default CUDA-core ones
            tc = fp4_moe.Fp4ExpertConfig()
            row["tc_rel_err"] = rel_err(ours_few(c, x, ids, wts, tc), ref)
            row["tc_us"] = graph_ms([lambda s=s, x=x, tc=tc: ours_few(c, x, s[0], s[1], tc) for s in sets]) * 1e3
            row["skinny_bf16_us"] = graph_ms([lambda s=s, x=x: skinny_path(c, x, *s) for s in sets]) * 1e3
        if args.mx:
            row.update(_variants(c, x, ids, wts, sets, ref, t, "mx"))
        if not args.no_loop:
            row["torch_loop_us"] = eager_ms(lambda x=x, ids=ids, wts=wts: torch_loop(c, x, ids, wts)) * 1e3
        if args.sweep and t <= fp4_moe.FMA_MAX_TOKENS:
            row.update(_sweep_fma(c, x, sets, lambda s, x=x: reference(c, x, *s)))
        rows.append(row)
        print(row, flush=True)
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 32, 64, 512, 4096])
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["tp8", "tp2", "ep8"])
    p.add_argument("--sweep", action="store_true", help="the CUDA-core kernels' tiles at every count up to 64")
    p.add_argument("--quick", action="store_true", help="tokens 1, 16, 512; tp8; no torch loop")
    p.add_argument("--no-loop", action="store_true", help="skip the eager per-expert torch loop")
    p.add_argument("--mx", action="store_true", help="also the microscaled (tl.dot_scaled) kernels' candidates")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.tokens, args.cases, args.no_loop = [1, 16, 512], ["tp8"], True
    if not torch.cuda.is_available():
        raise SystemExit("fp4_moe_bench: needs a CUDA GPU (got none). Fix: run it on the device machine.")
    ceil = measure_ceilings()
    rows = []
    for name in args.cases:
        rows += bench_case(name, args, ceil)
        torch.cuda.empty_cache()
    mx_cols = sorted({k for r in rows for k in r if k.startswith("mx") and k.endswith("_us")})
    short = ["case", "tokens", "ours_us", "tc_us", "bf16_us", "skinny_bf16_us", "torch_loop_us", "ours_copy_pct", "rel_err",
             "bf16_rel_err", "speedup_vs_bf16", "packed_MB"]
    full = Table(rows, title="fp4 MoE experts, all columns", name="full")
    table = Table(rows, title="fp4 MoE experts (V4-Flash: D 4096, top-6 of 256, clamped SwiGLU, graph-timed, µs; "
                  "copy % over the touched packed experts + scales)",
                  columns=short + mx_cols + (["best_us", "best_config"] if args.sweep else []),
                  formats={"ours_us": ".1f", "tc_us": ".1f", "bf16_us": ".1f", "skinny_bf16_us": ".1f", "torch_loop_us": ".0f",
                           "ours_copy_pct": ".0f", "rel_err": ".2e", "bf16_rel_err": ".2e",
                           "speedup_vs_bf16": ".2f", "packed_MB": ".1f", **{k: ".1f" for k in mx_cols}, "best_us": ".1f"},
                  name="short")
    report("fp4_moe_bench", ceil, [full, table], meta={"cases": args.cases, "tokens": args.tokens})


if __name__ == "__main__":
    main()
