#!/usr/bin/env python
"""DeepSeek sparse attention (DSA) + HiSparse kernels on one GPU, against ceilings measured in the same run.

    python -m bench.bench_dsa            # everything, with the tuning sweeps (or: python bench/bench_dsa.py)
    python -m bench.bench_dsa --quick    # default configs only
    python -m bench.bench_dsa --smoke    # the script's code paths on the CPU interpreter, tiny sizes, no numbers

Rows (DeepSeek-V3 TP8 shapes: 16 heads, kv_lora 512, rope 64; batch 32 at 32k context; top-k 2048):

* ceilings (:mod:`bench.harness`): device-to-device ``copy_`` bandwidth (read + write bytes), the bf16 matmul
  rate, and pinned host -> device ``copy_`` bandwidth of a contiguous 1 GiB buffer.
* sparse decode (:func:`sparse_mla_decode`) over a device buffer of ``device_buffer_size`` (4096) rows per
  request, 2048 selected rows each: time, GB/s of KV read (``B * K * 1152`` bytes) and % of copy bandwidth.
* dense decode at the same context: FlashInfer ``BatchMLAPagedAttentionWrapper`` (fa3) and our Triton
  ``mla_decode`` (the triton_mla backend's workspace: 2048 split slots), page 64: time; speed-up of sparse.
* indexer (:func:`indexer_topk`, Hi 64, Di 128, 32k keys per request): total, scoring kernel alone and
  ``torch.topk`` alone; sparse + indexer vs dense.
* device KV bytes, dense (``B * 32k * 576 * 2``) vs sparse (``B * device_buffer_size * 576 * 2``).
* swap-in of misses (:func:`gather_rows_from_host`): 32 x 2048 scattered 1152-byte rows from a pinned host pool
  of >= 1 GiB into random device rows: GB/s as % of the pinned host -> device ``copy_`` of the same bytes; the
  CPU gather + copy for contrast; and the device -> host offload (:func:`scatter_rows_to_host`).

Every kernel output is checked against the torch reference (or exact indexing) before it is timed. Times are
GPU times: the calls captured in a CUDA graph and replayed (:func:`bench.harness.graph_ms`), with inputs
rotated over copies so L2 does not serve repeated reads; eager medians (:func:`bench.harness.eager_ms`) are
printed beside them.
The summary table comes last.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# --smoke must be decided before the Triton kernels are imported (the interpreter is chosen at decoration)
SMOKE = __name__ == "__main__" and "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from backends.kernels.sparse.host_gather import copy_rows, gather_rows_from_host, scatter_rows_to_host  # noqa: E402
from backends.kernels.sparse.indexer import (  # noqa: E402
    indexer_scores,
    indexer_scratch_bytes,
    indexer_topk,
    indexer_topk_reference,
    scores_topk,
)
from backends.kernels.sparse.sparse_mla_decode import (  # noqa: E402
    sparse_decode_scratch_bytes,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)
from bench import harness  # noqa: E402
from bench.harness import Table, gb_per_s, measure_ceilings, rel_err, report  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
DT = torch.bfloat16
D_CKV, D_PE, ROW = 512, 64, 576
ROW_BYTES = ROW * 2
SCALE = 1.0 / math.sqrt(192)
MiB, GiB = 1 << 20, 1 << 30
if SMOKE:
    B, CTX, TOPK, H, DEV_BUF, HI, DI, PAGE, RATIO = 2, 256, 64, 16, 128, 4, 32, 16, 4.0
else:  # the shapes; the dsa_2048 preset: device_buffer_size 4096, host_to_device_ratio 4
    B, CTX, TOPK, H, DEV_BUF, HI, DI, PAGE, RATIO = 32, 32768, 2048, 16, 4096, 64, 128, 64, 4.0

# the harness on this run's device; eager and graph timings as before: 25 ms warm-up, 200 ms of timed calls
eager_ms = partial(harness.eager_ms, warmup_ms=25, rep_ms=200, device=DEV)
graph_ms = partial(harness.graph_ms, warmup_ms=25, rep_ms=200, device=DEV)
sync = partial(harness.sync, DEV)


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------- sparse decode
def sparse_problem(n_copies: int, gen):
    kv = torch.randn(B * DEV_BUF, ROW, device=DEV, dtype=DT, generator=gen)
    q_nope = torch.randn(B, H, D_CKV, device=DEV, dtype=DT, generator=gen)
    q_pe = torch.randn(B, H, D_PE, device=DEV, dtype=DT, generator=gen)
    base = torch.arange(B, device=DEV)[:, None] * DEV_BUF
    locs = [
        (torch.rand(B, DEV_BUF, device=DEV, generator=gen).argsort(1)[:, :TOPK] + base).to(torch.int32)
        for _ in range(n_copies)
    ]
    return kv, q_nope, q_pe, locs


def bench_sparse(quick: bool, copy_gbs: float, gen):
    kv, q_nope, q_pe, locs = sparse_problem(3, gen)
    ref = sparse_mla_decode_reference(q_nope, q_pe, kv, locs[0], SCALE)
    scratch = torch.empty(sparse_decode_scratch_bytes(B, H, D_CKV, 64), dtype=torch.uint8, device=DEV)
    outs = [torch.empty(B, H, D_CKV, device=DEV, dtype=DT) for _ in locs]
    sms = 4 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    configs = [dict()]
    if not quick:
        configs += [
            dict(block_n=32, num_warps=4),
            dict(block_n=32, num_warps=4, num_stages=3),
            dict(block_n=64, num_warps=4),
            dict(block_n=64, num_warps=8, num_stages=3),
            dict(block_n=32, num_warps=8, target_programs=4 * sms),
            dict(block_n=64, num_warps=8, target_programs=4 * sms),
            dict(block_n=64, num_warps=8, target_programs=1 * sms),
            dict(max_splits=4),
            dict(max_splits=6),
            dict(block_n=32, num_warps=4, num_stages=3, max_splits=4),
            dict(block_n=32, num_warps=4, num_stages=4),
            dict(block_n=16, num_warps=4, num_stages=4),
        ]
    read = B * TOPK * ROW_BYTES
    best = None
    for cfg in configs:
        try:
            out = sparse_mla_decode(q_nope, q_pe, kv, locs[0], SCALE, scratch, out=outs[0], **cfg)
            err = rel_err(out, ref)
            if not err < 1e-2:
                log(f"  sparse decode {cfg}: rel err {err:.2e} -- NOT timed")
                continue
            calls = [
                (lambda lc=lc, o=o, cfg=cfg: sparse_mla_decode(q_nope, q_pe, kv, lc, SCALE, scratch, out=o, **cfg))
                for lc, o in zip(locs, outs)
            ]
            e_ms, g_ms = eager_ms(calls[0]), graph_ms(calls)
            gbs = read / (g_ms * 1e-3) / 1e9
            log(f"  sparse decode {cfg}: err {err:.1e}  graph {g_ms * 1e3:7.1f} us  eager {e_ms * 1e3:7.1f} us  "
                f"{gbs:6.0f} GB/s ({100 * gbs / copy_gbs:4.1f}% of copy)")  # fmt: skip
            if best is None or g_ms < best[0]:
                best = (g_ms, cfg, gbs)
        except Exception:
            log(f"  sparse decode {cfg}: FAILED\n{traceback.format_exc()}")
    return best


# -------------------------------------------------------------------------------------------- dense decode
def dense_problem(gen):
    """B requests of CTX tokens on scattered pages of a [pages, PAGE, 576] pool (page 0 unused)."""
    per = CTX // PAGE
    pages = B * per + 1
    buf = torch.randn(pages, PAGE, ROW, device=DEV, dtype=DT, generator=gen)
    perm = (torch.randperm(pages - 1, device=DEV, generator=gen) + 1).to(torch.int32)
    page_table = perm.view(B, per).contiguous()
    q_nope = torch.randn(B, H, D_CKV, device=DEV, dtype=DT, generator=gen)
    q_pe = torch.randn(B, H, D_PE, device=DEV, dtype=DT, generator=gen)
    return buf, page_table, q_nope, q_pe


def bench_dense_triton(buf, page_table, q_nope, q_pe, ref, ctx):
    from backends.kernels.mla_decode.mla_decode import decode_workspace_shapes, mla_decode

    b = q_nope.shape[0]
    splits = max(1, min(2048, 2048 // b))  # the triton_mla backend's defaults (max_splits = split_slots = 2048)
    po, pl, work = decode_workspace_shapes(b, H, splits, D_CKV).allocate(DEV)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
    out = torch.empty(b, H, D_CKV, device=DEV, dtype=DT)

    def call():
        mla_decode(q_nope, q_pe, buf, page_table, lens, SCALE, out, po, pl, work, max_splits=splits)

    call()
    n = ref.shape[0]
    return rel_err(out[:n], ref), eager_ms(call), graph_ms([call])


def bench_dense_flashinfer(buf, page_table, q_nope, q_pe, ref, ctx):
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    b = q_nope.shape[0]
    ws = torch.empty(128 * MiB, dtype=torch.uint8, device=DEV)
    w = BatchMLAPagedAttentionWrapper(ws, backend="fa3")
    per = ctx // PAGE
    qo_indptr = torch.arange(b + 1, dtype=torch.int32)
    kv_indptr = torch.arange(b + 1, dtype=torch.int32) * per
    kv_lens = torch.full((b,), ctx, dtype=torch.int32)
    w.plan(qo_indptr, kv_indptr, page_table.flatten(), kv_lens, H, D_CKV, D_PE, PAGE, False, SCALE, DT, DT)
    ckv, kpe = buf[..., :D_CKV], buf[..., D_CKV:]
    out = torch.empty(b, H, D_CKV, device=DEV, dtype=DT)

    def call():
        w.run(q_nope, q_pe, ckv, kpe, out=out)

    call()
    n = ref.shape[0]
    return rel_err(out[:n], ref), eager_ms(call), graph_ms([call])


def dense_reference(buf, page_table, q_nope, q_pe, n_check: int = 2):
    """float32 dense decode of the first n_check requests: [n_check, H, D_CKV]."""
    ref = torch.zeros(n_check, H, D_CKV, device=DEV)
    for b in range(n_check):
        rows = buf[page_table[b].long()].reshape(-1, ROW).float()
        s = (q_nope[b].float() @ rows[:, :D_CKV].T + q_pe[b].float() @ rows[:, D_CKV:].T) * SCALE
        ref[b] = torch.softmax(s, -1) @ rows[:, :D_CKV]
    return ref


# ---------------------------------------------------------------------------------------------------- indexer
def indexer_problem(gen, scattered_rows: bool = False):
    """B requests of CTX tokens each; their slots are whole pages of PAGE slots in random order (as a paged KV
    allocator hands them out), or, with scattered_rows, every slot random (the worst case for the key gather)."""
    S = B * CTX
    k_cache = torch.randn(S, DI, device=DEV, dtype=DT, generator=gen)
    if scattered_rows:
        r2t = torch.randperm(S, device=DEV, generator=gen).to(torch.int32).view(B, CTX)
    else:
        pages = torch.randperm(S // PAGE, device=DEV, generator=gen).view(B, CTX // PAGE)
        r2t = (pages[:, :, None] * PAGE + torch.arange(PAGE, device=DEV)).view(B, CTX).to(torch.int32)
    q = torch.randn(B, HI, DI, device=DEV, dtype=DT, generator=gen)
    w = torch.rand(B, HI, device=DEV, generator=gen) / HI
    rows = torch.arange(B, device=DEV)
    positions = torch.full((B,), CTX - 1, dtype=torch.int64, device=DEV)
    indptr = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    return q, w, k_cache, r2t, rows, positions, indptr


def bench_indexer(quick: bool):
    """-> (best (ms, cfg), scoring-kernel ms, {top-k variant: ms}, scattered-rows ms)."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    prob = indexer_problem(gen)
    ref_pos, ref_scores = indexer_topk_reference(*prob, TOPK)
    out_pos = torch.empty(B, TOPK, dtype=torch.int32, device=DEV)
    out_scores = torch.empty(B, TOPK, device=DEV)
    scratch = torch.empty(indexer_scratch_bytes(B, CTX, TOPK), dtype=torch.uint8, device=DEV)
    kw = dict(max_len=CTX, out_pos=out_pos, out_scores=out_scores, scratch=scratch)

    def check(tag) -> bool:
        err = float((out_scores - ref_scores).abs().max() / ref_scores.abs().max())
        same_pad = bool(torch.equal(out_pos == -1, ref_pos == -1))
        # the selected positions' own reference scores equal the reported ones (position/score consistency)
        ok = err < 1e-3 and same_pad
        if not ok:
            log(f"  indexer {tag}: score err {err:.2e}, padding equal {same_pad} -- NOT timed")
        return ok

    configs = [dict()]
    if not quick:
        configs += [
            dict(block_n=32),
            dict(block_n=128, num_warps=8),
            dict(block_n=64, keys_per_program=256),
            dict(block_n=64, keys_per_program=1024, num_stages=3),
            dict(block_n=64, num_stages=3),
            dict(block_n=64, num_stages=4),
            dict(block_n=64, num_warps=8),
            dict(block_n=128, num_warps=8, num_stages=3),
        ]
    best = None
    for cfg in configs:
        try:
            indexer_topk(*prob, TOPK, **kw, **cfg)
            if not check(cfg):
                continue
            call = lambda cfg=cfg: indexer_topk(*prob, TOPK, **kw, **cfg)  # noqa: E731
            e_ms, g_ms = eager_ms(call), graph_ms([call])
            log(f"  indexer {cfg}: graph {g_ms * 1e3:7.1f} us  eager {e_ms * 1e3:7.1f} us")
            if best is None or g_ms < best[0]:
                best = (g_ms, cfg)
        except Exception:
            log(f"  indexer {cfg}: FAILED\n{traceback.format_exc()}")
    cfg = best[1] if best else {}
    # the two halves, each alone
    scores = torch.empty(B, CTX, device=DEV)
    score_cfg = {k: v for k, v in cfg.items() if k != "topk_impl"}
    indexer_scores(*prob, scores, **score_cfg)
    score_ms = graph_ms([lambda: indexer_scores(*prob, scores, **score_cfg)])
    vals = torch.empty(B, TOPK, device=DEV)
    idx = torch.empty(B, TOPK, dtype=torch.int64, device=DEV)
    topk = {}
    variants = [("triton", dict())]
    if not quick:
        variants += [("triton", dict(num_warps=4)), ("triton", dict(num_warps=16)), ("triton", dict(block=2048)),
                     ("triton", dict(block=8192, num_warps=16)), ("triton", dict(radix_bits=8)),
                     ("triton", dict(block=1024, num_warps=4))]  # fmt: skip
    variants += [("torch", dict())]
    for impl, v in variants:
        try:
            scores_topk(scores, TOPK, out_pos, out_scores, vals, idx, impl=impl, **v)
            if not check(f"top-k {impl} {v}"):
                continue
            topk[f"{impl} {v}"] = graph_ms([lambda impl=impl, v=v: scores_topk(scores, TOPK, out_pos, out_scores,
                                                                                vals, idx, impl=impl, **v)])  # fmt: skip
        except Exception:
            log(f"  top-k {impl} {v}: FAILED\n{traceback.format_exc()}")
    # the worst case for the key gather: every slot a random row
    prob_r = indexer_problem(gen, scattered_rows=True)
    scat_ms = graph_ms([lambda: indexer_scores(*prob_r, scores, **score_cfg)])  # (after the top-k rows: rewrites)
    return best, score_ms, topk, scat_ms


