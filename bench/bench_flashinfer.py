"""FlashInfer MLA backend benchmark: throughput against ceilings measured in the same run.

``python bench/bench_flashinfer.py [--quick] [--kernels fa3,fa2]``

Rows (each timed with ``triton.testing.do_bench``, median, after warm-up; every FlashInfer module is
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

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from backends.flashinfer_mla import FlashInferMLABackend, merge_head_groups, precompile  # noqa: E402
from bench.ceilings import measure_ceilings  # noqa: E402
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
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25 if quick else 100, rep=100 if quick else 500, return_mode="median"))


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


def host_us(fn, n: int) -> float:
    """Median host time of ``fn`` in microseconds (GPU drained first; the calls only enqueue work)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


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
    kc = [torch.randn(c.num_tokens, heads, QK, dtype=DT, device=DEV) for c in batch.prefix_chunks]
    vc = [torch.randn(c.num_tokens, heads, VO, dtype=DT, device=DEV) for c in batch.prefix_chunks]

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, short timing (a smoke run)")
    ap.add_argument("--kernels", default=None, help="comma list of fa3,fa2 (default: every one this GPU runs)")
    args = ap.parse_args()
    quick = args.quick
    if not torch.cuda.is_available():
        print("bench_flashinfer: needs a CUDA GPU; got none. Fix: run on a GPU host.", file=sys.stderr)
        return 2
    major, minor = torch.cuda.get_device_capability()
    kernels = args.kernels.split(",") if args.kernels else (["fa3", "fa2"] if major == 9 else ["fa2"])
    torch.manual_seed(0)

    t0 = time.perf_counter()
    ceil = measure_ceilings()
    copy_gbs, mm_tflops = ceil["copy_gbs"], ceil["matmul_tflops"]
    print(
        f"[ceilings] {ceil['device']} (sm{major}{minor}): copy {copy_gbs:.0f} GB/s (read+write), "
        f"bf16 8192^3 matmul {mm_tflops:.0f} TFLOP/s  ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )

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
        gbs = B1 * L1 * ROW_BYTES / (rt_ms * 1e-3) / 1e9
        raw_gbs = B1 * L1 * ROW_BYTES / (raw_ms * 1e-3) / 1e9
        rows.append(
            Row(
                f"decode h16 B{B1}xL{L1} p64",
                kernel,
                "GB/s",
                gbs,
                100 * gbs / copy_gbs,
                ">=90%",
                raw_ms / rt_ms,
                f"raw {raw_gbs:.0f} GB/s",
            )
        )
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
        tf = flops / (rt_ms * 1e-3) / 1e12
        rows.append(
            Row(
                f"decode h128 B{B2}xL{L2} p64",
                kernel,
                "TFLOP/s",
                tf,
                100 * tf / mm_tflops,
                ">=70%",
                raw_ms / rt_ms,
                f"raw {flops / (raw_ms * 1e-3) / 1e12:.0f}",
            )
        )
        print(f"[{kernel}] {rows[-1].name}: runtime {rt_ms:.3f} ms, raw {raw_ms:.3f} ms", flush=True)
        del s
        torch.cuda.empty_cache()

        # MHA chunked-prefix prefill, 1 and 2 prefix chunks
        for n_chunks in (1, 2):
            raw_ms, rt_ms, flops, got = bench_mha(T_MHA, T_MHA, 128, T_MHA // n_chunks, kernel, ws, quick)
            tf = flops / (rt_ms * 1e-3) / 1e12
            rows.append(
                Row(
                    f"MHA prefill h128 {T_MHA}+{T_MHA}pfx {got}ch",
                    kernel,
                    "TFLOP/s",
                    tf,
                    100 * tf / mm_tflops,
                    ">=80%",
                    raw_ms / rt_ms,
                    f"raw {flops / (raw_ms * 1e-3) / 1e12:.0f}",
                )
            )
            print(f"[{kernel}] {rows[-1].name}: runtime {rt_ms:.3f} ms, raw {raw_ms:.3f} ms", flush=True)
            torch.cuda.empty_cache()

        # length variance: N(mean, mean/2) clamped to [1, 2*mean] vs uniform lengths, batch 128
        gen = torch.Generator().manual_seed(1)
        for mean in means:
            varied = (torch.randn(B1, generator=gen) * (mean / 2) + mean).round().clamp(1, 2 * mean).long().tolist()
            res = {}
            for label, lens in (("uniform", [mean] * B1), ("N(m,m/2)", varied)):
                raw_ms, rt_ms, s, *_ = bench_decode(lens, 16, 64, kernel, ws, quick)
                res[label] = sum(lens) * ROW_BYTES / (rt_ms * 1e-3) / 1e9
                del s
                torch.cuda.empty_cache()
            drop = 100 * (1 - res["N(m,m/2)"] / res["uniform"])
            rows.append(
                Row(
                    f"decode h16 B{B1} mean{mean} uniform",
                    kernel,
                    "GB/s",
                    res["uniform"],
                    100 * res["uniform"] / copy_gbs,
                )
            )
            rows.append(
                Row(
                    f"decode h16 B{B1} mean{mean} N(m,m/2)",
                    kernel,
                    "GB/s",
                    res["N(m,m/2)"],
                    100 * res["N(m,m/2)"] / copy_gbs,
                    note=f"drop {drop:.1f}% vs uniform",
                )
            )
            print(
                f"[{kernel}] mean {mean}: uniform {res['uniform']:.0f} GB/s, varied {res['N(m,m/2)']:.0f} GB/s, "
                f"drop {drop:.1f}%",
                flush=True,
            )

    print()
    print(
        f"FlashInfer MLA backend on {ceil['device']}: copy {copy_gbs:.0f} GB/s, matmul {mm_tflops:.0f} TFLOP/s"
        + ("  (--quick: small sizes)" if quick else "")
    )
    head = f"{'row':<40} {'kernel':<6} {'value':>10} {'unit':<8} {'% ceil':>7} {'goal':>6} {'rt/raw':>7}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        pct = f"{r.pct:.0f}%" if r.pct is not None else ""
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else ""
        print(f"{r.name:<40} {r.kernel:<6} {r.value:>10.1f} {r.metric:<8} {pct:>7} {r.goal:>6} {ratio:>7}  {r.note}")
    bad = [r for r in rows if r.ratio is not None and not math.isfinite(r.ratio)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
