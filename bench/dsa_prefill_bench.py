#!/usr/bin/env python
"""DeepSeek-V3.2 prefill of one layer, sparse (every token its own indexer top-k) against dense, at 8k / 32k /
128k prompt tokens, with the bf16 matmul ceiling measured in the same run (issue 48).

    python -m bench.dsa_prefill_bench            # 8k, 32k, 128k
    python -m bench.dsa_prefill_bench --quick    # 8k, 32k
    python -m bench.dsa_prefill_bench --smoke    # the code paths on the CPU interpreter, tiny sizes, no numbers

Shapes: one GPU of V3.2 (128 heads, kv_lora 512, rope 64; indexer 64 heads x 128, top-2048), bf16, page 64. The
prompt is prefilled in chunks of ``CHUNK`` (8192) tokens, as the engine does with ``chunked_prefill_size``; a
row's time is the sum over its chunks (each chunk timed with :func:`bench.harness.eager_ms`).

* sparse: the indexer over each chunk token's causal prefix (:func:`indexer_topk_extend`, tiles of query tokens
  in a ``SCRATCH`` scratch), positions -> locations, the sparse extend kernel (:func:`sparse_mla_extend`); the
  two parts timed alone too. The attention kernel's TFLOP/s (``T * K * H * (576 + 512) * 2``) as % of the
  matmul ceiling.
* dense: FlashInfer's ragged MHA prefill (qk 192 / vo 128, causal, the MHA chunked-prefix path's kernel) when
  FlashInfer imports, and our Triton absorbed extend (:func:`mla_extend`) up to 32k.

Each kernel's output is checked against the torch reference on the last chunk's final 64 tokens first.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
SMOKE = __name__ == "__main__" and "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from backends.kernels.mla_extend.mla_extend import mla_extend  # noqa: E402
from backends.kernels.sparse.indexer import indexer_topk_reference  # noqa: E402
from backends.kernels.sparse.indexer_extend import indexer_topk_extend  # noqa: E402
from backends.kernels.sparse.sparse_mla_extend import (  # noqa: E402
    sparse_mla_extend,
    sparse_mla_extend_reference,
    topk_locations,
)
from bench import harness  # noqa: E402
from bench.harness import Table, measure_ceilings, rel_err, report, tflop_per_s  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
DT = torch.bfloat16
D_CKV, D_PE = 512, 64
if SMOKE:
    H, HI, DI, TOPK, PAGE, CHUNK, SCRATCH = 16, 4, 32, 16, 16, 32, 1 << 16
    LENGTHS_FULL = LENGTHS_QUICK = (48, 80)
else:
    H, HI, DI, TOPK, PAGE, CHUNK, SCRATCH = 128, 64, 128, 2048, 64, 8192, 256 << 20
    LENGTHS_FULL, LENGTHS_QUICK = (8192, 32768, 131072), (8192, 32768)
SCALE = 1.0 / math.sqrt(192)
ABSORBED_MAX = 32768  # our dense absorbed extend (3.4x the MHA path's flops) only up to here
CHECK_TOKENS = 64

eager_ms = partial(harness.eager_ms, warmup_ms=5, rep_ms=30, device=DEV)


def log(msg: str) -> None:
    print(msg, flush=True)


class Problem:
    """One request of ``n`` tokens: latent cache (paged), indexer keys by slot, and one chunk's queries."""

    def __init__(self, n: int, gen: torch.Generator):
        pages = -(-n // PAGE) + 1
        self.n = n
        self.kv = (torch.randn(pages * PAGE, D_CKV + D_PE, generator=gen, device=DEV) * 0.5).to(DT)
        perm = torch.randperm(pages - 1, generator=gen, device=DEV) + 1  # page 0 stays padding
        slots = (perm[:, None] * PAGE + torch.arange(PAGE, device=DEV)[None, :]).reshape(-1)[:n]
        self.table = slots.to(torch.int32)[None, :].contiguous()  # [1, n] request table
        self.keys = torch.zeros(pages * PAGE, DI, device=DEV, dtype=DT)
        self.keys[slots.long()] = torch.randn(n, DI, generator=gen, device=DEV).to(DT)
        c = min(CHUNK, n)
        self.q_nope = (torch.randn(c, H, D_CKV, generator=gen, device=DEV) * 0.1).to(DT)
        self.q_pe = (torch.randn(c, H, D_PE, generator=gen, device=DEV) * 0.1).to(DT)
        self.iq = torch.randn(c, HI, DI, generator=gen, device=DEV).to(DT)
        self.iw = torch.rand(c, HI, generator=gen, device=DEV) - 0.3
        self.rows = torch.zeros(1, dtype=torch.int64, device=DEV)
        self.scratch = torch.empty(SCRATCH, dtype=torch.uint8, device=DEV)
        self.attn_scratch = torch.empty(0, dtype=torch.uint8, device=DEV)
        self.out = torch.empty(c, H, D_CKV, device=DEV, dtype=DT)

    def chunks(self):
        """(prefix, tokens) of each prefill chunk."""
        return [(p, min(CHUNK, self.n - p)) for p in range(0, self.n, CHUNK)]

    def chunk_args(self, p: int, c: int):
        pos = torch.arange(p, p + c, device=DEV)
        indptr = torch.tensor([0, c], dtype=torch.int32, device=DEV)
        return pos, indptr, self.rows[:1].expand(c)

    def indexer(self, p: int, c: int):
        pos, indptr, _ = self.chunk_args(p, c)
        return indexer_topk_extend(self.iq[:c], self.iw[:c], self.keys, self.table, self.rows, pos, indptr, TOPK,
                                   max_len=p + c, scratch=self.scratch)[0]

    def attention(self, p: int, c: int, topk: torch.Tensor, **tiling):
        locs = topk_locations(topk, self.table, self.rows[:1].expand(c))
        return sparse_mla_extend(self.q_nope[:c], self.q_pe[:c], self.kv, locs, SCALE, self.attn_scratch,
                                 out=self.out[:c], **tiling)

    def sparse(self, p: int, c: int):
        return self.attention(p, c, self.indexer(p, c))

    def check(self) -> float:
        """Indexer + attention of the last chunk's final tokens against the torch references (rel err)."""
        p, c = self.chunks()[-1]
        pos, indptr, rows = self.chunk_args(p, c)
        s = c - min(CHECK_TOKENS, c)
        ours = self.indexer(p, c)[s:]
        ref = indexer_topk_reference(self.iq[s:c], self.iw[s:c], self.keys, self.table, self.rows, pos[s:],
                                     torch.tensor([0, c - s], dtype=torch.int32, device=DEV), TOPK)[0]
        # attention over the reference selection (equal scores may pick other positions)
        locs = topk_locations(ref, self.table, rows[s:])
        want = sparse_mla_extend_reference(self.q_nope[s:c], self.q_pe[s:c], self.kv, locs, SCALE)
        got = sparse_mla_extend(self.q_nope[s:c], self.q_pe[s:c], self.kv, locs, SCALE)
        agree = (torch.sort(ours, 1).values == torch.sort(ref, 1).values).float().mean().item()
        log(f"    check: indexer selection agreement {agree:.4f}, attention rel err {rel_err(got, want):.1e}")
        return rel_err(got, want)


def dense_absorbed_ms(pr: Problem, p: int, c: int) -> float:
    pages = pr.kv.view(-1, PAGE, D_CKV + D_PE)
    page_table = (pr.table[:, ::PAGE] // PAGE).contiguous()
    indptr = torch.tensor([0, c], dtype=torch.int32, device=DEV)
    seq = torch.tensor([p + c], dtype=torch.int32, device=DEV)
    return eager_ms(lambda: mla_extend(pr.q_nope[:c], pr.q_pe[:c], pages, page_table, indptr, seq, SCALE,
                                       pr.out[:c], max_q_len=c))


class DenseMHA:
    """FlashInfer ragged prefill, causal, q = the chunk, kv = prefix + chunk (qk 192 / vo 128)."""

    def __init__(self):
        from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

        self.cls = BatchPrefillWithRaggedKVCacheWrapper
        self.ws = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)

    def ms(self, p: int, c: int, gen) -> float:
        q = torch.randn(c, H, 192, device=DEV, dtype=DT, generator=gen)
        k = torch.randn(p + c, H, 192, device=DEV, dtype=DT, generator=gen)
        v = torch.randn(p + c, H, 128, device=DEV, dtype=DT, generator=gen)
        w = self.cls(self.ws, "NHD", backend="auto")
        w.plan(torch.tensor([0, c], dtype=torch.int32), torch.tensor([0, p + c], dtype=torch.int32), H, H, 192,
               head_dim_vo=128, causal=True, sm_scale=SCALE, q_data_type=DT, kv_data_type=DT)
        return eager_ms(lambda: w.run(q, k, v))


#: (block_h, block_n, num_warps, num_stages) of the sparse extend kernel that ``--tilings`` times
TILINGS = ((64, 32, 8, 2), (64, 16, 4, 2), (64, 16, 8, 3), (64, 32, 8, 1), (64, 32, 8, 3), (64, 32, 4, 2),
           (64, 64, 8, 2), (64, 64, 8, 1), (32, 64, 4, 2), (32, 64, 8, 3), (32, 32, 4, 3), (16, 64, 4, 3),
           (128, 16, 8, 2), (128, 32, 8, 1))


def time_tilings(ceil, gen) -> None:
    """The sparse extend kernel's tilings on the last chunk of a 32k prompt (one chunk, the same selection for
    each; each checked against the default tiling first): ms, TFLOP/s and % of the matmul ceiling."""
    n = LENGTHS_QUICK[-1]
    pr = Problem(n, gen)
    p, c = pr.chunks()[-1]
    topk = pr.indexer(p, c)
    want = pr.attention(p, c, topk).clone()
    flops = c * TOPK * H * (D_CKV + D_PE + D_CKV) * 2
    rows = []
    for bh, bn, nw, ns in TILINGS:
        tiling = dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns)
        try:
            err = rel_err(pr.attention(p, c, topk, **tiling), want)
            ms = eager_ms(lambda t=tiling: pr.attention(p, c, topk, **t))
        except Exception as e:  # noqa: BLE001  (a tiling that does not compile or fit is a row, not a stop)
            log(f"    {tiling}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        rows.append({"block_h": bh, "block_n": bn, "warps": nw, "stages": ns, "ms": ms,
                     "tflops": tflop_per_s(flops, ms), "pct_matmul": ceil.pct_matmul(flops, ms), "rel_err": err})
    title = f"sparse extend tilings: {c} tokens after a {p}-token prefix, H {H}, top-{TOPK}, bf16 (first row: default)"
    report("dsa_prefill_tilings", ceil, Table(rows, title=title, formats={"ms": ".3g", "tflops": ".3g",
                                                                          "pct_matmul": ".3g", "rel_err": ".1e"}),
           meta={"tokens": c, "prefix": p})


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8k and 32k only")
    ap.add_argument("--smoke", action="store_true", help="the CPU interpreter, tiny sizes, no numbers")
    ap.add_argument("--no-fi", action="store_true", help="skip the FlashInfer dense prefill")
    ap.add_argument("--tilings", action="store_true", help="only the sparse extend kernel's tilings (last 32k chunk)")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    lengths = LENGTHS_QUICK if (args.quick or SMOKE) else LENGTHS_FULL
    ceil = measure_ceilings(DEV)
    log(f"ceilings: {ceil.summary()}")
    gen = torch.Generator(device=DEV).manual_seed(0)
    if args.tilings:
        return time_tilings(ceil, gen)
    mha = None
    if not (SMOKE or args.no_fi):
        try:
            mha = DenseMHA()
        except Exception:
            log(f"FlashInfer unavailable:\n{traceback.format_exc()}")
    rows = []
    for n in lengths:
        log(f"prompt {n} tokens ({-(-n // CHUNK)} chunks of {CHUNK})")
        pr = Problem(n, gen)
        err = pr.check()
        t = {"indexer": 0.0, "attention": 0.0, "sparse": 0.0, "mha": 0.0, "absorbed": 0.0}
        flops = {"attention": 0.0, "mha": 0.0}
        for p, c in pr.chunks():
            topk = pr.indexer(p, c)
            t["indexer"] += eager_ms(lambda p=p, c=c, pr=pr: pr.indexer(p, c))
            t["attention"] += eager_ms(lambda p=p, c=c, k=topk, pr=pr: pr.attention(p, c, k))
            t["sparse"] += eager_ms(lambda p=p, c=c, pr=pr: pr.sparse(p, c))
            flops["attention"] += c * TOPK * H * (D_CKV + D_PE + D_CKV) * 2
            flops["mha"] += (c * p + c * (c + 1) // 2) * H * (192 + 128) * 2  # causal: query i sees p + i + 1 keys
            if mha is not None:
                t["mha"] += mha.ms(p, c, gen)
            if n <= ABSORBED_MAX:
                t["absorbed"] += dense_absorbed_ms(pr, p, c)
        log(f"    sparse {t['sparse']:.2f} ms (indexer {t['indexer']:.2f}, attention {t['attention']:.2f}); "
            f"dense MHA {t['mha']:.2f} ms, dense absorbed {t['absorbed']:.2f} ms")
        att_tf = tflop_per_s(flops["attention"], t["attention"])
        row = {"tokens": n, "sparse_ms": t["sparse"], "indexer_ms": t["indexer"], "attention_ms": t["attention"],
               "attn_tflops": att_tf, "attn_pct_matmul": ceil.pct_matmul(flops["attention"], t["attention"]),
               "dense_mha_ms": t["mha"] or None, "dense_absorbed_ms": t["absorbed"] or None,
               "x_vs_mha": t["mha"] / t["sparse"] if t["mha"] else None,
               "x_vs_absorbed": t["absorbed"] / t["sparse"] if t["absorbed"] else None,
               "mha_tflops": tflop_per_s(flops["mha"], t["mha"]) if t["mha"] else None, "attn_rel_err": err}
        rows.append(row)
        pr = None  # free this length's buffers before the next
        if DEV == "cuda":
            torch.cuda.empty_cache()
    goal = {8192: "", 32768: ">= 3x", 131072: ">= 10x"}
    for r in rows:
        ref = r["x_vs_mha"] or r["x_vs_absorbed"]
        g = goal.get(r["tokens"], "")
        r["goal"], r["met"] = g, ("" if not g or ref is None else ("yes" if ref >= float(g[3:-1]) else "NO"))
    title = (f"DeepSeek-V3.2 prefill, one layer, bf16: H {H}, indexer {HI} x {DI}, top-{TOPK}, chunks of {CHUNK}; "
             f"times are sums over chunks (ms)")
    table = Table(rows, title=title, formats={k: ".3g" for k in rows[0] if k not in ("tokens", "goal", "met")})
    report("dsa_prefill_bench", ceil, table, meta={"smoke": SMOKE, "H": H, "HI": HI, "DI": DI, "TOPK": TOPK,
                                                   "CHUNK": CHUNK, "scratch_bytes": SCRATCH})


if __name__ == "__main__":
    main()
