#!/usr/bin/env python
"""GPU check + timing of the Triton MLA kernels (backends/kernels), meant for one H100 run.

    python bench/triton_mla_kernels_gpu.py            # full: ceilings, every row, config sweeps
    python bench/triton_mla_kernels_gpu.py --quick    # ceilings + main rows, default configs only

What it does, in order:
 1. Ceilings measured in the same run: device-to-device copy bandwidth (a 1 GiB torch copy, read + write
    bytes counted) and bf16 8192^3 matmul TFLOP/s.
 2. For every row and every kernel config tried: run once, compare with a float32 torch reference on the GPU
    (relative error printed; a config whose error is >= 2e-2 is reported and not timed), then time it with
    triton.testing.do_bench (median, after warm-up). Inputs are rotated over several copies when one copy
    of the KV cache would fit in L2.
 3. Prints the best config per row (use it to set the defaults in default_decode_config /
    default_extend_config), FlashInfer's BatchMLAPagedAttentionWrapper (backend="fa3") on the same decode
    tensors when flashinfer imports, and an aligned summary table last.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# --smoke: exercise this script's code paths on the CPU through Triton's interpreter with tiny sizes
# (no meaningful numbers); it must be decided before the kernels are imported.
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from backends.kernels.mla_decode import (  # noqa: E402
    DEFAULT_MAX_SPLITS,
    PROGRAMS_PER_SM,
    decode_workspace_bytes,
    decode_workspace_shapes,
    default_decode_config,
    mla_decode,
)
from backends.kernels.mla_extend import default_extend_config, mla_extend  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
D_CKV, D_PE, D = 512, 64, 576
DTYPE = torch.bfloat16
ELT = 2
PAGE = 64
SCALE = 1.0 / math.sqrt(192)
TOL = 2e-2
GiB = 1 << 30
MiB = 1 << 20


def log(*a):
    print(*a, flush=True)


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def bench_ms(fn) -> float:
    fn()
    sync()
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


# ------------------------------------------------------------------------------------------------ ceilings
def copy_bandwidth() -> float:
    n = MiB if SMOKE else GiB
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    src.random_(0, 255)
    t = bench_ms(lambda: dst.copy_(src))
    return 2 * n / (t * 1e-3)  # bytes/s, read + write


def matmul_flops() -> float:
    n = 256 if SMOKE else 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=DEV, dtype=torch.bfloat16)
    t = bench_ms(lambda: torch.matmul(a, b, out=c))
    return 2 * n**3 / (t * 1e-3)


# ------------------------------------------------------------------------------------------------ problems
def l2_bytes() -> int:
    if SMOKE:
        return 64 * 1024
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * MiB))


def n_copies(kv_bytes: int) -> int:
    """Enough copies of the inputs that rotating through them never hits L2."""
    return max(1, min(8, math.ceil(3 * l2_bytes() / max(kv_bytes, 1))))


class Paged:
    """One copy of a paged problem: shuffled pages, page table, lengths."""

    def __init__(self, kv_lens, page_size, g):
        B = len(kv_lens)
        pages_per = [max(1, math.ceil(L / page_size)) for L in kv_lens]
        total = sum(pages_per)
        self.kv = torch.randn(total, page_size, D, device=DEV, dtype=torch.float32, generator=g).to(DTYPE)
        perm = torch.randperm(total, device=DEV, generator=g).to(torch.int32)
        width = max(pages_per)
        self.pt = torch.zeros(B, width, dtype=torch.int32, device=DEV)
        indptr = [0]
        for b, n in enumerate(pages_per):
            self.pt[b, :n] = perm[indptr[-1] : indptr[-1] + n]
            indptr.append(indptr[-1] + n)
        self.kv_page_indptr = torch.tensor(indptr, dtype=torch.int32, device=DEV)
        self.kv_indices = torch.cat([self.pt[b, :n] for b, n in enumerate(pages_per)])
        self.lens = list(kv_lens)
        self.sl = torch.tensor(kv_lens, dtype=torch.int32, device=DEV)
        self.page_size = page_size

    def rows(self, b):
        L = self.lens[b]
        t = torch.arange(L, device=DEV)
        return self.kv[self.pt[b, t // self.page_size].long(), t % self.page_size].float()


class DecodeProblem:
    def __init__(self, kv_lens, heads, page_size=PAGE, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.B, self.H = len(kv_lens), heads
        self.kv_bytes = sum(kv_lens) * D * ELT
        self.copies = [Paged(kv_lens, page_size, g) for _ in range(n_copies(self.kv_bytes))]
        self.q_nope = torch.randn(self.B, heads, D_CKV, device=DEV, generator=g).to(DTYPE)
        self.q_pe = torch.randn(self.B, heads, D_PE, device=DEV, generator=g).to(DTYPE)
        self.out = torch.empty(self.B, heads, D_CKV, device=DEV, dtype=DTYPE)
        po, pl = decode_workspace_shapes(self.B, heads, DEFAULT_MAX_SPLITS)
        self.po = torch.empty(po, device=DEV)
        self.pl = torch.empty(pl, device=DEV)
        self._ref = None
        self.flops = 2 * heads * sum(kv_lens) * (D + D_CKV)

    def ref(self):
        if self._ref is None:
            p = self.copies[0]
            ref = torch.empty(self.B, self.H, D_CKV, device=DEV)
            for b in range(self.B):
                rows = p.rows(b)
                s = (self.q_nope[b].float() @ rows[:, :D_CKV].T + self.q_pe[b].float() @ rows[:, D_CKV:].T) * SCALE
                ref[b] = torch.softmax(s, dim=-1) @ rows[:, :D_CKV]
            self._ref = ref
        return self._ref

    def runner(self, **cfg):
        state = [0]

        def run():
            p = self.copies[state[0] % len(self.copies)]
            state[0] += 1
            mla_decode(
                self.q_nope,
                self.q_pe,
                p.kv,
                p.pt,
                p.sl,
                SCALE,
                self.out,
                self.po,
                self.pl,
                max_splits=DEFAULT_MAX_SPLITS,
                **cfg,
            )

        return run


class ExtendProblem:
    def __init__(self, q_lens, kv_lens, heads, page_size=PAGE, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.q_lens, self.kv_lens, self.H = list(q_lens), list(kv_lens), heads
        self.kv_bytes = sum(kv_lens) * D * ELT
        self.copies = [Paged(kv_lens, page_size, g) for _ in range(n_copies(self.kv_bytes))]
        T = sum(q_lens)
        self.q_nope = torch.randn(T, heads, D_CKV, device=DEV, generator=g).to(DTYPE)
        self.q_pe = torch.randn(T, heads, D_PE, device=DEV, generator=g).to(DTYPE)
        self.out = torch.empty(T, heads, D_CKV, device=DEV, dtype=DTYPE)
        self.indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        visible = sum(sum(L - n + i + 1 for i in range(n)) for n, L in zip(q_lens, kv_lens))
        self.flops = 2 * heads * visible * (D + D_CKV)
        self._ref = None

    def ref(self):
        if self._ref is None:
            p = self.copies[0]
            ref = torch.empty(self.out.shape, device=DEV)
            q0 = 0
            for b, (n, L) in enumerate(zip(self.q_lens, self.kv_lens)):
                rows = p.rows(b)
                for h0 in range(0, self.H, 4):  # bounded memory for long requests
                    qn = self.q_nope[q0 : q0 + n, h0 : h0 + 4].float()
                    qp = self.q_pe[q0 : q0 + n, h0 : h0 + 4].float()
                    s = (
                        torch.einsum("nhc,lc->nhl", qn, rows[:, :D_CKV])
                        + torch.einsum("nhr,lr->nhl", qp, rows[:, D_CKV:])
                    ) * SCALE
                    pos = torch.arange(L - n, L, device=DEV)[:, None, None]
                    s = s.masked_fill(torch.arange(L, device=DEV)[None, None, :] > pos, float("-inf"))
                    ref[q0 : q0 + n, h0 : h0 + 4] = torch.einsum("nhl,lc->nhc", torch.softmax(s, -1), rows[:, :D_CKV])
                q0 += n
            self._ref = ref
        return self._ref

    def runner(self, **cfg):
        state = [0]
        max_q = max(self.q_lens)

        def run():
            p = self.copies[state[0] % len(self.copies)]
            state[0] += 1
            mla_extend(self.q_nope, self.q_pe, p.kv, p.pt, self.indptr, p.sl, SCALE, self.out, max_q_len=max_q, **cfg)

        return run


def rel_err(out, ref) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return ((out.float() - ref).norm() / ref.norm()).item()


def try_config(prob, cfg):
    """(ms, rel_err, error string or None)."""
    try:
        run = prob.runner(**cfg)
        prob.out.fill_(float("nan"))
        # check on copy 0 (the reference's)
        run_check = prob.runner(**cfg)
        run_check()
        sync()
        err = rel_err(prob.out, prob.ref())
        if not err < TOL:
            return None, err, f"rel err {err:.2e}"
        return bench_ms(run), err, None
    except Exception as e:  # OutOfResources (shared memory), compile errors, ...
        msg = str(e).strip().splitlines()
        return None, float("nan"), (msg[0][:100] if msg else type(e).__name__)


def fmt_cfg(cfg):
    short = dict(
        block_h="bh",
        block_n="bn",
        block_m="bm",
        num_warps="w",
        num_stages="s",
        min_tokens_per_split="mt",
        target_programs="tp",
    )
    return " ".join(f"{short.get(k, k)}={v}" for k, v in cfg.items())


def sweep(name, prob, configs, metric):
    """Try configs; print each; return (best_cfg, best_ms, rel_err) of the fastest."""
    copies = f"{len(prob.copies)} input cop{'y' if len(prob.copies) == 1 else 'ies'}"
    log(f"\n== {name}: {len(configs)} config(s), {copies}")
    best = (None, float("inf"), float("nan"))
    if SMOKE:
        configs = configs[:2]
    for cfg in configs:
        ms, err, fail = try_config(prob, cfg)
        if fail:
            log(f"  {fmt_cfg(cfg):60s} FAIL {fail}")
            continue
        log(f"  {fmt_cfg(cfg):60s} {ms * 1e3:9.1f} us  {metric(ms)}  err {err:.1e}")
        if ms < best[1]:
            best = (cfg, ms, err)
    if best[0] is not None:
        log(f"  best: {fmt_cfg(best[0])} -> {best[1] * 1e3:.1f} us")
    return best


# ------------------------------------------------------------------------------------------------ FlashInfer
def flashinfer_decode_ms(prob: DecodeProblem):
    """(ms, rel_err) of flashinfer's BatchMLAPagedAttentionWrapper(backend='fa3'), or None."""
    if SMOKE:
        return None
    try:
        import flashinfer  # noqa: F401
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except Exception:
        return None
    try:
        wrappers, caches = [], []
        qo_indptr = torch.arange(prob.B + 1, dtype=torch.int32, device=DEV)
        for p in prob.copies:
            w = BatchMLAPagedAttentionWrapper(torch.empty(128 * MiB, dtype=torch.uint8, device=DEV), backend="fa3")
            w.plan(
                qo_indptr,
                p.kv_page_indptr,
                p.kv_indices,
                p.sl,
                prob.H,
                D_CKV,
                D_PE,
                p.page_size,
                False,
                SCALE,
                DTYPE,
                DTYPE,
            )
            wrappers.append(w)
            caches.append((p.kv[..., :D_CKV].contiguous(), p.kv[..., D_CKV:].contiguous()))
        out = torch.empty_like(prob.out)
        wrappers[0].run(prob.q_nope, prob.q_pe, caches[0][0], caches[0][1], out=out)
        sync()
        err = rel_err(out, prob.ref())
        state = [0]

        def run():
            i = state[0] % len(wrappers)
            state[0] += 1
            wrappers[i].run(prob.q_nope, prob.q_pe, caches[i][0], caches[i][1], out=out)

        ms = bench_ms(run)
        return ms, err
    except Exception as e:
        log(f"  flashinfer failed: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}")
        return None


