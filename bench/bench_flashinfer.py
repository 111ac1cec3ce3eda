"""FlashInfer MLA backend benchmark: throughput against ceilings measured in the same run.

``python -m bench.bench_flashinfer [--quick] [--kernels fa3,fa2]`` (or ``python bench/bench_flashinfer.py``)

Rows (each timed with :func:`bench.harness.eager_ms`, median, after warm-up; every FlashInfer module is
JIT-built up front, in parallel, before anything is timed):

* decode, 16 heads, batch 128 x 8192 tokens, page 64: GB/s of KV read (B * L * 576 * 2 bytes), % of copy.
* decode, 128 heads, batch 64 x 4096: TFLOP/s = 2 * B * H * L * (576 + 512) / t, % of the bf16 matmul.
* MHA chunked-prefix prefill, 128 heads, 8192 new tokens over an 8192-token prefix, 1 and 2 prefix chunks
  (causal ragged over the new tokens + non-causal per chunk + merge): TFLOP/s with the causal part counted
  as half, % of matmul.
* decode with lengths ~ N(mean, mean / 2) clamped to [1, 2 * mean] vs all lengths = mean, batch 128,
  16 heads, mean 4096 and 8192: GB/s and the drop.
* plan() host time per call at batch 128 (raw ``wrapper.plan`` and the backend's ``init_forward_metadata``,
  which also gathers the kv indices on the device).

Every kernel row is timed twice: the raw FlashInfer call on the same tensors, and the runtime backend's
call (``FlashInferMLABackend.forward_decode`` after ``init_forward_metadata``, or its MHA hooks); the
runtime/raw ratio is the backend's overhead. Both fa3 and fa2 run where both exist (Hopper). The table
comes last.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from backends.flashinfer_mla import FlashInferMLABackend, merge_head_groups, precompile  # noqa: E402
from bench.harness import Table, eager_ms, gb_per_s, host_us, measure_ceilings, report, tflop_per_s  # noqa: E402
from runtime.core.batch import ForwardBatch, ForwardMode, make_batch  # noqa: E402
from runtime.core.kv_pool import MLAKVPool, ReqToTokenPool  # noqa: E402
from runtime.core.model_spec import ModelSpec  # noqa: E402
from runtime.core.prefix_chunks import plan_prefix_chunks  # noqa: E402
from runtime.core.workspace import WorkspaceLedger  # noqa: E402

DEV = torch.device("cuda")
DT = torch.bfloat16
KV_LORA, ROPE, QK, VO = 512, 64, 192, 128
ROW_BYTES = (KV_LORA + ROPE) * 2


@dataclass
class Row:
    name: str
    kernel: str
    metric: str  # "GB/s" | "TFLOP/s" | "us"
    value: float
    pct: float | None = None  # of the ceiling
    goal: str = ""
    ratio: float | None = None  # runtime / raw throughput
    note: str = ""


def median_ms(fn, quick: bool) -> float:
    return eager_ms(fn, warmup_ms=25 if quick else 100, rep_ms=100 if quick else 500)


def timed_pair(raw, runtime, quick: bool, rounds: int = 3) -> tuple[float, float]:
    """(raw ms, runtime ms): medians over interleaved rounds, so drift hits both alike."""
    a, b = [], []
    for _ in range(1 if quick else rounds):
        a.append(median_ms(raw, quick))
        b.append(median_ms(runtime, quick))
    return statistics.median(a), statistics.median(b)


def spec(heads: int, max_context: int) -> ModelSpec:
    return ModelSpec.from_config(
        {
            "name": f"bench_h{heads}",
            "num_layers": 1,
            "hidden_size": 64,
            "num_heads": heads,
            "q_lora_rank": None,
            "kv_lora_rank": KV_LORA,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": ROPE,
            "v_head_dim": VO,
            "vocab_size": 32,
            "max_context": max_context,
            "dtype": "bfloat16",
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "layer_pattern": ["full"],
            "weight_seed": 0,
        }
    )


class Setup:
    """A request table with scattered pages, a one-layer pool filled with random KV, a backend on them."""

    def __init__(
        self,
        lens: list[int],
        heads: int,
        page_size: int,
        kernel: str,
        float_ws: torch.Tensor,
        fill_kv: bool = True,
        seed: int = 0,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.page_size = lens, page_size
        max_ctx = max(lens) + page_size
        pages_per = [-(-n // page_size) for n in lens]
        num_pages = sum(pages_per) + 1  # page 0 is the padding page
        self.r2t = ReqToTokenPool(len(lens), max_ctx, DEV)
        self.kv = MLAKVPool([0], num_pages if fill_kv else 2, page_size, KV_LORA, ROPE, DT, DEV)
        if fill_kv:
            self.kv.buffer(0).normal_()
        perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
        offs = torch.arange(page_size, dtype=torch.int64)
        at = 0
        for b, (n, p) in enumerate(zip(lens, pages_per)):
            pages = torch.tensor(perm[at : at + p], dtype=torch.int64)
            at += p
            slots = (pages[:, None] * page_size + offs[None, :]).flatten()[:n]
            self.r2t.req_to_token[b, :n] = slots.to(DEV, torch.int32)
        self.model = spec(heads, max_ctx)
        self.ledger = WorkspaceLedger(DEV)  # the backend's int workspaces; the float one is shared
        self.float_ws = float_ws
        cfg = {"name": "flashinfer_mla", "kernel": kernel, "disable_ragged": False}
        self.backend = FlashInferMLABackend(self.r2t, self.kv, self.model, self.float_ws, self.ledger, cfg)

    def decode_batch(self) -> ForwardBatch:
        rows = list(range(len(self.lens)))
        last = self.r2t.req_to_token[torch.arange(len(rows), device=DEV), torch.tensor(self.lens, device=DEV) - 1]
        return make_batch(ForwardMode.DECODE, rows, [n - 1 for n in self.lens], [1] * len(rows), last.long(), DEV)


def raw_mla(setup: Setup, batch: ForwardBatch, kernel: str):
    """A plain FlashInfer MLA wrapper planned for ``batch`` on the same pool; returns (wrapper, plan args)."""
    from flashinfer.mla import BatchMLAPagedAttentionWrapper

    w = BatchMLAPagedAttentionWrapper(setup.float_ws, backend=kernel)
    kv_indices, kv_indptr_cpu = setup.backend._kv_pages(batch)
    args = (
        batch.qo_indptr_cpu,
        kv_indptr_cpu,
        kv_indices,
        batch.seq_lens_cpu,
        setup.model.num_heads,
        KV_LORA,
        ROPE,
        setup.page_size,
        False,
        setup.model.sm_scale,
        DT,
        DT,
    )
    w.plan(*args)
    return w, args


def bench_decode(lens, heads, page_size, kernel, ws, quick):
    """-> (raw ms, runtime ms, setup, batch, raw wrapper, plan args)."""
    s = Setup(lens, heads, page_size, kernel, ws)
    batch = s.decode_batch()
    b = len(lens)
    q_nope = torch.randn(b, heads, KV_LORA, dtype=DT, device=DEV)
    q_pe = torch.randn(b, heads, ROPE, dtype=DT, device=DEV)
    s.backend.init_forward_metadata(batch)
    w, args = raw_mla(s, batch, kernel)
    buf = s.kv.buffer(0)
    ckv, kpe = buf[..., :KV_LORA], buf[..., KV_LORA:]
    out_rt = s.backend.forward_decode(q_nope, q_pe, 0, batch)
    out_raw = w.run(q_nope, q_pe, ckv, kpe)
    torch.cuda.synchronize()
    if not torch.equal(out_rt, out_raw):
        print(f"WARNING: runtime and raw decode outputs differ (max {float((out_rt - out_raw).abs().max()):.3g})")
    raw_ms, rt_ms = timed_pair(
        lambda: w.run(q_nope, q_pe, ckv, kpe), lambda: s.backend.forward_decode(q_nope, q_pe, 0, batch), quick
    )
    return raw_ms, rt_ms, s, batch, w, args


def plan_host_times(s: Setup, batch: ForwardBatch, w, plan_args, n: int) -> tuple[float, float]:
    """(raw ``wrapper.plan`` us, backend ``init_forward_metadata`` us) per call, host time."""
    return host_us(lambda: w.plan(*plan_args), n), host_us(lambda: s.backend.init_forward_metadata(batch), n)


def bench_mha(t_new, prefix, heads, chunk_tokens, kernel, ws, quick):
    """-> (raw ms, runtime ms, flops, num_chunks)."""
    from flashinfer.cascade import merge_state
    from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

    s = Setup([prefix + t_new], heads, 64, kernel, ws, fill_kv=False)
    batch = make_batch(
        ForwardMode.EXTEND, [0], [prefix], [t_new], s.r2t.req_to_token[0, prefix : prefix + t_new].long(), DEV
    )
    batch.prefix_chunks = plan_prefix_chunks(batch, s.r2t, chunk_tokens)
    s.backend.init_mha_chunk_metadata(batch)
    q = torch.randn(t_new, heads, QK, dtype=DT, device=DEV)
    k = torch.randn(t_new, heads, QK, dtype=DT, device=DEV)
    v = torch.randn(t_new, heads, VO, dtype=DT, device=DEV)
    kc = [torch.randn(c.kv_slots.numel(), heads, QK, dtype=DT, device=DEV) for c in batch.prefix_chunks]
    vc = [torch.randn(c.kv_slots.numel(), heads, VO, dtype=DT, device=DEV) for c in batch.prefix_chunks]

    def plan(kv_indptr, causal):
        w = BatchPrefillWithRaggedKVCacheWrapper(s.float_ws, "NHD", backend=kernel)
        w.plan(
            batch.qo_indptr_cpu,
            kv_indptr,
            heads,
            heads,
            QK,
            head_dim_vo=VO,
            causal=causal,
            sm_scale=s.model.sm_scale,
            q_data_type=DT,
            kv_data_type=DT,
        )
        return w

    raw_causal = plan(batch.qo_indptr_cpu, True)
    raw_chunks = [plan(c.kv_indptr_cpu, False) for c in batch.prefix_chunks]

    g = merge_head_groups(heads, VO, 2)  # merge_state needs <= 1024 threads: heads in g groups (a view)
    tg, hg = t_new * g, heads // g

    def raw():
        out, lse = raw_causal.run(q, k, v, return_lse=True)
        for w, kk, vv in zip(raw_chunks, kc, vc):
            o, lse_c = w.run(q, kk, vv, return_lse=True)
            out, lse = merge_state(out.view(tg, hg, VO), lse.view(tg, hg), o.view(tg, hg, VO), lse_c.view(tg, hg))
        return out.view(t_new, heads, VO)

    def runtime():
        be = s.backend
        out, lse = be.forward_mha_extend(q, k, v, 0, batch)
        for i in range(len(kc)):
            o, lse_c = be.forward_mha_prefix_chunk(q, kc[i], vc[i], i, 0, batch)
            out, lse = be.merge_states(out, lse, o, lse_c)
        return out

    a, b = raw(), runtime()
    torch.cuda.synchronize()
    if not (torch.isfinite(b).all() and torch.equal(a, b)):
        print(f"WARNING: runtime and raw MHA prefill outputs differ (max {float((a - b).abs().max()):.3g})")
    raw_ms, rt_ms = timed_pair(raw, runtime, quick)
    flops = 2 * heads * (QK + VO) * (t_new * t_new / 2 + t_new * prefix)
    return raw_ms, rt_ms, flops, len(batch.prefix_chunks)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, short timing (a smoke run)")
    ap.add_argument("--kernels", default=None, help="comma list of fa3,fa2 (default: every one this GPU runs)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quick = args.quick
    if not torch.cuda.is_available():
        print("bench_flashinfer: needs a CUDA GPU; got none. Fix: run on a GPU host.", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability()
    kernels = args.kernels.split(",") if args.kernels else (["fa3", "fa2"] if major == 9 else ["fa2"])
    torch.manual_seed(0)

    t0 = time.perf_counter()
    ceil = measure_ceilings()
    copy_gbs, mm_tflops = ceil.copy_gbs, ceil.matmul_tflops
    print(f"[ceilings] {ceil.summary()} (sm{major}{minor}, {time.perf_counter() - t0:.0f} s)", flush=True)

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    t0 = time.perf_counter()
    precompile(ws, mla_kernels=kernels, ragged_kernels=kernels, dtype=DT)
    print(f"[jit] built MLA + ragged + merge modules for {kernels} in {time.perf_counter() - t0:.0f} s", flush=True)

    B1, L1 = (32, 2048) if quick else (128, 8192)
    B2, L2 = (16, 1024) if quick else (64, 4096)
    T_MHA = 2048 if quick else 8192
    means = [1024] if quick else [4096, 8192]
    rows: list[Row] = []

    for kernel in kernels:
        # decode, memory bound
        raw_ms, rt_ms, s, batch, w, plan_args = bench_decode([L1] * B1, 16, 64, kernel, ws, quick)
        nbytes = B1 * L1 * ROW_BYTES
        rows.append(Row(f"decode h16 B{B1}xL{L1} p64", kernel, "GB/s", gb_per_s(nbytes, rt_ms),
                        ceil.pct_copy(nbytes, rt_ms), ">=90%", raw_ms / rt_ms,
                        f"raw {gb_per_s(nbytes, raw_ms):.0f} GB/s"))
        print(f"[{kernel}] {rows[-1].name}: runtime {rt_ms:.3f} ms, raw {raw_ms:.3f} ms", flush=True)

        # plan host time at batch 128 (this setup has B1 requests; full runs use 128)
        plan_raw, plan_rt = plan_host_times(s, batch, w, plan_args, 20 if quick else 100)
        rows.append(Row(f"plan() host B{B1}", kernel, "us", plan_raw, note="raw wrapper.plan"))
        rows.append(Row(f"init_forward_metadata host B{B1}", kernel, "us", plan_rt, note="kv-indices gather + plan"))
        del s, batch, w, plan_args
        torch.cuda.empty_cache()

        # decode, compute bound
        raw_ms, rt_ms, s, *_ = bench_decode([L2] * B2, 128, 64, kernel, ws, quick)
        flops = 2 * B2 * 128 * L2 * (KV_LORA + ROPE + KV_LORA)
        rows.append(Row(f"decode h128 B{B2}xL{L2} p64", kernel, "TFLOP/s", tflop_per_s(flops, rt_ms),
                        ceil.pct_matmul(flops, rt_ms), ">=70%", raw_ms / rt_ms,
                        f"raw {tflop_per_s(flops, raw_ms):.0f}"))
        print(f"[{kernel}] {rows[-1].name}: runtime {rt_ms:.3f} ms, raw {raw_ms:.3f} ms", flush=True)
        del s
        torch.cuda.empty_cache()

        # MHA chunked-prefix prefill, 1 and 2 prefix chunks
        for n_chunks in (1, 2):
            raw_ms, rt_ms, flops, got = bench_mha(T_MHA, T_MHA, 128, T_MHA // n_chunks, kernel, ws, quick)
            rows.append(Row(f"MHA prefill h128 {T_MHA}+{T_MHA}pfx {got}ch", kernel, "TFLOP/s",
                            tflop_per_s(flops, rt_ms), ceil.pct_matmul(flops, rt_ms), ">=80%", raw_ms / rt_ms,
                            f"raw {tflop_per_s(flops, raw_ms):.0f}"))
            print(f"[{kernel}] {rows[-1].name}: runtime {rt_ms:.3f} ms, raw {raw_ms:.3f} ms", flush=True)
            torch.cuda.empty_cache()

        # length variance: N(mean, mean/2) clamped to [1, 2*mean] vs uniform lengths, batch 128
        gen = torch.Generator().manual_seed(1)
        for mean in means:
            varied = (torch.randn(B1, generator=gen) * (mean / 2) + mean).round().clamp(1, 2 * mean).long().tolist()
            res = {}
            for label, lens in (("uniform", [mean] * B1), ("N(m,m/2)", varied)):
                raw_ms, rt_ms, s, *_ = bench_decode(lens, 16, 64, kernel, ws, quick)
                res[label] = gb_per_s(sum(lens) * ROW_BYTES, rt_ms)
                del s
                torch.cuda.empty_cache()
            drop = 100 * (1 - res["N(m,m/2)"] / res["uniform"])
            rows.append(Row(f"decode h16 B{B1} mean{mean} uniform", kernel, "GB/s", res["uniform"],
                            100 * res["uniform"] / copy_gbs))
            rows.append(Row(f"decode h16 B{B1} mean{mean} N(m,m/2)", kernel, "GB/s", res["N(m,m/2)"],
                            100 * res["N(m,m/2)"] / copy_gbs, note=f"drop {drop:.1f}% vs uniform"))
            print(f"[{kernel}] mean {mean}: uniform {res['uniform']:.0f} GB/s, varied {res['N(m,m/2)']:.0f} GB/s, "
                  f"drop {drop:.1f}%", flush=True)

    table = Table([{"row": r.name, "kernel": r.kernel, "value": r.value, "unit": r.metric, "pct_ceil": r.pct,
                    "goal": r.goal, "rt_over_raw": r.ratio, "note": r.note} for r in rows],
                  title=f"FlashInfer MLA backend on {ceil.device}: copy {copy_gbs:.0f} GB/s, matmul "
                        f"{mm_tflops:.0f} TFLOP/s" + ("  (--quick: small sizes)" if quick else ""),
                  formats={"value": ".1f", "pct_ceil": ".0f", "rt_over_raw": ".3f"})
    report("bench_flashinfer", ceil, table, meta={"kernels": kernels, "quick": quick})
    bad = [r for r in rows if r.ratio is not None and not math.isfinite(r.ratio)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
