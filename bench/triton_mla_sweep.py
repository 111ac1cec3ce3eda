"""The Triton MLA kernel bench's config grid: each config checked against the float32 reference, then timed
eagerly and as a CUDA graph (:mod:`bench.harness`); FlashInfer fa3 on the same decode tensors for comparison.
Used by bench/triton_mla_kernels_gpu.py."""

from __future__ import annotations

import torch

from bench.harness import MiB, eager_ms, graph_ms, rel_err, sync
from bench.triton_mla_problems import D_CKV, D_PE, DTYPE, SCALE, DecodeProblem

TOL = 2e-2  # a config whose relative error reaches this is reported and not timed
WARMUP_MS, REP_MS = 25, 100


def log(*a):
    print(*a, flush=True)


def graph_call_ms(prob, run) -> float:
    """GPU time of one call of ``run`` (a rotating runner of ``prob``): one call per input copy captured in a CUDA
    graph and replayed; NaN on the CPU."""
    return graph_ms([run] * len(prob.copies), warmup_ms=WARMUP_MS, rep_ms=REP_MS, device=prob.device)


def try_config(prob, cfg, graph=True):
    """(eager ms, graph ms, rel_err, error string or None)."""
    try:
        run = prob.runner(**cfg)
        prob.out.fill_(float("nan"))
        # check on copy 0 (the reference's)
        run_check = prob.runner(**cfg)
        run_check()
        sync(prob.device)
        err = rel_err(prob.out, prob.ref())
        if not err < TOL:
            return None, None, err, f"rel err {err:.2e}"
        ms = eager_ms(run, warmup_ms=WARMUP_MS, rep_ms=REP_MS, device=prob.device)
        gms = graph_call_ms(prob, prob.runner(**cfg)) if graph else float("nan")
        return ms, gms, err, None
    except Exception as e:  # OutOfResources (shared memory), compile errors, ...
        msg = str(e).strip().splitlines()
        return None, None, float("nan"), (msg[0][:100] if msg else type(e).__name__)


def fmt_cfg(cfg):
    """A config in short form: ``bh=16 bn=64 w=8 ...``."""
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
    if prob.device.type != "cuda":  # --smoke: the interpreter is slow; two configs show the code paths
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
    """(eager ms, rel_err) of flashinfer's BatchMLAPagedAttentionWrapper(backend='fa3') rotating over the same
    input copies, or None (no GPU, no flashinfer, or it failed)."""
    if prob.device.type != "cuda":
        return None
    try:
        import flashinfer  # noqa: F401
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except Exception:
        return None
    try:
        wrappers, caches = [], []
        dev = prob.device
        qo_indptr = torch.arange(prob.B + 1, dtype=torch.int32, device=dev)
        for p in prob.copies:
            w = BatchMLAPagedAttentionWrapper(torch.empty(128 * MiB, dtype=torch.uint8, device=dev), backend="fa3")
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
        sync(dev)
        err = rel_err(out, prob.ref())
        state = [0]

        def run():
            i = state[0] % len(wrappers)
            state[0] += 1
            wrappers[i].run(prob.q_nope, prob.q_pe, caches[i][0], caches[i][1], out=out)

        ms = eager_ms(run, warmup_ms=WARMUP_MS, rep_ms=REP_MS, device=dev)
        return ms, err
    except Exception as e:
        log(f"  flashinfer failed: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}")
        return None


def decode_configs(row, quick, sms):
    """Configs tried per decode row (the first is the launcher's default: TMA loads, one program per SM).
    Earlier sweeps (tiles x warps x stages, plans) are summarized in docs/kernels.md; these are the
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
