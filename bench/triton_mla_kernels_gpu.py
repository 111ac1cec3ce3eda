#!/usr/bin/env python
"""GPU check + timing of the Triton MLA kernels (backends/kernels), meant for one H100 run.

    python bench/triton_mla_kernels_gpu.py                      # ceilings, every row, focused config sweeps
    python bench/triton_mla_kernels_gpu.py --quick              # default configs only
    python bench/triton_mla_kernels_gpu.py --rows var,b1,h128   # some rows (h16, b1, h128, var, scratch, extend)

What it does, in order:
 1. Ceilings measured in the same run: device-to-device copy bandwidth (a 1 GiB torch copy, read + write
    bytes counted) and bf16 8192^3 matmul TFLOP/s.
 2. For every row and every kernel config tried: run once, compare with a float32 torch reference on the GPU
    (relative error printed; a config whose error is >= 2e-2 is reported and not timed), then time it twice:
    eagerly with triton.testing.do_bench (median; the launcher's Python time is hidden behind do_bench's L2
    flush only when it is shorter) and as a CUDA graph of the calls (how the backend runs decode; the
    graph time is the GPU time). Inputs are rotated over several copies when one copy of the KV cache
    would fit in L2.
 3. Decode runs with the workspace the backend gives it: a flat buffer of ``split_slots`` float32 slots
    viewed as [B, H, S, 512] with ``S = min(max_splits, split_slots // B)`` (``--max-splits``,
    ``--split-slots``; a config's ``ws=`` overrides max_splits). Each config line also gives the stage-1
    programs (``P``), the split pieces and the partial-output bytes they write and the merge reads.
 4. Prints the best config per row, FlashInfer's BatchMLAPagedAttentionWrapper (backend="fa3") on the same
    decode tensors when flashinfer imports (``--no-fi`` skips it: its JIT build takes minutes on a fresh
    machine), and an aligned summary table last.
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
    PROGRAMS_PER_SM,
    PROGRAMS_PER_SM_TMA,
    decode_programs,
    default_decode_config,
    mla_decode,
    programs_per_sm,
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


def graph_ms(run, n_calls: int) -> float:
    """GPU time of one call: ``n_calls`` consecutive calls captured in a CUDA graph, replayed (median)."""
    if SMOKE:
        return float("nan")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(n_calls):
            run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n_calls):
            run()
    ms = do_bench(g.replay, warmup=25, rep=100, return_mode="median") / n_calls
    del g
    return ms


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


def plan_pieces(lens, programs, min_tokens, block_n, snap=True):
    """Split pieces of the kernels' token-balanced plan (mirror of mla_decode_kernels; see the tests)."""
    pad = [-(-L // block_n) * block_n for L in lens]
    total = sum(pad)
    chunk = max(triton.cdiv(triton.cdiv(total, programs), block_n) * block_n,
                triton.cdiv(min_tokens, block_n) * block_n, block_n)  # fmt: skip
    nonzero = {pd for pd in pad if pd > 0}
    if snap and len(nonzero) == 1:  # equal lengths: cut at request boundaries if it costs <= 1/8 more
        eq = nonzero.pop()
        r = triton.cdiv(chunk, eq) * eq
        if 8 * r <= 9 * chunk:
            chunk = r
    s, pieces = 0, 0
    for L, pd in zip(lens, pad):
        p0, p1 = s // chunk, max(s + pd - 1, 0) // chunk
        if L > 0 and p1 > p0:
            pieces += p1 - p0 + 1
        s += pd
    return chunk, pieces


class DecodeProblem:
    """A decode batch plus the backend's workspace: ``split_slots`` slots of [H, 513] float32, viewed as
    partial_out [B, H, S, 512] and partial_lse [B, H, S] with S = min(max_splits, split_slots // B)."""

    def __init__(self, kv_lens, heads, page_size=PAGE, seed=0, max_splits=64, split_slots=2048):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.B, self.H = len(kv_lens), heads
        self.lens = list(kv_lens)
        self.kv_bytes = sum(kv_lens) * D * ELT
        self.copies = [Paged(kv_lens, page_size, g) for _ in range(n_copies(self.kv_bytes))]
        self.q_nope = torch.randn(self.B, heads, D_CKV, device=DEV, generator=g).to(DTYPE)
        self.q_pe = torch.randn(self.B, heads, D_PE, device=DEV, generator=g).to(DTYPE)
        self.out = torch.empty(self.B, heads, D_CKV, device=DEV, dtype=DTYPE)
        self.max_splits, self.split_slots = max_splits, split_slots
        self.ws = torch.empty(split_slots * heads * (D_CKV + 1), device=DEV)
        self._ref = None
        self.flops = 2 * heads * sum(kv_lens) * (D + D_CKV)

    def workspace(self, max_splits):
        S = max(1, min(max_splits, self.split_slots // self.B))
        n = self.B * self.H * S * D_CKV
        po = self.ws[:n].view(self.B, self.H, S, D_CKV)
        pl = self.ws[n : n + self.B * self.H * S].view(self.B, self.H, S)
        return po, pl, S

    def plan(self, cfg, sms):
        """(programs, pieces, partial bytes written + read by the merge) for a config."""
        d = default_decode_config(self.H, DTYPE)
        bh, bn = cfg.get("block_h") or d["block_h"], cfg.get("block_n") or d["block_n"]
        S = self.workspace(cfg.get("ws", self.max_splits))[2]
        tp = cfg.get("target_programs")
        if tp is None:
            tma = cfg.get("use_tma", d.get("use_tma", False)) and PAGE % bn == 0
            tp = programs_per_sm(bh, tma) * sms
        hb = -(-self.H // bh)
        P = decode_programs(self.B, self.B * S, hb, tp)
        _, pieces = plan_pieces(self.lens, P, cfg.get("min_tokens_per_split", 256), bn, cfg.get("snap", True))
        return P, pieces, 2 * pieces * self.H * (D_CKV + 1) * 4

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
        cfg = dict(cfg)
        po, pl, S = self.workspace(cfg.pop("ws", self.max_splits))

        def run():
            p = self.copies[state[0] % len(self.copies)]
            state[0] += 1
            mla_decode(
                self.q_nope, self.q_pe, p.kv, p.pt, p.sl, SCALE, self.out, po, pl, max_splits=S, **cfg
            )  # fmt: skip

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


def try_config(prob, cfg, graph=True):
    """(eager ms, graph ms, rel_err, error string or None)."""
    try:
        run = prob.runner(**cfg)
        prob.out.fill_(float("nan"))
        # check on copy 0 (the reference's)
        run_check = prob.runner(**cfg)
        run_check()
        sync()
        err = rel_err(prob.out, prob.ref())
        if not err < TOL:
            return None, None, err, f"rel err {err:.2e}"
        ms = bench_ms(run)
        gms = graph_ms(prob.runner(**cfg), len(prob.copies)) if graph else float("nan")
        return ms, gms, err, None
    except Exception as e:  # OutOfResources (shared memory), compile errors, ...
        msg = str(e).strip().splitlines()
        return None, None, float("nan"), (msg[0][:100] if msg else type(e).__name__)


def fmt_cfg(cfg):
    short = dict(
        block_h="bh",
        block_n="bn",
        block_m="bm",
        num_warps="w",
        num_stages="s",
        min_tokens_per_split="mt",
        target_programs="tp",
        use_tma="tma",
        max_regs="reg",
    )
    return " ".join(f"{short.get(k, k)}={v}" for k, v in cfg.items())


def sweep(name, prob, configs, metric, sms=132):
    """Try configs; print each; return (best_cfg, eager ms, graph ms, rel_err) of the fastest (by graph time,
    the GPU time, when measured)."""
    copies = f"{len(prob.copies)} input cop{'y' if len(prob.copies) == 1 else 'ies'}"
    log(f"\n== {name}: {len(configs)} config(s), {copies}")
    best = (None, float("inf"), float("inf"), float("nan"))
    if SMOKE:
        configs = configs[:2]
    for cfg in configs:
        ms, gms, err, fail = try_config(prob, cfg)
        extra = ""
        if isinstance(prob, DecodeProblem):
            P, pieces, pbytes = prob.plan(cfg, sms)
            extra = f"  P={P} pieces={pieces} ws {pbytes / MiB:.1f} MiB"
        if fail:
            log(f"  {fmt_cfg(cfg) or 'default':52s} FAIL {fail}{extra}")
            continue
        log(
            f"  {fmt_cfg(cfg) or 'default':52s} {ms * 1e3:8.1f} us {metric(ms)} | graph {gms * 1e3:8.1f} us "
            f"{metric(gms)}  err {err:.1e}{extra}"
        )
        key = gms if gms == gms else ms
        if key < (best[2] if best[2] == best[2] else best[1]):
            best = (cfg, ms, gms, err)
    if best[0] is not None:
        log(f"  best: {fmt_cfg(best[0])} -> {best[1] * 1e3:.1f} us eager, {best[2] * 1e3:.1f} us graph")
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


def decode_configs(row, quick, sms):
    """Configs tried per decode row (the first is the launcher's default: TMA loads, one program per SM).
    Earlier sweeps (tiles x warps x stages, plans) are summarized in bench/TRITON_NOTES.md; these are the
    contenders."""
    base = {}
    ptr = dict(use_tma=False)  # pointer loads: 107 registers, 2 programs per SM
    if quick:
        return [base] + ([dict(ws=2048)] if row == "b1" else [])
    if row == "h16":
        return [
            base,
            dict(use_tma=True, target_programs=2 * sms),
            ptr,
            dict(ptr, target_programs=sms),
            dict(ptr, block_n=32, num_warps=4, num_stages=3, target_programs=2 * sms),
        ]
    if row == "b1":
        return [
            base,
            dict(ws=2048),
            dict(ptr, ws=2048),
            dict(ptr, ws=2048, min_tokens_per_split=128),
            dict(ptr, ws=2048, target_programs=sms),
            dict(ptr, ws=2048, block_n=32, num_warps=4, num_stages=4, min_tokens_per_split=128),
        ]
    if row == "h128":
        return [
            base,
            dict(snap=False),
            ptr,
            dict(ptr, target_programs=2 * sms),
            dict(ptr, block_n=32, num_stages=3),
        ]
    raise ValueError(row)


ROWS = ("h16", "b1", "h128", "var", "scratch", "extend")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="default configs only")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter dry run of this script (tiny sizes)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of rows: {','.join(ROWS)}")
    ap.add_argument("--max-splits", type=int, default=2048, help="backend.max_splits (workspace S cap)")
    ap.add_argument("--split-slots", type=int, default=2048, help="backend.split_slots (workspace slots)")
    ap.add_argument("--no-fi", action="store_true", help="skip FlashInfer")
    args = ap.parse_args()
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
    log(
        f"device: {name}, {sms} SMs, L2 {l2_bytes() / MiB:.2f} MiB; torch {torch.__version__}, "
        f"triton {triton.__version__}; quick={quick}; backend workspace max_splits={args.max_splits} "
        f"split_slots={args.split_slots}"
    )
    use_fi = not args.no_fi
    if use_fi:
        try:
            import flashinfer

            log(f"flashinfer {getattr(flashinfer, '__version__', '?')}")
        except Exception:
            log("flashinfer: not importable (n/a)")
    fi_ms = flashinfer_decode_ms if use_fi else (lambda prob: None)

    bw = copy_bandwidth()
    mm = matmul_flops()
    log(f"ceilings: copy {bw / 1e9:.0f} GB/s (read+write), bf16 matmul {mm / 1e12:.0f} TFLOP/s")

    table = []  # (row, cfg, eager us, graph us, value, pct eager, pct graph, goal, err, fi)
    ws_kw = dict(max_splits=args.max_splits, split_slots=args.split_slots)

    def bw_metric(prob):
        return lambda ms: (
            f"{prob.kv_bytes / (ms * 1e-3) / 1e9:5.0f} GB/s {100 * prob.kv_bytes / (ms * 1e-3) / bw:5.1f}%bw"
        )

    def mm_metric(prob):
        return lambda ms: f"{prob.flops / (ms * 1e-3) / 1e12:5.1f} TF/s {100 * prob.flops / (ms * 1e-3) / mm:5.1f}%mm"

    def decode_row(name, row, prob, goal, bandwidth=True):
        metric = bw_metric(prob) if bandwidth else mm_metric(prob)
        cfg, ms, gms, err = sweep(name, prob, decode_configs(row, quick, sms), metric, sms)
        if cfg is None:
            table.append((name, "all failed", "-", "-", "-", "-", "-", goal, "-", "-"))
            return None
        fi = fi_ms(prob)
        fi_s = "n/a" if fi is None else f"{fi[0] / ms:.2f}x (fi {fi[0] * 1e3:.1f}us err {fi[1]:.1e})"
        log(f"  flashinfer fa3: {fi_s}   (ratio = t_flashinfer / t_triton eager; > 1 means triton is faster)")
        P, pieces, pbytes = prob.plan(cfg, sms)
        if bandwidth:
            val, unit, scale, ceil, tag = prob.kv_bytes, "GB/s", 1e9, bw, "bw"
        else:
            val, unit, scale, ceil, tag = prob.flops, "TF/s", 1e12, mm, "mm"
        v_e, v_g = val / (ms * 1e-3), val / (gms * 1e-3)
        table.append(
            (
                name,
                fmt_cfg(cfg) or "default",
                f"{ms * 1e3:.1f}",
                f"{gms * 1e3:.1f}",
                f"{v_g / scale:.0f} {unit}" if bandwidth else f"{v_g / scale:.1f} {unit}",
                f"{100 * v_e / ceil:.1f}% {tag}",
                f"{100 * v_g / ceil:.1f}% {tag}",
                goal,
                f"{err:.1e}",
                "n/a" if fi is None else f"{fi[0] / ms:.2f}x",
            )
        )
        log(f"  best plan: P={P} pieces={pieces}, partials written+read {pbytes / MiB:.1f} MiB "
            f"({100 * pbytes / prob.kv_bytes:.1f}% of the KV bytes)")  # fmt: skip
        if not SMOKE:
            g1 = graph_ms(prob.runner(**cfg, _skip_merge=True), len(prob.copies))
            log(f"  stage 1 alone (graph): {g1 * 1e3:.1f} us -> merge + its launch {1e3 * (gms - g1):.1f} us")
        return cfg, ms, gms

    def guarded(fn, *a):
        try:
            return fn(*a)
        except Exception:
            traceback.print_exc()
            return None

    r1 = None
    if "h16" in rows_wanted:  # 1. decode 16 heads, batch 128 x 8192
        p1 = DecodeProblem([S(8192)] * S(128, 2), 16, seed=1, **ws_kw)
        r1 = guarded(decode_row, "decode H16 B128 L8192", "h16", p1, ">=80% bw")
        del p1
        torch.cuda.empty_cache()

    if "var" in rows_wanted:  # 4. variable lengths vs uniform of the same total
        var_cfgs = [dict(r1[0])] if r1 else [{}]
        if not quick:
            for c in ({}, dict(use_tma=False), dict(use_tma=False, target_programs=sms)):
                if c not in var_cfgs:
                    var_cfgs.append(c)
        nb = S(128, 3)
        for mean in (4096,) if quick else (4096, 8192):
            mean = S(mean)
            g = torch.Generator().manual_seed(mean)
            lens = torch.normal(float(mean), mean / 2, (nb,), generator=g).round().clamp(1, 2 * mean).int().tolist()
            total = sum(lens)
            uni = [total // nb + (1 if i < total % nb else 0) for i in range(nb)]
            name = f"decode H16 B{nb} var mean {mean}"
            probs = {
                tag: DecodeProblem(ls, 16, seed=mean + len(tag), **ws_kw)
                for tag, ls in (("normal", lens), ("uniform", uni))
            }
            log(
                f"\n== {name} (total {total} tokens, max {max(lens)}, min {min(lens)}; "
                "normal vs uniform of the same total)"
            )
            best = None
            for cfg in var_cfgs:
                res = {tag: try_config(pr, cfg) for tag, pr in probs.items()}
                (mv, gv, ev, fv), (mu, gu, eu, fu) = res["normal"], res["uniform"]
                if fv or fu:
                    log(f"  {fmt_cfg(cfg) or 'default':52s} FAIL {fv or fu}")
                    continue
                P, pieces, pbytes = probs["normal"].plan(cfg, sms)
                chg, gchg = 100 * (mv - mu) / mu, 100 * (gv - gu) / gu
                log(
                    f"  {fmt_cfg(cfg) or 'default':52s} normal {mv * 1e3:7.1f} us, uniform {mu * 1e3:7.1f} us -> "
                    f"{chg:+5.1f}% | graph normal {gv * 1e3:7.1f} us, uniform {gu * 1e3:7.1f} us -> {gchg:+5.1f}%"
                    f"  normal {100 * probs['normal'].kv_bytes / (gv * 1e-3) / bw:.1f}% bw (graph)"
                    f"  err {ev:.1e}/{eu:.1e}"
                    f"  P={P} pieces={pieces}"
                )
                if best is None or gv < best[2]:
                    best = (cfg, mv, gv, ev, mu, gu)
            if best is None:
                table.append((name, "all failed", "-", "-", "-", "-", "-", "within 8% of uniform", "-", "-"))
                continue
            cfg, mv, gv, ev, mu, gu = best
            fis = "n/a"
            fiv, fiu = fi_ms(probs["normal"]), fi_ms(probs["uniform"])
            if fiv is not None and fiu is not None:
                fis = f"{fiv[0] / mv:.2f}x"
                log(
                    f"  flashinfer fa3: normal {fiv[0] * 1e3:.1f} us, uniform {fiu[0] * 1e3:.1f} us "
                    f"({100 * (fiv[0] - fiu[0]) / fiu[0]:+.1f}%), t_fi/t_triton on normal {fiv[0] / mv:.2f}x"
                )
            kvb = probs["normal"].kv_bytes
            table.append(
                (
                    name,
                    fmt_cfg(cfg) or "default",
                    f"{mv * 1e3:.1f}",
                    f"{gv * 1e3:.1f}",
                    f"{100 * (mv - mu) / mu:+.1f}% / {100 * (gv - gu) / gu:+.1f}% vs unif",
                    f"{100 * kvb / (mv * 1e-3) / bw:.1f}% bw",
                    f"{100 * kvb / (gv * 1e-3) / bw:.1f}% bw",
                    "within 8% of uniform",
                    f"{ev:.1e}",
                    fis,
                )
            )
            del probs
            torch.cuda.empty_cache()

    if "b1" in rows_wanted:  # 2. decode batch 1 x 32768
        p2 = DecodeProblem([S(32768, 300)], 16, seed=2, **ws_kw)
        guarded(decode_row, "decode H16 B1 L32768", "b1", p2, ">=50% bw")
        del p2
        torch.cuda.empty_cache()

    if "h128" in rows_wanted:  # 3. decode 128 heads, batch 64 x 4096
        p3 = DecodeProblem([S(4096)] * S(64, 2), S(128, 32), seed=3, **ws_kw)
        guarded(decode_row, "decode H128 B64 L4096", "h128", p3, ">=50% mm", False)
        del p3
        torch.cuda.empty_cache()

    if "scratch" in rows_wanted:  # 5. split-KV scratch (the backend's: split_slots x H x 513 float32)
        for h in (16, 128):
            nbytes = args.split_slots * h * (D_CKV + 1) * 4
            log(f"\n== split-KV scratch, {h} heads, split_slots={args.split_slots}: {nbytes / MiB:.1f} MiB (any batch)")
            table.append(
                (f"scratch H{h}", f"split_slots={args.split_slots}", "-", "-", f"{nbytes / MiB:.1f} MiB", "-", "-",
                 "<=128 MiB" if h == 16 else "-", "-", "-")
            )  # fmt: skip

    if "extend" in rows_wanted:
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
        best = guarded(sweep, "extend H16 4x2048 new over 2048 prefix", pe, cfgs, mm_metric(pe))
        if best and best[0] is not None and not quick:
            more = [dict(best[0], num_stages=s) for s in (1, 3)]
            b2 = guarded(sweep, "extend H16 [stages]", pe, more, mm_metric(pe))
            if b2 and b2[0] is not None and b2[2] < best[2]:
                best = b2
        if best and best[0] is not None:
            cfg, ms, gms, err = best
            val, gval = pe.flops / (ms * 1e-3), pe.flops / (gms * 1e-3)
            table.append(
                (
                    "extend H16 4x2048 / 2048 prefix",
                    fmt_cfg(cfg),
                    f"{ms * 1e3:.1f}",
                    f"{gms * 1e3:.1f}",
                    f"{gval / 1e12:.1f} TF/s",
                    f"{100 * val / mm:.1f}% mm",
                    f"{100 * gval / mm:.1f}% mm",
                    "-",
                    f"{err:.1e}",
                    "-",
                )
            )
        del pe
        torch.cuda.empty_cache()

    # summary
    log(
        f"\nceilings: copy {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s; decode defaults: "
        f"{default_decode_config(16, DTYPE)} (16 heads), {default_decode_config(128, DTYPE)} (128 heads), programs "
        f"per SM by block_h {PROGRAMS_PER_SM} (pointer loads), {PROGRAMS_PER_SM_TMA} (TMA); workspace "
        f"max_splits={args.max_splits} split_slots={args.split_slots} "
        "(tp = target_programs, mt = min_tokens_per_split, ws = workspace max_splits, reg = maxnreg)"
    )
    head = ("row", "best config", "eager us", "graph us", "value (graph)", "% ceil eager", "% ceil graph", "goal",
            "rel err", "t_fi/t_triton")  # fmt: skip
    rows = [head] + [tuple(str(x) for x in r) for r in table]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for i, r in enumerate(rows):
        log("  ".join(x.ljust(w) for x, w in zip(r, widths)))
        if i == 0:
            log("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    main()
