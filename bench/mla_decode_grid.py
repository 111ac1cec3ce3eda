"""MLA decode grid: our Triton kernel against FlashInfer's MLA decode, bf16 and fp8 (e4m3) caches.

For every (heads, batch, lengths) case: our time, FlashInfer's time, the ratio FlashInfer / ours (> 1: ours is
faster), % of the copy bandwidth (KV bytes read + q + out) and % of the bf16 matmul peak (2 H L (576 + 512)
FLOPs), both ceilings measured in this run (bench/harness.py). Each variant is first checked against a float32 torch
reference on the first requests of the batch reading the same (dequantized) cache. Prints a table and one JSON
line (``BENCH_JSON {...}``).

    python -m bench.mla_decode_grid                         # the whole grid
    python -m bench.mla_decode_grid --heads 128 --shapes 64x4096 --variants tma,ptr  # a sweep
    python -m bench.mla_decode_grid --heads 16 --dtypes fp8 --variants default,tma.s4,ptr.p2  # knobs
    python -m bench.mla_decode_grid --heads 64,128 --dtypes bf16 --variants triton,wgmma  # the two stage 1s
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import Table, eager_ms, graph_ms, measure_ceilings, report  # noqa: E402

D_CKV, D_PE, PAGE = 512, 64, 64
FP8 = torch.float8_e4m3fn
SHAPES = ("64x4096", "128x8192", "64x32768", "128xv8192")  # BxL; "v": lengths ~ N(mean, mean / 2); "+" joins


def _lengths(shape: str, g: torch.Generator) -> list[int]:
    """Request lengths of a shape: BxL, Bxv<mean>, or groups joined by "+" (``63x512+1x70000``: one long request
    among short ones)."""
    if "+" in shape:
        return [n for part in shape.split("+") for n in _lengths(part, g)]
    b, l_ = shape.split("x")
    b = int(b)
    if l_.startswith("v"):
        mean = int(l_[1:])
        x = torch.randn(b, generator=g) * (mean / 2) + mean
        return x.clamp(1, 2 * mean).round().int().tolist()
    return [int(l_)] * b


class Case:
    """One batch: a shuffled paged cache in bf16 and its fp8 copy, q, page table, lengths (device)."""

    def __init__(self, heads: int, lens: list[int], scale: float, g: torch.Generator):
        self.h, self.lens, self.scale = heads, lens, scale
        b = len(lens)
        pages = [math.ceil(n / PAGE) for n in lens]
        total = sum(pages) + 1
        perm = torch.randperm(total, generator=g)[: sum(pages)]
        self.width = max(pages)
        pt = torch.zeros(b, self.width, dtype=torch.int32)
        pos = 0
        for i, n in enumerate(pages):
            pt[i, :n] = perm[pos : pos + n].to(torch.int32)
            pos += n
        dev = "cuda"
        self.kv = (torch.randn(total, PAGE, D_CKV + D_PE, device=dev) * 2).to(torch.bfloat16)
        self.kv8 = (self.kv.float() / scale).clamp(-448, 448).to(FP8)
        self.pt, self.seq = pt.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev)
        self.qn = torch.randn(b, heads, D_CKV, device=dev, dtype=torch.bfloat16)
        self.qp = torch.randn(b, heads, D_PE, device=dev, dtype=torch.bfloat16)
        self.sm = 1 / math.sqrt(192)
        self.indices = torch.cat([self.pt[i, :n] for i, n in enumerate(pages)])
        self.indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)

    def reference(self, fp8: bool, n: int = 2) -> torch.Tensor:
        """float32 outputs of the first ``n`` requests (fewer in a smaller batch)."""
        out = []
        for i in range(min(n, len(self.lens))):
            t = torch.arange(self.lens[i], device="cuda")
            kv = self.kv8 if fp8 else self.kv
            rows = kv[self.pt[i, t // PAGE].long(), t % PAGE].float() * (self.scale if fp8 else 1.0)
            s = (self.qn[i].float() @ rows[:, :D_CKV].T + self.qp[i].float() @ rows[:, D_CKV:].T) * self.sm
            out.append(torch.softmax(s, -1) @ rows[:, :D_CKV])
        return torch.stack(out)

    def bytes_moved(self, fp8: bool) -> int:
        per = 1 if fp8 else 2
        return sum(self.lens) * (D_CKV + D_PE) * per + self.qn.numel() * 2 * 2 + self.qp.numel() * 2

    def flops(self) -> float:
        return 2.0 * self.h * sum(self.lens) * (D_CKV + D_PE + D_CKV)


def ours(case: Case, fp8: bool, reuse_plan: bool = False, **kw):
    """Our decode as a timed call. ``reuse_plan``: the first call writes the wgmma plan, the timed ones reuse it (as
    every layer but the first of a decode step does; FlashInfer's plan is outside its timed call too)."""
    from backends.kernels.mla_decode.mla_decode import decode_work_ints, decode_workspace_shapes, mla_decode

    b = len(case.lens)
    po, pl, _ = decode_workspace_shapes(1, case.h, 2048).allocate("cuda")  # one row: a flat space of 2048 slots
    work = torch.empty(decode_work_ints(b, case.h, 2048), dtype=torch.int32, device="cuda")  # the plan of b requests
    out = torch.empty(b, case.h, D_CKV, device="cuda", dtype=torch.bfloat16)
    kv = case.kv8 if fp8 else case.kv
    state = {"plan": None}

    def fn():
        plan = mla_decode(case.qn, case.qp, kv, case.pt, case.seq, case.sm, out, po, pl, max_splits=2048,
                          kv_scale=case.scale, work=work, plan=state["plan"], **kw)
        if reuse_plan:
            state["plan"] = plan
    return fn, out


def flashinfer(case: Case, fp8: bool, ws: torch.Tensor):
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    w = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    b = len(case.lens)
    q_indptr = torch.arange(b + 1, dtype=torch.int32)
    kvd = FP8 if fp8 else torch.bfloat16
    w.plan(q_indptr, case.indptr, case.indices, torch.tensor(case.lens, dtype=torch.int32), case.h, D_CKV, D_PE,
           PAGE, False, case.sm, torch.bfloat16, kvd)
    kv = case.kv8 if fp8 else case.kv
    ckv, kpe = kv[..., :D_CKV], kv[..., D_CKV:]
    extra = dict(ckv_scale=case.scale, kpe_scale=case.scale) if fp8 else {}
    out = torch.empty(b, case.h, D_CKV, device="cuda", dtype=torch.bfloat16)

    def fn():
        w.run(case.qn, case.qp, ckv, kpe, out=out, **extra)
    return fn, out


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out[: ref.shape[0]].float()
    if torch.isnan(o).any():
        return float("inf")
    return ((o - ref).norm() / ref.norm()).item()


VARIANTS = {  # name -> our kernel keywords (None: the defaults for the head count)
    "default": {},
    "ptr": dict(use_tma=False, use_wgmma=False),
    "tma": dict(use_tma=True, use_wgmma=False),
    "triton": dict(use_wgmma=False),  # the Triton stage 1 at its default tiles
    "wgmma": dict(use_wgmma=True),  # a Gluon stage 1 (Hopper: 64-head blocks, or tokens as rows at 16 / 32 heads)
}
_KNOBS = {"h": "block_h", "n": "block_n", "w": "num_warps", "s": "num_stages", "r": "max_regs"}


def variant_kwargs(name: str, sms: int) -> dict:
    """A named variant, or a sweep spec of dot-separated knobs over the defaults: a named variant (``wgmma``),
    ``tma`` / ``ptr`` (alone: the named variants), ``pdl`` (programmatic dependent launch between the plan, stage 1
    and merge kernels, as the engine launches them on sm_90+ with ``model.pdl``), ``reuse`` (the wgmma plan written
    by the first call and reused by the timed ones, as by a step's later layers), ``seesaw`` / ``lockstep`` (64-head
    blocks in the two-warpgroup seesaw kernel or in the lock-step one; by default the seesaw from 128 heads),
    ``fp8scores`` / ``fp16prod`` (64-head blocks over an fp8 cache: fp8 score products, the default, or the lock-step
    kernel's fp16 products), ``h16`` (block_h), ``n128`` (block_n), ``w4`` (warps), ``s3`` (stages), ``r128``
    (register cap), ``p2`` (stage-1 programs per SM), ``g4`` (the wgmma path's merge programs per SM). E.g.
    ``tma.s3.n128``, ``wgmma.pdl.reuse``, ``wgmma.pdl.reuse.fp16prod``."""
    if name in VARIANTS:
        return dict(VARIANTS[name])
    kw: dict = {}
    for tok in name.split("."):
        if tok in ("tma", "ptr"):  # as knobs (the named variants of these names also pick the Triton stage 1)
            kw["use_tma"] = tok == "tma"
        elif tok in VARIANTS:
            kw.update(VARIANTS[tok])
        elif tok == "pdl":
            kw["pdl"] = True
        elif tok == "reuse":
            kw["reuse_plan"] = True
        elif tok in ("seesaw", "lockstep"):
            kw["seesaw"] = tok == "seesaw"
        elif tok in ("fp8scores", "fp16prod"):
            kw["fp8_scores"] = tok == "fp8scores"
        elif tok[:1] == "p" and tok[1:].isdigit():
            kw["target_programs"] = int(tok[1:]) * sms
        elif tok[:1] == "g" and tok[1:].isdigit():
            kw["merge_programs"] = int(tok[1:]) * sms
        elif tok[:1] in _KNOBS and tok[1:].isdigit():
            kw[_KNOBS[tok[:1]]] = int(tok[1:])
        else:
            raise SystemExit(f"unknown variant '{name}' (knob '{tok}'): expected one of {sorted(VARIANTS)} or "
                             f"dot-separated knobs: a variant name, pdl, reuse, seesaw|lockstep, fp8scores|fp16prod, "
                             f"tma|ptr, h<N>, n<N>, w<N>, s<N>, r<N>, p<N>, g<N> (e.g. tma.s3.n128, wgmma.pdl.reuse)")
    return kw


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="16,32,64,128")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="default")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--no-fi", action="store_true")
    ap.add_argument("--rep-ms", type=int, default=150)
    ap.add_argument("--quick", action="store_true", help="one shape (64x4096) at 16 and 128 heads")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays (the GPU time a graphed decode step sees) instead of eager calls "
                         "(which include each launcher's host time)")
    return ap


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.shapes, a.heads = "64x4096", "16,128"
    ceil = measure_ceilings()
    print(ceil.summary(), flush=True)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = {var: variant_kwargs(var, sms) for var in a.variants.split(",")}  # a bad spec fails here
    g = torch.Generator().manual_seed(0)

    def timed(fn):
        return graph_ms([fn], rep_ms=a.rep_ms) if a.graph else eager_ms(fn, rep_ms=a.rep_ms)

    rows = []
    for shape in a.shapes.split(","):
        lens = _lengths(shape, g)
        for h in (int(x) for x in a.heads.split(",")):
            case = Case(h, lens, scale=0.02, g=g)
            for dt in a.dtypes.split(","):
                fp8 = dt == "fp8"
                ref = case.reference(fp8)
                fi_ms = fi_err = None
                if not a.no_fi:
                    try:
                        fn, out = flashinfer(case, fp8, ws)
                        fn()
                        fi_err = _rel(out, ref)
                        fi_ms = timed(fn)
                    except Exception as e:  # noqa: BLE001 - a bench row says what failed
                        print(f"  flashinfer H{h} {shape} {dt}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                for var, kw in variants.items():
                    try:
                        fn, out = ours(case, fp8, **kw)
                        out.fill_(float("nan"))
                        fn()
                        err = _rel(out, ref)
                        ms = timed(fn)
                    except Exception as e:  # noqa: BLE001
                        print(f"  ours {var} H{h} {shape} {dt}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    row = dict(heads=h, shape=shape, dtype=dt, variant=var, us=ms * 1e3, err=err,
                               fi_us=fi_ms * 1e3 if fi_ms else None, fi_err=fi_err,
                               ratio=(fi_ms / ms) if fi_ms else None,
                               bw_pct=ceil.pct_copy(case.bytes_moved(fp8), ms),
                               mm_pct=ceil.pct_matmul(case.flops(), ms))
                    rows.append(row)
                    print(f"  H{h:<3} {shape:<10} {dt:<4} {var:<8} {row['us']:9.1f} us  err {err:.1e}  "
                          f"fi {row['fi_us'] or 0:9.1f} us  ratio {row['ratio'] or 0:5.2f}  "
                          f"bw {row['bw_pct']:5.1f}%  mm {row['mm_pct']:5.1f}%", flush=True)
            del case
            torch.cuda.empty_cache()
    cols = ["heads", "shape", "dtype", "variant", "us", "fi_us", "ratio", "bw_pct", "mm_pct", "err"]
    fmts = {"us": ".1f", "fi_us": ".1f", "ratio": ".2f", "bw_pct": ".1f", "mm_pct": ".1f", "err": ".1e"}
    how = "CUDA-graph replays" if a.graph else "eager calls"
    report("mla_decode_grid", ceil, Table(rows, f"decode grid ({how}): ours vs FlashInfer (ratio = FI us / ours us)",
                                          cols, fmts))


if __name__ == "__main__":
    main()
