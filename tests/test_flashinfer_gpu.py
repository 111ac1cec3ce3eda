"""FlashInfer MLA backend on a CUDA GPU, against the float32 torch reference on the same KV pool.

Everything here is built directly (no Hydra): real request table, page allocator, token slots, MLA KV pool
and workspace ledger on cuda, bf16 KV. Pages are scattered (throwaway requests grab and free pages between
the real ones), lengths are odd (1, 7, 63, 64, 65, 1000), page sizes 1, 16 and 64. The first FlashInfer
call of each kernel variant JIT-compiles it (tens of seconds), later calls are fast.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flashinfer")

from backends.flashinfer_mla import FlashInferMLABackend, float_workspace_spec, precompile  # noqa: E402
from backends.torch_mla import TorchMLABackend  # noqa: E402
from runtime.core.batch import ForwardBatch, ForwardMode, make_batch  # noqa: E402
from runtime.core.errors import ConfigError  # noqa: E402
from runtime.core.kv_pool import MLAKVPool, PageAllocator, ReqToTokenPool, TokenSlots  # noqa: E402
from runtime.core.model_spec import ModelSpec  # noqa: E402
from runtime.core.prefix_chunks import plan_prefix_chunks  # noqa: E402
from runtime.core.workspace import WorkspaceLedger  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEV = torch.device("cuda")
KV_LORA, ROPE, NOPE, V_HEAD = 512, 64, 128, 128
TOL = 2e-2
LENS = [1, 7, 63, 64, 65, 1000]
PAGE_SIZES = [1, 16, 64]


# ------------------------------------------------------------------------------------------------ helpers
def model_spec(heads: int, max_context: int = 4096) -> ModelSpec:
    return ModelSpec.from_config({
        "name": "fi_test", "num_layers": 2, "hidden_size": 64, "num_heads": heads, "q_lora_rank": None,
        "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V_HEAD,
        "vocab_size": 32, "max_context": max_context, "dtype": "bfloat16", "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "layer_pattern": ["full"], "weight_seed": 0,
    })


@dataclass
class Env:
    slots: TokenSlots
    r2t: ReqToTokenPool
    kv: MLAKVPool
    ledger: WorkspaceLedger
    model: ModelSpec
    layers: tuple[int, ...]
    gen: torch.Generator


def make_env(page_size: int, heads: int = 16, layers=(0, 1), max_context: int = 4096, seed: int = 0) -> Env:
    model = model_spec(heads, max_context)
    num_pages = 32768 // page_size + 64
    r2t = ReqToTokenPool(64, max_context, DEV)
    kv = MLAKVPool(list(layers), num_pages, page_size, KV_LORA, ROPE, torch.bfloat16, DEV)
    return Env(TokenSlots(r2t, PageAllocator(num_pages, page_size)), r2t, kv, WorkspaceLedger(DEV), model,
               tuple(layers), torch.Generator().manual_seed(seed))


def make_backend(env: Env, kernel: str = "auto", disable_ragged: bool = False) -> FlashInferMLABackend:
    float_ws = env.ledger.acquire(float_workspace_spec({"flashinfer_bytes": 128 << 20}), "test")
    cfg = {"name": "flashinfer_mla", "kernel": kernel, "disable_ragged": disable_ragged}
    return FlashInferMLABackend(env.r2t, env.kv, env.model, float_ws, env.ledger, cfg)


def reference(env: Env) -> TorchMLABackend:
    return TorchMLABackend(env.r2t, env.kv, env.model, "float32")


def _write_random_kv(env: Env, slots: torch.Tensor) -> None:
    n = slots.numel()
    for layer in env.layers:
        ckv = torch.randn(n, KV_LORA, generator=env.gen).to(DEV)
        kpe = torch.randn(n, ROPE, generator=env.gen).to(DEV)
        env.kv.write(layer, slots.to(DEV), ckv, kpe)


def _junk(env: Env) -> int:
    row = env.slots.open()
    n = int(torch.randint(1, 3 * env.slots.page_size + 2, (1,), generator=env.gen))
    env.slots.reserve(row, 0, n)
    return row


def open_batch(env: Env, prefix_lens: list[int], extend_lens: list[int], mode: ForwardMode) -> ForwardBatch:
    """One request per entry; prefix KV written first (the cache), then the new tokens' KV (the model writes
    them before attention). Throwaway requests take and free pages in between, so pages are scattered."""
    rows, locs = [], []
    for p, e in zip(prefix_lens, extend_lens):
        junk_a = _junk(env)
        row = env.slots.open()
        if p:
            _write_random_kv(env, env.slots.reserve(row, 0, p))
        junk_b = _junk(env)
        loc = env.slots.reserve(row, p, p + e)
        _write_random_kv(env, loc)
        env.slots.release(junk_a)
        env.slots.release(junk_b)
        rows.append(row)
        locs.append(loc)
    return make_batch(mode, rows, prefix_lens, extend_lens, torch.cat(locs).to(DEV), DEV)


def random_q(env: Env, t: int, dim: int) -> torch.Tensor:
    return torch.randn(t, env.model.num_heads, dim, generator=env.gen).to(DEV, torch.bfloat16)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def check_absorbed(env: Env, fi: FlashInferMLABackend, batch: ForwardBatch) -> None:
    """Every layer of one planned batch (one plan shared by all layers) against the reference."""
    ref = reference(env)
    fi.init_forward_metadata(batch)
    ref.init_forward_metadata(batch)
    for layer in env.layers:
        q_nope, q_pe = random_q(env, batch.num_tokens, KV_LORA), random_q(env, batch.num_tokens, ROPE)
        if batch.mode == ForwardMode.DECODE:
            out = fi.forward_decode(q_nope, q_pe, layer, batch)
            want = ref.forward_decode(q_nope.float(), q_pe.float(), layer, batch)
        else:
            out = fi.forward_extend(q_nope, q_pe, layer, batch)
            want = ref.forward_extend(q_nope.float(), q_pe.float(), layer, batch)
        assert out.shape == (batch.num_tokens, env.model.num_heads, KV_LORA) and out.dtype == torch.bfloat16
        err = rel_err(out, want)
        assert err < TOL, f"layer {layer}: relative error {err:.3g} (mode {batch.mode.value})"


CASES = {
    "extend_no_prefix": ([0] * len(LENS), LENS),
    "extend_over_prefix": (LENS, LENS[::-1]),
    "decode": ([n - 1 for n in LENS] + [0], [1] * (len(LENS) + 1)),
    "single_extend": ([300], [65]),
    "single_decode": ([999], [1]),
}


@pytest.fixture(scope="module", autouse=True)
def _built_kernels():
    """Build every FlashInfer module these tests use at once, in parallel (JIT: tens of seconds each)."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    precompile(ws, mla_kernels=("auto", "fa2"), ragged_kernels=("auto",), dtype=torch.bfloat16)
    del ws


