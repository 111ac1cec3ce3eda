"""Few-row products: the Triton kernels of ``backends/kernels/gemm/skinny.py`` against cuBLAS and the grouped expert
GEMM.

Shapes are DeepSeek-V3's as one TP8 rank holds them (``--tp 1``: the whole model). Per case: the float64
check (relative error), cuBLAS / grouped-GEMM µs, ours µs, each as % of the copy bandwidth measured in the same
run (bytes: the weights the call reads, plus activations), and the speedup. L2 is flushed before every timed
call (bench/harness.py ``eager_ms``). The ``graph_*`` columns are what a decode step's CUDA graph sees: the call
captured over enough weight copies (or expert sets) that L2 never serves a repeated read, replayed, per call, without
the launch cost that dominates eager timings of 10-20 µs kernels. The absorb table: the MLA's per-head products
at decode, batched matmul against ``skinny.head_linear`` (and each column block), graph-timed the same way.

    python -m bench.gemv_bench                  # linear layers at 1, 4, 16 rows; the MoE at 1, 4, 8, 16 tokens
    python -m bench.gemv_bench --quick          # 1 and 16 rows, 1 and 8 tokens
    python -m bench.gemv_bench --sweep          # also every tile config per shape (the best is printed)
    python -m bench.gemv_bench --sweep moe      # the expert and router kernels' configs only
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

BF = torch.bfloat16
D, Q_LORA, KV_ROW, HEADS, E, TOP_K = 7168, 1536, 576, 128, 256, 8


def linear_shapes(tp: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of every linear layer of one rank (weights [N, K])."""
    h = HEADS // tp
    return [("qkv_a", Q_LORA + KV_ROW, D), ("q_b", h * 192, Q_LORA), ("o", D, h * 128),
            ("dense gate_up", 2 * 18432 // tp, D), ("dense down", D, 18432 // tp), ("lm_head (vocab 129280)",
                                                                                 129280 // tp, D)]


def bench_linear(args, ceil, skinny) -> list[dict]:
    rows = []
    for name, n, kd in linear_shapes(args.tp):
        w = torch.randn(n, kd, device="cuda", dtype=BF) / kd**0.5
        w_copies = _l2_copies(w)
        for m in args.rows:
            x = torch.randn(m, kd, device="cuda", dtype=BF)
            ref = F.linear(x.double(), w.double())
            err = rel_err(skinny.linear(x, w), ref)
            nbytes = (n * kd + m * (kd + n)) * 2
            t_cublas = eager_ms(lambda x=x, w=w: F.linear(x, w))
            t_ours = eager_ms(lambda x=x, w=w: skinny.linear(x, w))
            cfg = skinny.default_config(n, kd, x.device)
            g_cublas = graph_ms([lambda x=x, w=c: F.linear(x, w) for c in w_copies])
            g_ours = graph_ms([lambda x=x, w=c: skinny.linear(x, w) for c in w_copies])
            row = {"layer": name, "N": n, "K": kd, "rows": m, "rel_err": err, "cublas_us": t_cublas * 1e3,
                   "ours_us": t_ours * 1e3, "cublas_copy_pct": ceil.pct_copy(nbytes, t_cublas),
                   "ours_copy_pct": ceil.pct_copy(nbytes, t_ours), "speedup": t_cublas / t_ours,
                   "config": f"n{cfg.block_n}.k{cfg.block_k}.w{cfg.num_warps}.s{cfg.num_stages}",
                   "graph_cublas_us": g_cublas * 1e3, "graph_ours_us": g_ours * 1e3,
                   "graph_ours_copy_pct": ceil.pct_copy(nbytes, g_ours)}
            if "linear" in args.sweep and m == args.rows[0]:  # the config does not depend on the row count
                best = _best([(_try_graph_ms([lambda c=c, x=x, w=wc: skinny.linear(x, w, c) for wc in w_copies]), c)
                              for c in _linear_configs(skinny)])
                row["best_us"] = best[0] * 1e3
                row["best_config"] = f"n{best[1].block_n}.k{best[1].block_k}.w{best[1].num_warps}.s{best[1].num_stages}"
            rows.append(row)
            print(row, flush=True)
    return rows


def bench_absorb(args, ceil, skinny) -> list[dict]:
    """The absorbed MLA's per-head products (q_nope @ w_uk, o_lat @ w_uv): torch.bmm (what TorchOps and more rows
    run) against skinny.head_linear, graph-timed over weight copies L2 does not hold."""
    from runtime.model.deepseek.ops import TorchOps

    h, bmm = HEADS // args.tp, TorchOps().head_linear
    rows = []
    for name, kd, n in (("absorb w_uk", 128, 512), ("absorb w_uv", 512, 128)):
        w = torch.randn(h, kd, n, device="cuda", dtype=BF) / kd**0.5
        w_copies = _l2_copies(w)
        for m in args.rows:
            x = torch.randn(m, h, kd, device="cuda", dtype=BF)
            err = rel_err(skinny.head_linear(x, w), torch.einsum("thk,hkn->thn", x.double(), w.double()))
            nbytes = (h * kd * n + m * h * (kd + n)) * 2
            g_bmm = graph_ms([lambda x=x, w=c: bmm(x, w) for c in w_copies])
            g_ours = graph_ms([lambda x=x, w=c: skinny.head_linear(x, w) for c in w_copies])
            by_block = {bn: graph_ms([lambda x=x, w=c, bn=bn: skinny.head_linear(x, w, block_n=bn) for c in w_copies])
                        for bn in (16, 32, 64, 128)}
            rows.append({"product": name, "heads": h, "K": kd, "N": n, "rows": m, "rel_err": err,
                         "graph_bmm_us": g_bmm * 1e3, "graph_ours_us": g_ours * 1e3,
                         "graph_ours_copy_pct": ceil.pct_copy(nbytes, g_ours), "speedup": g_bmm / g_ours,
                         "block_n": skinny.head_block_n(n, h),
                         **{f"n{bn}_us": t * 1e3 for bn, t in by_block.items()}})
            print(rows[-1], flush=True)
    return rows


def _linear_configs(skinny):
    """The sweep's configs (graph-timed): 4 warps (8 never won an eager sweep), 3 to 5 stages."""
    return [skinny.TileConfig(bn, bk, 4, s) for bn in (16, 32, 64, 128) for bk in (128, 256, 512) for s in (3, 4, 5)
            if bn * bk <= 32768]


def _moe_weights(tp: int):
    from runtime.model.deepseek.weights import DenseMLPWeights, MoEWeights

    i = 2048 // tp
    dev = "cuda"
    return MoEWeights(gate=torch.randn(E, D, device=dev) / D**0.5, bias=torch.randn(E, device=dev) * 0.01,
                      gate_up=(torch.randn(E, 2 * i, D, device=dev) / D**0.5).to(BF),
                      down=(torch.randn(E, D, i, device=dev) / i**0.5).to(BF),
                      shared=DenseMLPWeights((torch.randn(2 * i, D, device=dev) / D**0.5).to(BF),
                                             (torch.randn(D, i, device=dev) / i**0.5).to(BF)))


def bench_moe(args, ceil, skinny) -> list[dict]:
    from types import SimpleNamespace

    from runtime.model.deepseek.moe import route
    from runtime.model.deepseek.ops import FusedOps, TorchOps
    from runtime.model.deepseek.weights import DenseMLPWeights, MoEWeights

    spec = SimpleNamespace(num_experts_per_tok=TOP_K, n_group=8, topk_group=4, scoring_func="sigmoid",
                           topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5)
    w = _moe_weights(args.tp)
    few, grouped, ref_ops = FusedOps(16), FusedOps(0), TorchOps()
    w32 = MoEWeights(w.gate, w.bias, w.gate_up.float(), w.down.float(),
                     DenseMLPWeights(w.shared.gate_up.float(), w.shared.down.float()))
    i = w.gate_up.shape[1] // 2
    sh = (w.shared.gate_up, w.shared.down)
    rows = []
    for t in args.tokens:
        x = torch.randn(t, D, device="cuda", dtype=BF)
        weights, ids = route(spec, w, x)
        experts = int(ids.unique().numel())
        expert_bytes = _experts_bytes([ids], t, i)  # routed + shared experts, the hidden rows
        nbytes = expert_bytes + E * D * 4  # and the float32 router
        ref = ref_ops.moe(spec, w32, x.float(), False)  # float32 weights, a GEMM pair per active expert
        err = rel_err(few.moe(spec, w, x, True), ref)
        err_grouped = rel_err(grouped.moe(spec, w, x, True), ref)
        t_grouped = eager_ms(lambda x=x: grouped.moe(spec, w, x, True))
        t_few = eager_ms(lambda x=x: few.moe(spec, w, x, True))
        t_kernels = eager_ms(lambda x=x, i_=ids, w_=weights: skinny.moe_experts(x, i_, w_, w.gate_up, w.down, *sh))
        t_router = eager_ms(lambda x=x: skinny.linear_f32(x, w.gate))
        id_sets = _expert_sets(t, args.graph_sets)  # other experts per call: L2 never serves them
        g_kernels = graph_ms([lambda x=x, i_=i_, w_=weights: skinny.moe_experts(x, i_, w_, w.gate_up, w.down, *sh)
                              for i_ in id_sets])
        g_bytes = _experts_bytes(id_sets, t, i)
        row = {"tokens": t, "experts_read": experts, "rel_err": err, "rel_err_grouped": err_grouped,
               "grouped_us": t_grouped * 1e3, "ours_us": t_few * 1e3, "speedup": t_grouped / t_few,
               "ours_copy_pct": ceil.pct_copy(nbytes, t_few),
               "experts_kernels_us": t_kernels * 1e3,
               "experts_copy_pct": ceil.pct_copy(expert_bytes, t_kernels), "router_us": t_router * 1e3,
               "router_copy_pct": ceil.pct_copy(E * D * 4, t_router), "graph_experts_us": g_kernels * 1e3,
               "graph_experts_copy_pct": ceil.pct_copy(g_bytes, g_kernels)}
        if "moe" in args.sweep and t == args.tokens[0]:
            row.update(_sweep_experts(skinny, x, id_sets, weights, w, sh), **_sweep_router(skinny, x, w.gate))
        rows.append(row)
        print(rows[-1], flush=True)
    return rows


def _best(timed: list[tuple[float, object]]) -> tuple[float, object]:
    """The fastest (time, config) pair."""
    return min(timed, key=lambda p: p[0])


def _l2_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """``w`` and enough clones of it that a graph rotating over them never reads a weight L2 still holds."""
    return [w] + [w.clone() for _ in range(copies_for_l2(w.numel() * w.element_size()) - 1)]


def _try_graph_ms(calls) -> float:
    """``graph_ms(calls)``, or infinity for a config that does not fit the GPU (shared memory, registers)."""
    from triton.runtime.errors import OutOfResources

    try:
        return graph_ms(calls)
    except OutOfResources:
        return float("inf")


def _expert_sets(tokens: int, n: int) -> list[torch.Tensor]:
    """``n`` routings of ``tokens`` tokens to TOP_K distinct random experts each."""
    return [torch.stack([torch.randperm(E, device="cuda")[:TOP_K] for _ in range(tokens)]) for _ in range(n)]


def _experts_bytes(id_sets: list[torch.Tensor], tokens: int, inter: int) -> float:
    """Mean bytes one moe_experts call reads over ``id_sets``: its distinct experts + the shared one, hidden rows."""
    experts = sum(int(ids.unique().numel()) for ids in id_sets) / len(id_sets)
    return (experts + 1) * 3 * inter * D * 2 + tokens * D * 2


def _sweep_experts(skinny, x, id_sets, weights, w, sh) -> dict:
    """Graph-timed: up-kernel knobs with the default down kernel, then down-kernel knobs with the default up."""
    base = skinny.ExpertConfig()
    run = lambda c: _try_graph_ms([lambda i_=i_: skinny.moe_experts(x, i_, weights, w.gate_up, w.down, *sh, config=c)  # noqa: E731
                                   for i_ in id_sets])
    ups = [(run(c), f"up i{c.up_block_i}.k{c.up_block_k}.s{c.num_stages}") for bi in (16, 32, 64)
           for bk in (128, 256, 512) for st in (3, 4, 5, 6)
           if (c := skinny.ExpertConfig(bi, bk, base.down_block_d, base.down_block_i, 4, st))]
    downs = [(run(c), f"down d{c.down_block_d}.i{c.down_block_i}.s{c.num_stages}") for bd in (16, 32, 64)
             for bi in (64, 128, 256) for st in (3, 4, 5)
             if (c := skinny.ExpertConfig(base.up_block_i, base.up_block_k, bd, bi, 4, st))]
    (tu, cu), (td, cd) = _best(ups), _best(downs)
    return {"sweep_best_up_us": tu * 1e3, "sweep_best_up": cu, "sweep_best_down_us": td * 1e3, "sweep_best_down": cd}


def _sweep_router(skinny, x, gate) -> dict:
    gates = _l2_copies(gate)
    timed = [(_try_graph_ms([lambda c=c, g=g: skinny.linear_f32(x, g, c) for g in gates]),
              f"n{c.block_n}.k{c.block_k}.w{c.num_warps}")
             for bn in (1, 2, 4, 8) for bk in (512, 1024, 2048) for nw in (4, 8)
             if (c := skinny.TileConfig(bn, bk, nw, 3))]
    t, c = _best(timed)
    return {"sweep_best_router_us": t * 1e3, "sweep_best_router": c}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gemv_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel ranks the shapes are cut for")
    ap.add_argument("--rows", type=int, nargs="+", default=None, help="rows of the linear layers (default 1 4 16)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="MoE tokens (default 1 4 8 16)")
    ap.add_argument("--sweep", nargs="*", choices=["linear", "moe"], default=None,
                    help="time every tile config per shape at the first row / token count (no value: both)")
    ap.add_argument("--quick", action="store_true", help="1 and 16 rows, 1 and 8 tokens")
    ap.add_argument("--graph-sets", type=int, default=8, help="expert routings the MoE graph timings rotate over")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    args.sweep = [] if args.sweep is None else (args.sweep or ["linear", "moe"])
    args.rows = args.rows or ([1, 16] if args.quick else [1, 4, 16])
    args.tokens = args.tokens or ([1, 8] if args.quick else [1, 4, 8, 16])
    if not torch.cuda.is_available():
        raise SystemExit("gemv_bench: needs a CUDA GPU (got none). Fix: run it on the device machine.")
    from backends.kernels.gemm import skinny

    torch.manual_seed(0)
    ceil = measure_ceilings()
    tables = [Table(bench_linear(args, ceil, skinny), title="linear layers (bf16; ours: skinny.linear)",
                    name="linear"),
              Table(bench_absorb(args, ceil, skinny), title="absorbed MLA per-head products (bf16; ours: "
                    "skinny.head_linear)", name="absorb"),
              Table(bench_moe(args, ceil, skinny), title="routed + shared experts with routing (FusedOps.moe: grouped GEMM "
                    "path vs the two few-row kernels)", name="moe")]
    report("gemv_bench", ceil, tables, meta={"tp": args.tp})


if __name__ == "__main__":
    main()
