"""The dsa backend against a float64 oracle, the container's build order and coordinator injection, the
validation of sparse/HiSparse configs, and the CLI end to end.

Without CUDA the Triton path runs in the CPU interpreter (TRITON_INTERPRET=1, set before any kernel module is
imported, as in the kernel tests)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from conftest import compose_config  # noqa: E402
from dependency_injector import providers  # noqa: E402
from mla_harness import KV_LORA, ROPE, make_harness, oracle_absorbed, random_batch, random_q, rel_err  # noqa: E402

import containers  # noqa: E402
from backends.dsa import DSABackend  # noqa: E402
from runtime.app.validation import validate  # noqa: E402
from runtime.core.device import DeviceInfo  # noqa: E402
from runtime.core.model_spec import ModelSpec  # noqa: E402
from runtime.engine.hisparse import HiSparseCoordinator  # noqa: E402
from runtime.model.indexer import IndexKeyPool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CPU = DeviceInfo("cpu", "cpu", 0, False, None, "cpu")
GPU = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "H100")
HI, DI = 4, 64


def dsa_spec(top_k: int, heads: int = 4, max_context: int = 256) -> ModelSpec:
    return ModelSpec.from_config({
        "name": "test_dsa", "num_layers": 1, "hidden_size": 64, "num_heads": heads, "q_lora_rank": None,
        "kv_lora_rank": KV_LORA, "qk_nope_head_dim": 128, "qk_rope_head_dim": ROPE, "v_head_dim": 128,
        "vocab_size": 32, "max_context": max_context, "dtype": "float32", "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "layer_pattern": ["sparse"], "weight_seed": 0,
        "index_n_heads": HI, "index_head_dim": DI, "index_topk": top_k,
    })


def make_backend(impl: str, top_k: int, page_size: int = 4):
    h = make_harness(page_size, num_pages=128, max_context=256)
    spec = dsa_spec(top_k)
    keys = IndexKeyPool([0], 128 * page_size, DI, torch.float32, h.device)
    ws = {"dsa_sparse_decode": torch.empty(0, dtype=torch.uint8), "dsa_indexer": torch.empty(0, dtype=torch.uint8)}
    if impl == "triton":
        from backends.kernels.sparse.indexer import indexer_scratch_bytes
        from backends.kernels.sparse.sparse_mla_decode import sparse_decode_scratch_bytes

        ws = {"dsa_sparse_decode": torch.empty(sparse_decode_scratch_bytes(8, spec.num_heads, KV_LORA, 4), dtype=torch.uint8),
              "dsa_indexer": torch.empty(indexer_scratch_bytes(8, 256, top_k), dtype=torch.uint8)}
    backend = DSABackend(h.req_to_token, h.kv, keys, None, spec, ws["dsa_sparse_decode"], ws["dsa_indexer"],
                         {"impl": impl, "max_splits": 4}, h.device)
    return h, spec, keys, backend


def indexer_oracle(q, w, keys: torch.Tensor, top_k: int) -> torch.Tensor:
    """float64 top-k positions of one query: q [Hi, Di], w [Hi], keys [L, Di] by position."""
    scores = (torch.relu(q.double() @ keys.double().T) * w.double()[:, None]).sum(0)
    return torch.topk(scores, min(top_k, keys.shape[0])).indices


def sparse_oracle(h, slots, q_nope, q_pe, positions, sm_scale) -> torch.Tensor:
    kv = h.kv.flat(0).double()[slots[positions]]
    s = (q_nope.double() @ kv[:, :KV_LORA].T + q_pe.double() @ kv[:, KV_LORA:].T) * sm_scale
    return torch.softmax(s, dim=-1) @ kv[:, :KV_LORA]


def _decode_case(impl: str, top_k: int, prefix_lens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    h, spec, keys, backend = make_backend(impl, top_k)
    batch, slots = random_batch(h, prefix_lens, [1] * len(prefix_lens), gen)
    for s in slots:
        keys.buffer(0)[s] = torch.randn(len(s), DI, generator=gen)
    q_nope, q_pe = random_q(batch, spec.num_heads, gen, h.device, torch.float32)
    iq = torch.randn(len(prefix_lens), HI, DI, generator=gen)
    iw = torch.rand(len(prefix_lens), HI, generator=gen)
    backend.init_forward_metadata(batch)
    out = backend.forward_sparse_decode(q_nope, q_pe, iq, iw, 0, batch)
    assert out.shape == (len(prefix_lens), spec.num_heads, KV_LORA) and not torch.isnan(out).any()
    return h, spec, keys, batch, slots, q_nope, q_pe, iq, iw, out


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter case; GPU runs cover triton"))])
def test_sparse_decode_equals_attention_over_the_indexer_selection(impl):
    top_k = 8
    h, spec, keys, batch, slots, q_nope, q_pe, iq, iw, out = _decode_case(impl, top_k, [0, 6, 15, 40], seed=1)
    for b, s in enumerate(slots):  # lengths 1, 7, 16 (a page boundary), 41
        chosen = indexer_oracle(iq[b], iw[b], keys.buffer(0)[s], top_k)
        ref = sparse_oracle(h, s, q_nope[b], q_pe[b], chosen, spec.sm_scale)
        assert rel_err(out[b], ref) < (1e-5 if impl == "torch" else 1e-4), b


def test_contexts_shorter_than_top_k_attend_to_everything():
    h, spec, keys, batch, slots, q_nope, q_pe, iq, iw, out = _decode_case("torch", 64, [0, 6, 15, 40], seed=2)
    ref = oracle_absorbed(h, batch, slots, q_nope, q_pe, spec.sm_scale)
    assert rel_err(out, ref) < 1e-5


def test_sparse_prefill_with_top_k_past_every_context_equals_the_dense_oracle():
    """Prefill is sparse (issue 48; tests/test_dsa_sparse_prefill.py); while every token's prefix fits in top-k it
    attends to everything, so it equals dense causal attention."""
    gen = torch.Generator().manual_seed(3)
    h, spec, keys, backend = make_backend("torch", 32)
    batch, slots = random_batch(h, [0, 5, 16], [7, 1, 9], gen)
    for s in slots:
        keys.buffer(0)[s] = torch.randn(len(s), DI, generator=gen)
    q_nope, q_pe = random_q(batch, spec.num_heads, gen, h.device, torch.float32)
    iq, iw = torch.randn(batch.num_tokens, HI, DI, generator=gen), torch.rand(batch.num_tokens, HI, generator=gen)
    backend.init_forward_metadata(batch)
    out = backend.forward_sparse_extend(q_nope, q_pe, iq, iw, 0, batch)
    assert rel_err(out, oracle_absorbed(h, batch, slots, q_nope, q_pe, spec.sm_scale)) < 1e-5
    with pytest.raises(RuntimeError, match="all sparse"):  # no dense extend for a sparse layer
        backend.forward_extend(q_nope, q_pe, 0, batch)


# --------------------------------------------------------------------------------------------- container
def test_coordinator_is_built_before_the_backend():
    rt = containers.build(compose_config("+deploy=cpu_dsa_hisparse"))
    order = rt.build_order
    assert order[:9] == ["tp_group", "device", "memory_plan", "req_to_token_pool", "page_allocator", "token_slots", "kv_pool",
                         "index_key_pool", "hisparse_coordinator"]
    assert order.index("hisparse_coordinator") < order.index("backend:dsa") < order.index("model")
    assert rt.container.backend().coordinator is rt.container.hisparse_coordinator()
    off = containers.build(compose_config("+deploy=cpu_dsa_hisparse", "hisparse=off"))
    assert "hisparse_coordinator" not in off.build_order and off.container.backend().coordinator is None


class RecordingCoordinator:
    """A coordinator the test hands to the container: it records every call and delegates to a real one."""

    BACKEND_API = {"begin_step", "new_token_slots", "store_new_tokens", "swap_in", "device_rows", "host_table",
                   "read_rows"}  # read_rows: the torch impl's sparse prefill reads each token's selection from the host
    ENGINE_API = {"open", "pages", "pages_needed", "reserve_many", "release", "page_size", "req_to_token_pool"}

    def __init__(self, real: HiSparseCoordinator):
        object.__setattr__(self, "real", real)
        object.__setattr__(self, "calls", [])

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.real, name)


def test_backend_uses_the_coordinator_it_was_given():
    cfg = compose_config("+deploy=cpu_dsa_hisparse", "check=off")
    container = containers.Container()
    container.config.from_dict(containers.to_plain(cfg))
    hs = containers.to_plain(cfg)["hisparse"]
    real = HiSparseCoordinator(container.req_to_token_pool(), container.token_slots(), hs["top_k"],
                               hs["device_buffer_size"], hs["host_to_device_ratio"], container.device(),
                               container.tp_group(), rows=container.hisparse_rows(),
                               layer_ids=container.model_spec().sparse_layers)
    fake = RecordingCoordinator(real)
    container.hisparse_coordinator.override(providers.Object(fake))
    rt = containers.build(cfg, container=container)
    assert rt.container.backend().coordinator is fake and "hisparse_coordinator" not in rt.build_order
    res = rt.engine.run()
    assert res.finished == len(res.outputs) and res.lost == 0
    assert set(fake.calls) <= RecordingCoordinator.BACKEND_API | RecordingCoordinator.ENGINE_API, set(fake.calls)
    decode_steps = sum(1 for s in res.steps if s.mode.value == "decode")
    assert fake.calls.count("swap_in") == decode_steps * len(rt.container.model_spec().sparse_layers) > 0
    assert fake.calls.count("read_rows") > 0  # sparse prefill (issue 48) reads its selections through it
    assert real.stats()["swap_ins"] > 0  # the fake's (delegated) buffer served every selection
    assert res.outputs == containers.build(compose_config("+deploy=cpu_dsa_hisparse", "check=off")).engine.run().outputs


# -------------------------------------------------------------------------------------------- validation
def _problems(*overrides, device=CPU):
    plain = containers.to_plain(compose_config(*overrides))
    return "\n".join(map(str, validate(plain, containers.BACKENDS, device, package_present=lambda name: True)))


def test_sparse_and_hisparse_configs_that_cannot_run_are_refused_with_every_reason():
    text = _problems("device=cpu", "model=tiny_dsa", "hisparse=dsa_tiny")  # backend torch_mla
    assert "not sparse-capable" in text and "sparse layers with backend 'torch_mla'" in text and "backend=dsa" in text
    text = _problems("device=cpu", "backend=dsa")  # model tiny_mla: no indexer
    assert "index_n_heads=0" in text and "model=tiny_dsa" in text
    text = _problems("+deploy=cpu_dsa_hisparse", "hisparse.device_buffer_size=4", "hisparse.top_k=6",
                     "hisparse.host_to_device_ratio=0.5", "backend.impl=cuda_magic")
    for fragment in ("device_buffer_size", "equal to model.index_topk", "host_to_device_ratio", "backend.impl"):
        assert fragment in text, (fragment, text)
    assert text.count("Fix:") == 4
    text = _problems("+deploy=cpu_dsa_hisparse", "model.layer_pattern=[full,sparse]")
    assert "every attention layer sparse" in text
    text = _problems("+deploy=cpu_dsa_hisparse", "model.index_n_heads=0", "model.index_head_dim=32")
    assert "without an indexer" in text and "index_n_heads >= 1" in text and "model.index_head_dim" in text
    gpu = ("+deploy=cpu_dsa_hisparse", "device=cuda", "graph=decode", "model.dtype=bfloat16")
    assert "impl=torch" in _problems(*gpu, "backend.impl=torch", device=GPU)
    assert _problems(*gpu, device=GPU) == ""
    assert _problems("+deploy=h100_dsa_hisparse", device=GPU) == ""


# ---------------------------------------------------------------------------------------------------- CLI
def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", *args, f"hydra.run.dir={tmp_path}/run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args", [["+deploy=cpu_dsa_hisparse"],
                                  ["device=cpu", "model=tiny_dsa", "backend=dsa", "hisparse=dsa_tiny"]])
def test_cli_sparse_model_with_hisparse_runs_with_parity(args, tmp_path):
    p = cli(tmp_path, *args)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert rep["parity"]["ok"] is True and rep["parity"]["reference"] == "dsa/float32"
    assert rep["requests"]["finished"] == rep["requests"]["total"] and rep["requests"]["lost"] == 0
    order = rep["build_order"]
    assert order.index("hisparse_coordinator") < order.index("backend:dsa")
    hs = rep["hisparse"]
    assert hs["swap_ins"] > 0 and 0 < hs["hit_rate"] < 1 and hs["bytes_copied_per_decode_step"] > 0
    assert hs["host_kv_bytes"] > 0 and hs["device_kv_bytes"] == hs["device_pool_bytes"] + hs["device_buffer_bytes"]
    assert "hisparse" in p.stdout and "swap-ins" in p.stdout


def test_cli_refuses_a_buffer_smaller_than_top_k(tmp_path):
    p = cli(tmp_path, "+deploy=cpu_dsa_hisparse", "hisparse.device_buffer_size=4")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "device_buffer_size" in p.stderr and "Fix: set hisparse.device_buffer_size=16" in p.stderr


def test_the_triton_indexer_scratch_holds_a_prefill_tile():
    """The indexer's scratch is the decode batch's or ``backend.indexer_prefill_mib``, whichever is larger: sized
    for a decode batch alone, a long prompt was scored a few tokens per kernel call (32k tokens: 8192 calls)."""
    from backends.dsa import indexer_workspace_spec
    from backends.kernels.sparse.indexer import indexer_scratch_bytes
    from backends.kernels.sparse.indexer_extend import extend_tile_tokens

    spec = dsa_spec(8, max_context=131072)
    kv, graph, off = {"max_requests": 4}, {"enabled": True, "batch_sizes": [1, 2]}, {"enabled": False, "num_steps": 3}
    cpu = torch.device("cpu")
    nbytes = indexer_workspace_spec(spec, {"impl": "triton", "indexer_prefill_mib": 256}, kv, graph, off, cpu).nbytes
    assert nbytes == 256 << 20 > indexer_scratch_bytes(4, 131072, 8)
    assert extend_tile_tokens(nbytes, 131072, 8) >= 256
    small = indexer_workspace_spec(spec, {"impl": "triton", "indexer_prefill_mib": 0}, kv, graph, off, cpu).nbytes
    assert small == indexer_scratch_bytes(4, 131072, 8)
    # with speculation the decode kernels score num_steps + 1 tokens per request (verify, draft extend)
    spec_on = {"enabled": True, "num_steps": 3}
    verify = indexer_workspace_spec(spec, {"impl": "triton", "indexer_prefill_mib": 0}, kv, graph, spec_on, cpu).nbytes
    assert verify == indexer_scratch_bytes(16, 131072, 8)
    assert indexer_workspace_spec(spec, {"impl": "torch", "indexer_prefill_mib": 256}, kv, graph, off, cpu).nbytes == 0
    problems = DSABackend.config_problems({"impl": "auto", "max_splits": 16, "indexer_prefill_mib": -1},
                                          {"name": "x", "index_n_heads": 4, "layer_pattern": ["sparse"]},
                                          DeviceInfo("cpu", "cpu", 0, False, None, "cpu"))
    assert [p.what for p in problems] == ["backend.indexer_prefill_mib"]