# ------------------------------------------------------------------------------------------------ swap-in
def bench_swap(quick: bool, h2d_gbs_big: float):
    misses = B * TOPK
    n_host = 64 * 1024 if SMOKE else max(GiB // ROW_BYTES + 1, 4 * misses)  # >= 1 GiB of pinned rows
    host = torch.empty(n_host, ROW, dtype=DT, pin_memory=not SMOKE)
    step = 1 << 16
    for i in range(0, n_host, step):  # fill through the device: fast, and the rows differ
        host[i : i + step].copy_(torch.randn(min(step, n_host - i), ROW, device=DEV, dtype=DT))
    dev_rows = torch.zeros(B * DEV_BUF, ROW, dtype=DT, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(3)
    src = [torch.randperm(n_host, device=DEV, generator=gen)[:misses] for _ in range(3)]
    dst = [torch.randperm(B * DEV_BUF, device=DEV, generator=gen)[:misses] for _ in range(3)]
    nbytes = misses * ROW_BYTES
    h2d_same = harness.h2d_copy_gbs(nbytes, DEV)
    log(f"  pinned host pool {n_host * ROW_BYTES / GiB:.2f} GiB; {misses} misses = {nbytes / MiB:.1f} MiB; "
        f"contiguous pinned H2D copy_ of the same bytes {h2d_same:.1f} GB/s (of 1 GiB: {h2d_gbs_big:.1f})")  # fmt: skip

    gather_rows_from_host(host, src[0], dev_rows, dst[0])
    sync()
    ok = torch.equal(dev_rows[dst[0][:4096]].cpu(), host[src[0][:4096].cpu()])
    configs = [dict()]
    if not quick:
        configs += [
            dict(block_seg=32, iters=4),
            dict(block_seg=128, iters=2),
            dict(block_seg=64, iters=8, num_warps=8),
            dict(block_seg=256, iters=1, num_warps=8),
            dict(block_seg=16, iters=8),
            dict(block_seg=128, iters=8, num_warps=8),
        ]
    best = None
    for cfg in configs:
        try:
            calls = [
                (lambda s=s, d=d, cfg=cfg: copy_rows(host, s, dev_rows, d, None, **cfg)) for s, d in zip(src, dst)
            ]
            g_ms = graph_ms(calls)
            e_ms = eager_ms(calls[0])
            gbs = nbytes / (g_ms * 1e-3) / 1e9
            log(f"  swap-in gather {cfg}: graph {g_ms * 1e3:8.1f} us  eager {e_ms * 1e3:8.1f} us  {gbs:5.1f} GB/s "
                f"({100 * gbs / h2d_same:4.0f}% of pinned copy_)")  # fmt: skip
            if best is None or g_ms < best[0]:
                best = (g_ms, cfg, gbs)
        except Exception:
            log(f"  swap-in gather {cfg}: FAILED\n{traceback.format_exc()}")

    # CPU gather into a pinned staging buffer, one copy_, then a device scatter (for contrast)
    staging = torch.empty(misses, ROW, dtype=DT, pin_memory=not SMOKE)
    src_cpu = src[0].cpu()
    tmp = torch.empty(misses, ROW, dtype=DT, device=DEV)

    def cpu_path():
        torch.index_select(host, 0, src_cpu, out=staging)
        tmp.copy_(staging, non_blocking=True)
        dev_rows.index_copy_(0, dst[0], tmp)

    cpu_path()
    sync()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        cpu_path()
        sync()
        times.append(time.perf_counter() - t0)
    cpu_gbs = nbytes / statistics.median(times) / 1e9

    # offload: device rows -> pinned host rows (after prefill, a request's KV goes to the host)
    back = torch.empty(misses, ROW, dtype=DT, pin_memory=not SMOKE)
    ident = torch.arange(misses, device=DEV)
    scatter_rows_to_host(dev_rows, dst[0], back, ident)
    sync()
    ok = ok and torch.equal(back[:4096], dev_rows[dst[0][:4096]].cpu())
    off_ms = graph_ms([lambda: copy_rows(dev_rows, dst[0], back, ident, None, **(best[1] if best else {}))])
    off_gbs = nbytes / (off_ms * 1e-3) / 1e9
    return ok, best, h2d_same, cpu_gbs, off_gbs


# ------------------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="default configs only")
    ap.add_argument("--smoke", action="store_true",
                    help="this script's code paths on the CPU Triton interpreter, tiny sizes, no numbers")
    ap.add_argument("--no-fi", action="store_true", help="skip FlashInfer")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    quick = args.quick or SMOKE
    dev_name = "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(0)
    log(f"device: {dev_name}; torch {torch.__version__}")
    if not (SMOKE or args.no_fi):  # JIT-build FlashInfer's MLA module first (it can take a minute)
        try:
            t0 = time.perf_counter()
            buf0 = torch.randn(2, PAGE, ROW, device=DEV, dtype=DT)
            pt0 = torch.ones(1, 1, dtype=torch.int32, device=DEV)
            q0 = torch.randn(1, H, D_CKV, device=DEV, dtype=DT)
            qp0 = torch.randn(1, H, D_PE, device=DEV, dtype=DT)
            err, _, _ = bench_dense_flashinfer(buf0, pt0, q0, qp0, dense_reference(buf0, pt0, q0, qp0, 1), PAGE)
            log(f"FlashInfer warm-up (JIT) {time.perf_counter() - t0:.0f} s; rel err {err:.1e}")
        except Exception:
            log(f"FlashInfer unavailable:\n{traceback.format_exc()}")
            args.no_fi = True

    ceil = measure_ceilings(DEV)
    h2d_big = harness.h2d_copy_gbs(GiB, DEV)
    ceil = ceil.with_extra(h2d_gbs=h2d_big)
    copy_gbs = ceil.copy_gbs
    log(f"ceilings: {ceil.summary()} (h2d_gbs: pinned host -> device copy_ of 1 GiB)")
    gen = torch.Generator(device=DEV).manual_seed(1)

    log("sparse decode (B=%d, H=%d, K=%d, device buffer %d rows/request)" % (B, H, TOPK, DEV_BUF))
    sp = bench_sparse(quick, copy_gbs, gen)
    torch.cuda.empty_cache() if not SMOKE else None

    log("dense decode at %d context" % CTX)
    buf, page_table, q_nope, q_pe = dense_problem(gen)
    ref = dense_reference(buf, page_table, q_nope, q_pe)
    dense = {}
    for name, fn in (("triton", bench_dense_triton), ("flashinfer fa3", bench_dense_flashinfer)):
        if name.startswith("flashinfer") and (args.no_fi or SMOKE):
            continue
        try:
            err, e_ms, g_ms = fn(buf, page_table, q_nope, q_pe, ref, CTX)
            log(f"  dense {name}: rel err {err:.1e} (first {ref.shape[0]} requests)  graph {g_ms * 1e3:8.1f} us  "
                f"eager {e_ms * 1e3:8.1f} us")  # fmt: skip
            dense[name] = g_ms if not SMOKE else e_ms
        except Exception:
            log(f"  dense {name}: FAILED\n{traceback.format_exc()}")
    del buf
    torch.cuda.empty_cache() if not SMOKE else None

    log("indexer (B=%d, Hi=%d, Di=%d, %d keys/request, top-%d)" % (B, HI, DI, CTX, TOPK))
    ix, score_ms, topk, scat_ms = bench_indexer(quick)
    log(f"  scoring kernel alone {score_ms * 1e3:.1f} us (every slot a random row: {scat_ms * 1e3:.1f} us)")
    for name, ms in topk.items():
        log(f"  top-k alone, {name}: {ms * 1e3:.1f} us")
    torch.cuda.empty_cache() if not SMOKE else None

    log("swap-in of misses")
    sw_ok, sw, h2d_same, cpu_gbs, off_gbs = bench_swap(quick, h2d_big)

    # ------------------------------------------------------------------------------------------ summary
    rows: list[dict] = []

    def row(name, us=None, metric="", value=None, pct=None, goal="", met=""):
        rows.append({"row": name, "us": us, "metric": metric, "value": value, "pct_ceil": pct, "goal": goal,
                     "met": met})

    dense_kv = B * CTX * ROW_BYTES
    sparse_kv = B * DEV_BUF * ROW_BYTES
    ref_dense = dense.get("flashinfer fa3", dense.get("triton"))
    ref_name = "FlashInfer fa3" if "flashinfer fa3" in dense else "Triton"
    if sp:
        g_ms, cfg, gbs = sp
        row("sparse decode (best cfg)", g_ms * 1e3, "GB/s", gbs, 100 * gbs / copy_gbs)
        for name, ms in dense.items():
            speed = ms / g_ms
            row(f"dense decode {name} {CTX // 1024}k", ms * 1e3, "sparse x faster", speed, None, ">= 5x",
                "yes" if speed >= 5 else "NO")  # fmt: skip
    key_bytes = B * CTX * DI * 2
    if ix:
        row("indexer top-k (best cfg)", ix[0] * 1e3, "x sparse decode", ix[0] / sp[0] if sp else None)
        row("  scoring kernel", score_ms * 1e3, "GB/s keys", gb_per_s(key_bytes, score_ms),
            ceil.pct_copy(key_bytes, score_ms))  # fmt: skip
        row("  scoring kernel, random slots", scat_ms * 1e3, "GB/s keys", gb_per_s(key_bytes, scat_ms),
            ceil.pct_copy(key_bytes, scat_ms))  # fmt: skip
        for name, ms in topk.items():
            row(f"  top-k {name}"[:40], ms * 1e3)
        if sp and ref_dense:
            tot = ix[0] + sp[0]
            row(f"sparse + indexer vs dense {ref_name}", tot * 1e3, "x faster", ref_dense / tot)
    row("device KV bytes dense", None, "MiB", dense_kv / MiB)
    row("device KV bytes sparse", None, "fraction of dense", sparse_kv / dense_kv, None,
        f"<= 1/{RATIO:g}", "yes" if sparse_kv / dense_kv <= 1 / RATIO else "NO")  # fmt: skip
    if sw:
        pct = 100 * sw[2] / h2d_same
        row("swap-in gather (best cfg)", sw[0] * 1e3, "GB/s", sw[2], pct, ">= 50% of pinned copy_",
            "yes" if pct >= 50 else "NO")  # fmt: skip
    row("CPU gather + copy_ (contrast)", None, "GB/s", cpu_gbs, 100 * cpu_gbs / h2d_same)
    row("offload scatter to host", None, "GB/s", off_gbs, 100 * off_gbs / h2d_same)

    title = (f"device: {dev_name}; d2d copy {copy_gbs:.0f} GB/s; pinned H2D copy_ {h2d_big:.1f} GB/s (1 GiB), "
             f"{h2d_same:.1f} GB/s ({B * TOPK * ROW_BYTES / MiB:.0f} MiB); swap copies bit-exact: {sw_ok}")
    if sp:
        title += (f"\nbest sparse cfg {sp[1]}; best indexer cfg {ix[1] if ix else None}; best gather cfg "
                  f"{sw[1] if sw else None}")
    title += "\n% ceil: of the d2d copy for GB/s rows of device memory, of the same-size pinned H2D copy_ for swaps"
    table = Table(rows, title=title, formats={"us": ".1f", "value": ".3g", "pct_ceil": ".1f"})
    report("bench_dsa", ceil, table,
           meta={"quick": quick, "smoke": SMOKE, "h2d_same_gbs": h2d_same, "swap_bit_exact": sw_ok,
                 "best_sparse_cfg": sp[1] if sp else None, "best_indexer_cfg": ix[1] if ix else None,
                 "best_gather_cfg": sw[1] if sw else None,
                 "shape": {"B": B, "CTX": CTX, "TOPK": TOPK, "H": H, "DEV_BUF": DEV_BUF}})


if __name__ == "__main__":
    main()