# ------------------------------------------------------------------------------------------ absorbed MLA
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("case", list(CASES))
def test_absorbed_matches_torch(page_size, case):
    env = make_env(page_size, seed=page_size)
    fi = make_backend(env)
    prefix, extend = CASES[case]
    mode = ForwardMode.DECODE if case.endswith("decode") else ForwardMode.EXTEND
    check_absorbed(env, fi, open_batch(env, prefix, extend, mode))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_kv_pages_address_every_token(page_size):
    """The padded page table, read the way FlashInfer's MLA kernels read it (start kv_indptr[b], token t at
    kv_indices[start + t // page_size]), yields exactly the request table's slots."""
    env = make_env(page_size, layers=(0,))
    fi = make_backend(env, disable_ragged=True)
    batch = open_batch(env, [n - 1 for n in LENS], [1] * len(LENS), ForwardMode.DECODE)
    kv_indices, kv_indptr = fi._kv_pages(batch)
    assert kv_indices.dtype == torch.int32 and kv_indptr.dtype == torch.int32 and not kv_indptr.is_cuda
    for b, (row, n) in enumerate(zip(batch.req_pool_indices_cpu.tolist(), batch.seq_lens_cpu.tolist())):
        t = torch.arange(n, device=DEV)
        slots = kv_indices[int(kv_indptr[b]) + t // page_size].long() * page_size + t % page_size
        assert torch.equal(slots, env.r2t.req_to_token[row, :n].long()), f"request {b}"


def test_decode_128_heads_and_successive_batches():
    """DeepSeek-V3 head count (two-CTA clusters in fa3), then a second batch on the same backend (re-plan)."""
    env = make_env(64, heads=128, seed=3)
    fi = make_backend(env)
    check_absorbed(env, fi, open_batch(env, [n - 1 for n in LENS], [1] * len(LENS), ForwardMode.DECODE))
    check_absorbed(env, fi, open_batch(env, [0, 40, 900], [70, 3, 1], ForwardMode.EXTEND))
    check_absorbed(env, fi, open_batch(env, [500, 2], [1, 1], ForwardMode.DECODE))


def test_fa2_kernel_matches_torch():
    env = make_env(16, seed=5)
    fi = make_backend(env, kernel="fa2")
    check_absorbed(env, fi, open_batch(env, [n - 1 for n in LENS], [1] * len(LENS), ForwardMode.DECODE))
    check_absorbed(env, fi, open_batch(env, [0, 100, 7], [65, 63, 1000], ForwardMode.EXTEND))


def test_fa3_refused_on_non_hopper():
    if torch.cuda.get_device_capability()[0] == 9:
        pytest.skip("Hopper runs fa3")
    env = make_env(16)
    with pytest.raises(ConfigError, match="kernel=fa3"):
        make_backend(env, kernel="fa3")


def test_workspaces_come_from_the_ledger():
    env = make_env(16)
    fi = make_backend(env)
    bufs = {name: env.ledger._buffers[name] for name in env.ledger.report()}
    assert fi._mla._int_workspace_buffer.data_ptr() == bufs["flashinfer_int:mla"].data_ptr()
    assert fi._ragged._int_workspace_buffer.data_ptr() == bufs["flashinfer_int:ragged"].data_ptr()
    assert fi._mla._float_workspace_buffer.data_ptr() == bufs["flashinfer_float"].data_ptr()
    assert env.ledger.consumers()["flashinfer_float"] == ["test"]

    env2 = make_env(16)
    make_backend(env2, disable_ragged=True)
    assert "flashinfer_int:ragged" not in env2.ledger.report()


# -------------------------------------------------------------------------- MHA chunked-prefix prefill
def decompression(env: Env):
    g = env.gen
    h = env.model.num_heads
    w_uk = (torch.randn(h, NOPE, KV_LORA, generator=g) / KV_LORA**0.5).to(DEV, torch.bfloat16)
    w_uv = (torch.randn(h, KV_LORA, V_HEAD, generator=g) / KV_LORA**0.5).to(DEV, torch.bfloat16)

    def decompress(rows: torch.Tensor):
        ckv, kpe = rows[:, :KV_LORA], rows[:, KV_LORA:]
        k_nope = torch.einsum("nc,hdc->nhd", ckv, w_uk)
        v = torch.einsum("nc,hcd->nhd", ckv, w_uv)
        return torch.cat([k_nope, kpe[:, None, :].expand(-1, h, -1)], dim=-1), v

    return w_uk, w_uv, decompress


def run_mha(hook, env: Env, layer: int, batch: ForwardBatch, q, decompress, dtype):
    """What runtime/model/mla_model.py's _mha_prefill does: causal pass over the new tokens, then merge every chunk."""
    k, v = decompress(env.kv.gather(layer, batch.out_cache_loc))
    out, lse = hook.forward_mha_extend(q.to(dtype), k.to(dtype), v.to(dtype), layer, batch)
    first_lse = lse.clone()
    for i, chunk in enumerate(batch.prefix_chunks):
        k_c, v_c = decompress(env.kv.gather(layer, chunk.kv_slots))
        out_c, lse_c = hook.forward_mha_prefix_chunk(q.to(dtype), k_c.to(dtype), v_c.to(dtype), i, layer, batch)
        assert torch.isfinite(out_c).all(), f"chunk {i}: non-finite output"
        assert not torch.isnan(lse_c).any(), f"chunk {i}: NaN lse"
        out, lse = hook.merge_states(out, lse, out_c, lse_c)
    return out, lse, first_lse


@pytest.mark.parametrize("page_size,heads", [(1, 16), (64, 16), (64, 128)])
def test_mha_chunked_prefill_matches_absorbed_and_torch(page_size, heads):
    env = make_env(page_size, heads=heads, layers=(0,), seed=11 + page_size)
    fi, ref = make_backend(env), reference(env)
    # request 0 has no prefix; request 1's prefix (5) is shorter than most chunk starts: empty ranges
    batch = open_batch(env, [0, 5, 100, 700], [33, 64, 1, 200], ForwardMode.EXTEND)
    fi.init_forward_metadata(batch)
    ref.init_forward_metadata(batch)
    batch.prefix_chunks = plan_prefix_chunks(batch, env.r2t, chunk_tokens=256)
    assert len(batch.prefix_chunks) >= 3
    fi.init_mha_chunk_metadata(batch)
    ref.init_mha_chunk_metadata(batch)

    w_uk, w_uv, decompress = decompression(env)
    t = batch.num_tokens
    q_nope, q_pe = random_q(env, t, NOPE), random_q(env, t, ROPE)
    q = torch.cat([q_nope, q_pe], dim=-1)

    out_fi, lse_fi, causal_lse_fi = run_mha(fi, env, 0, batch, q, decompress, torch.bfloat16)
    out_ref, _, causal_lse_ref = run_mha(ref, env, 0, batch, q, decompress, torch.float32)
    assert out_fi.shape == (t, env.model.num_heads, V_HEAD) and lse_fi.dtype == torch.float32
    # FlashInfer's lse is base 2: log2(sum exp) = ln(sum exp) / ln 2
    assert torch.allclose(causal_lse_fi, causal_lse_ref / math.log(2), atol=5e-2, rtol=1e-2)

    q_abs = torch.einsum("thd,hdc->thc", q_nope, w_uk)
    lat_fi = fi.forward_extend(q_abs, q_pe, 0, batch)
    lat_ref = ref.forward_extend(q_abs.float(), q_pe.float(), 0, batch)
    absorbed_fi = torch.einsum("thc,hcd->thd", lat_fi, w_uv)
    absorbed_ref = torch.einsum("thc,hcd->thd", lat_ref, w_uv.float())

    assert rel_err(out_ref, absorbed_ref) < TOL  # the two paths of the reference agree
    assert rel_err(out_fi, out_ref) < TOL, "FlashInfer MHA hook vs torch MHA hook"
    assert rel_err(out_fi, absorbed_fi.float()) < TOL, "FlashInfer MHA hook vs FlashInfer absorbed"
    assert rel_err(absorbed_fi, absorbed_ref) < TOL, "FlashInfer absorbed vs torch absorbed"


def test_mha_without_prefix_and_chunk_count_changes():
    env = make_env(16, layers=(0,), seed=21)
    fi, ref = make_backend(env), reference(env)
    _, _, decompress = decompression(env)
    cases = [([0, 0], [7, 65], 64), ([64, 1], [1, 63], 16), ([0, 300], [9, 2], 128), ([1000], [1], 4096)]
    for prefix, extend, chunk_tokens in cases:
        batch = open_batch(env, prefix, extend, ForwardMode.EXTEND)
        batch.prefix_chunks = plan_prefix_chunks(batch, env.r2t, chunk_tokens=chunk_tokens)
        fi.init_forward_metadata(batch)
        fi.init_mha_chunk_metadata(batch)
        ref.init_mha_chunk_metadata(batch)
        q = random_q(env, batch.num_tokens, NOPE + ROPE)
        out_fi, _, _ = run_mha(fi, env, 0, batch, q, decompress, torch.bfloat16)
        out_ref, _, _ = run_mha(ref, env, 0, batch, q, decompress, torch.float32)
        assert rel_err(out_fi, out_ref) < TOL, (prefix, extend)


@pytest.mark.parametrize("heads", [16, 128])
def test_merge_states_base2_any_head_count(heads):
    """128 heads x 128 dims is past FlashInfer's one-block-per-token limit; the backend merges on a view."""
    env = make_env(64, heads=heads, layers=(0,))
    fi = make_backend(env, disable_ragged=True)
    g = torch.Generator().manual_seed(7)
    t = 37
    out_a, out_b = (torch.randn(t, heads, V_HEAD, generator=g).to(DEV, torch.bfloat16) for _ in range(2))
    lse_a, lse_b = (torch.randn(t, heads, generator=g).mul(4).to(DEV) for _ in range(2))
    lse_b[::3] = -math.inf  # empty ranges
    out, lse = fi.merge_states(out_a, lse_a, out_b, lse_b)
    want_lse = torch.logaddexp2(lse_a, lse_b)
    w_a, w_b = torch.exp2(lse_a - want_lse)[..., None], torch.exp2(lse_b - want_lse)[..., None]
    want = out_a.float() * w_a + out_b.float() * w_b
    assert torch.allclose(lse, want_lse, atol=1e-4)
    assert rel_err(out, want) < 1e-2


# ------------------------------------------------------------------------------------------ CUDA graphs
def _padded(env: Env, batch_rows: list[int], prefix: list[int], pad_row: int, size: int) -> ForwardBatch:
    """Decode batch padded to ``size``: padding entries use ``pad_row`` (slot 0 = padding page), seq_len 1."""
    n_pad = size - len(batch_rows)
    rows = batch_rows + [pad_row] * n_pad
    locs = [int(env.r2t.req_to_token[r, p]) for r, p in zip(batch_rows, prefix)] + [0] * n_pad
    return make_batch(ForwardMode.DECODE, rows, prefix + [0] * n_pad, [1] * size,
                      torch.tensor(locs, dtype=torch.int64, device=DEV), DEV)


@pytest.mark.parametrize("page_size", [1, 64])
def test_graph_capture_replay_equals_eager(page_size):
    env = make_env(page_size, layers=(0,), seed=31)
    fi, ref = make_backend(env), reference(env)
    h = env.model.num_heads
    pad_row = env.slots.open()
    env.r2t.req_to_token[pad_row, 0] = 0  # slot 0: the padding page

    capture = open_batch(env, [5, 70, 130, 1, 64, 63, 999, 20], [1] * 8, ForwardMode.DECODE)
    fi.init_graph_state(capture)
    fi.init_forward_metadata_capture(capture)
    q_nope = torch.zeros(8, h, KV_LORA, dtype=torch.bfloat16, device=DEV)
    q_pe = torch.zeros(8, h, ROPE, dtype=torch.bfloat16, device=DEV)
    q_nope.copy_(random_q(env, 8, KV_LORA))
    q_pe.copy_(random_q(env, 8, ROPE))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture (JIT, allocator)
        fi.forward_decode(q_nope, q_pe, 0, capture)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = fi.forward_decode(q_nope, q_pe, 0, capture)
    graph.replay()
    torch.cuda.synchronize()
    ref.init_forward_metadata(capture)
    assert rel_err(out_static, ref.forward_decode(q_nope.float(), q_pe.float(), 0, capture)) < TOL

    for prefix in ([40, 1000, 3, 64, 127], [1, 2, 300, 65, 7]):
        real = open_batch(env, prefix, [1] * 5, ForwardMode.DECODE)
        rows = real.req_pool_indices_cpu.tolist()
        padded = _padded(env, rows, prefix, pad_row, 8)
        qn, qp = random_q(env, 8, KV_LORA), random_q(env, 8, ROPE)
        fi.init_forward_metadata_replay(padded)
        q_nope.copy_(qn)
        q_pe.copy_(qp)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out_static[:5].clone()

        fi.init_forward_metadata(padded)  # eager, same padded batch: same plan
        eager_padded = fi.forward_decode(qn, qp, 0, padded)[:5]
        fi.init_forward_metadata(real)  # eager, the real batch
        eager = fi.forward_decode(qn[:5], qp[:5], 0, real)
        ref.init_forward_metadata(real)
        want = ref.forward_decode(qn[:5].float(), qp[:5].float(), 0, real)
        assert torch.isfinite(out_static).all()
        assert rel_err(replayed, eager_padded) < 1e-3, "graph replay vs eager on the padded batch"
        assert rel_err(replayed, eager) < TOL
        assert rel_err(replayed, want) < TOL


# ------------------------------------------------------------------------------------------ end to end
def test_engine_end_to_end_parity(tmp_path):
    cmd = [sys.executable, "-m", "runtime", "backend=flashinfer_mla", "device=cuda", "model.dtype=bfloat16",
           "workload=smoke", "progress=false", f"hydra.run.dir={tmp_path}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:])
    assert proc.returncode == 0, tail
    assert "parity check FAILED" not in proc.stderr, tail