# ------------------------------------------------------------------------------------------------ rows
def S(n, smoke=None):
    """A size: n normally, tiny with --smoke (n // 64, at least 1, unless given)."""
    if not SMOKE:
        return n
    return smoke if smoke is not None else max(1, n // 64)


def decode_tile_configs(heads, quick):
    d = default_decode_config(heads, DTYPE)
    if quick:
        return [d]
    if heads <= 16:
        grid = [
            dict(block_h=16, block_n=bn, num_warps=w, num_stages=s)
            for bn in (16, 32, 64)
            for w in (4, 8)
            for s in (1, 2, 3)
        ]
    else:
        grid = [
            dict(block_h=bh, block_n=bn, num_warps=w, num_stages=s)
            for bh in (32, 64)
            for bn in (16, 32)
            for w in (4, 8)
            for s in (1, 2, 3)
        ]
        grid += [dict(block_h=64, block_n=64, num_warps=8, num_stages=s) for s in (1, 2)]
        grid += [dict(block_h=64, block_n=32, num_warps=16, num_stages=2)]
        grid += [dict(block_h=16, block_n=bn, num_warps=w, num_stages=2) for bn in (32, 64) for w in (4, 8)]
    return [d] + [c for c in grid if c != d]


def split_configs(tile_cfg, sms):
    """Split-plan sweep: min_tokens_per_split x target_programs (in SMs; 0 = no balancing)."""
    out = []
    for mt in (128, 256, 512, 1024):
        for pps in (0, 1, 2, 4, 8):
            out.append(dict(tile_cfg, min_tokens_per_split=mt, target_programs=pps * sms))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="default configs only, fewer rows")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter dry run of this script (tiny sizes)")
    args = ap.parse_args()
    quick = args.quick
    if SMOKE:
        sms, name = 4, "cpu (--smoke: Triton interpreter, tiny sizes, numbers meaningless)"
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU")
        if os.environ.get("TRITON_INTERPRET") == "1":
            sys.exit("unset TRITON_INTERPRET")
        props = torch.cuda.get_device_properties(0)
        sms, name = props.multi_processor_count, props.name
    log(
        f"device: {name}, {sms} SMs, L2 {l2_bytes() / MiB:.2f} MiB; torch {torch.__version__}, "
        f"triton {triton.__version__}; quick={quick}"
    )
    try:
        import flashinfer

        log(f"flashinfer {getattr(flashinfer, '__version__', '?')}")
    except Exception:
        log("flashinfer: not importable (n/a)")

    bw = copy_bandwidth()
    mm = matmul_flops()
    log(f"ceilings: copy {bw / 1e9:.0f} GB/s (read+write), bf16 matmul {mm / 1e12:.0f} TFLOP/s")

    table = []  # (row, cfg, us, metric, pct, goal, err, fi)

    def gbs(prob):
        return lambda ms: (
            f"{prob.kv_bytes / (ms * 1e-3) / 1e9:7.0f} GB/s {100 * prob.kv_bytes / (ms * 1e-3) / bw:5.1f}%bw"
        )

    def tfs(prob):
        return lambda ms: (
            f"{prob.flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s {100 * prob.flops / (ms * 1e-3) / mm:5.1f}%mm"
        )

    def decode_row(name, prob, goal, bandwidth=True):
        metric = gbs(prob) if bandwidth else tfs(prob)
        cfg, ms, err = sweep(name + " [tiles]", prob, decode_tile_configs(prob.H, quick), metric)
        if cfg is None:
            table.append((name, "all failed", "-", "-", "-", goal, "-", "-"))
            return None
        if not quick:
            cfg2, ms2, err2 = sweep(name + " [splits]", prob, split_configs(cfg, sms), metric)
            if cfg2 is not None and ms2 < ms:
                cfg, ms, err = cfg2, ms2, err2
        fi = flashinfer_decode_ms(prob)
        fi_s = "n/a" if fi is None else f"{fi[0] / ms:.2f}x (fi {fi[0] * 1e3:.1f}us err {fi[1]:.1e})"
        log(f"  flashinfer fa3: {fi_s}   (ratio = t_flashinfer / t_triton; > 1 means triton is faster)")
        if bandwidth:
            val = prob.kv_bytes / (ms * 1e-3)
            table.append(
                (
                    name,
                    fmt_cfg(cfg),
                    f"{ms * 1e3:.1f}",
                    f"{val / 1e9:.0f} GB/s",
                    f"{100 * val / bw:.1f}% bw",
                    goal,
                    f"{err:.1e}",
                    "n/a" if fi is None else f"{fi[0] / ms:.2f}x",
                )
            )
        else:
            val = prob.flops / (ms * 1e-3)
            table.append(
                (
                    name,
                    fmt_cfg(cfg),
                    f"{ms * 1e3:.1f}",
                    f"{val / 1e12:.1f} TF/s",
                    f"{100 * val / mm:.1f}% mm",
                    goal,
                    f"{err:.1e}",
                    "n/a" if fi is None else f"{fi[0] / ms:.2f}x",
                )
            )
        return cfg, ms

    def guarded(fn, *a):
        try:
            return fn(*a)
        except Exception:
            traceback.print_exc()
            return None

    # 1. decode 16 heads, batch 128 x 8192
    p1 = DecodeProblem([S(8192)] * S(128, 2), 16, seed=1)
    r1 = guarded(decode_row, "decode H16 B128 L8192", p1, ">=80% bw")
    del p1
    torch.cuda.empty_cache()

    # 2. decode batch 1 x 32768
    p2 = DecodeProblem([S(32768, 300)], 16, seed=2)
    guarded(decode_row, "decode H16 B1 L32768", p2, ">=50% bw")
    del p2
    torch.cuda.empty_cache()

    # 3. decode 128 heads, batch 64 x 4096
    p3 = DecodeProblem([S(4096)] * S(64, 2), S(128, 32), seed=3)
    guarded(decode_row, "decode H128 B64 L4096", p3, ">=50% mm", False)
    del p3
    torch.cuda.empty_cache()

    # 4. variable lengths vs uniform of the same total
    best16 = dict(r1[0]) if r1 else {}
    nb = S(128, 3)
    for mean in (4096,) if quick else (4096, 8192):
        mean = S(mean)
        g = torch.Generator().manual_seed(mean)
        lens = torch.normal(float(mean), mean / 2, (nb,), generator=g).round().clamp(1, 2 * mean).int().tolist()
        total = sum(lens)
        uni = [total // nb + (1 if i < total % nb else 0) for i in range(nb)]
        res = {}
        for tag, ls in (("normal", lens), ("uniform", uni)):
            prob = DecodeProblem(ls, 16, seed=mean + len(tag))
            ms, err, fail = try_config(prob, best16)
            fi = None if fail else flashinfer_decode_ms(prob)
            res[tag] = (ms, err, fail, prob.kv_bytes, fi)
            del prob
            torch.cuda.empty_cache()
        (mv, ev, fv, bytes_, fiv), (mu, eu, fu, _, fiu) = res["normal"], res["uniform"]
        name = f"decode H16 B{nb} var mean {mean}"
        if fv or fu:
            log(f"\n== {name}: FAIL {fv or fu}")
            table.append((name, fmt_cfg(best16), "-", "-", "-", "~0% vs uniform", "-", "-"))
            continue
        chg = 100 * (mv - mu) / mu
        log(
            f"\n== {name} (total {total} tokens, max {max(lens)}, min {min(lens)}): "
            f"normal {mv * 1e3:.1f} us, "
            f"uniform {mu * 1e3:.1f} us -> time {chg:+.1f}% ; normal {bytes_ / (mv * 1e-3) / 1e9:.0f} GB/s "
            f"({100 * bytes_ / (mv * 1e-3) / bw:.1f}% bw); err {ev:.1e}/{eu:.1e}"
        )
        fis = "n/a"
        if fiv is not None and fiu is not None:
            fis = f"{fiv[0] / mv:.2f}x"
            log(
                f"  flashinfer fa3: normal {fiv[0] * 1e3:.1f} us, uniform {fiu[0] * 1e3:.1f} us "
                f"({100 * (fiv[0] - fiu[0]) / fiu[0]:+.1f}%), t_fi/t_triton on normal {fiv[0] / mv:.2f}x"
            )
        table.append(
            (
                name,
                fmt_cfg(best16),
                f"{mv * 1e3:.1f}",
                f"{chg:+.1f}% vs unif",
                f"{100 * bytes_ / (mv * 1e-3) / bw:.1f}% bw",
                "small +%",
                f"{ev:.1e}",
                fis,
            )
        )

    # 5. split-KV scratch at batch 256
    for h in (16, 128):
        nbytes = decode_workspace_bytes(256, h, DEFAULT_MAX_SPLITS)
        ms_ = DEFAULT_MAX_SPLITS
        log(f"\n== split-KV scratch, batch 256, {h} heads, max_splits={ms_}: {nbytes / MiB:.1f} MiB")
        table.append(
            (
                f"scratch B256 H{h}",
                f"max_splits={DEFAULT_MAX_SPLITS}",
                "-",
                f"{nbytes / MiB:.1f} MiB",
                "-",
                "<=128 MiB" if h == 16 else "-",
                "-",
                "-",
            )
        )

    # 6. extend 16 heads, 4 requests x 2048 new over 2048 prefix
    pe = ExtendProblem([S(2048)] * S(4, 2), [2 * S(2048)] * S(4, 2), 16, seed=6)
    d = default_extend_config(16, DTYPE)
    if quick:
        cfgs = [d]
    else:
        cfgs = [d] + [
            c
            for c in (
                dict(block_m=bm, block_h=bh, block_n=bn, num_warps=w, num_stages=s)
                for bm in (32, 64)
                for bh in (1, 16)
                for bn in (32, 64)
                for w in (4, 8)
                for s in (2,)
            )
            if c != d
        ]
    best = guarded(sweep, "extend H16 4x2048 new over 2048 prefix", pe, cfgs, tfs(pe))
    if best and best[0] is not None and not quick:
        more = [dict(best[0], num_stages=s) for s in (1, 3)]
        b2 = guarded(sweep, "extend H16 [stages]", pe, more, tfs(pe))
        if b2 and b2[0] is not None and b2[1] < best[1]:
            best = b2
    if best and best[0] is not None:
        cfg, ms, err = best
        val = pe.flops / (ms * 1e-3)
        table.append(
            (
                "extend H16 4x2048 / 2048 prefix",
                fmt_cfg(cfg),
                f"{ms * 1e3:.1f}",
                f"{val / 1e12:.1f} TF/s",
                f"{100 * val / mm:.1f}% mm",
                "-",
                f"{err:.1e}",
                "-",
            )
        )
    del pe
    torch.cuda.empty_cache()

    # summary
    log(
        f"\nceilings: copy {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s; "
        f"decode defaults: programs per SM by block_h {PROGRAMS_PER_SM}, max_splits={DEFAULT_MAX_SPLITS}, "
        "min_tokens_per_split=256 (tp = target_programs, mt = min_tokens_per_split)"
    )
    head = ("row", "best config", "us", "value", "% ceiling", "goal", "rel err", "t_fi/t_triton")
    rows = [head] + [tuple(str(x) for x in r) for r in table]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for i, r in enumerate(rows):
        log("  ".join(x.ljust(w) for x, w in zip(r, widths)))
        if i == 0:
            log("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
