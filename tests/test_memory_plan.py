"""The memory plan (docs/memory.md): kv.num_pages=auto from a fake device memory reader injected through the
container, the smallest count over tensor-parallel ranks, refusals that list every over-budget line, the CPU's
host-memory check, the parity reference planned on its own, and an out-of-memory step retracted mid-run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_config
from dependency_injector import providers

import containers
from runtime.app.memory_checks import memory_problems, plan_memory
from runtime.app.memory_estimate import weight_bytes, workspace_inputs
from runtime.core.device import DeviceInfo
from runtime.core.errors import ConfigError
from runtime.core.memory_plan import CPU_NUM_PAGES, FixedMemory, GiB, agree_pages
from runtime.core.model_spec import ModelSpec
from runtime.core.parallel import SingleRank
from runtime.engine.oom import OOMGuard, OutOfMemoryStop

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
H100 = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "fake H100", 132)  # only the plan sees it: nothing runs on it


class FakeGroup:
    """A tensor-parallel group of ``size`` ranks whose other ranks report ``others`` (gather_objects)."""

    def __init__(self, others: list, rank: int = 0):
        self.rank, self.size, self.others = rank, 1 + len(others), list(others)

    def gather_objects(self, obj) -> list:
        return [obj, *self.others]


def _plan(*overrides: str, reader: FixedMemory, info: DeviceInfo = H100):
    """The container's memory_budget with the reader and the device injected (nothing else is built)."""
    c = containers.Container()
    c.memory_reader.override(providers.Object(reader))
    c.device_info.override(providers.Object(info))
    c.config.from_dict(containers.to_plain(compose_config(*overrides)))
    return c.memory_budget(), c.config()


def test_auto_fills_the_fraction_of_what_the_fixed_lines_leave():
    reader = FixedMemory(80 * GiB, 70 * GiB)
    plan, plain = _plan("check=off", reader=reader)
    fixed, per_page = plan.on_device()
    assert plan.auto and plan.num_pages == int(0.9 * (70 * GiB - fixed)) // per_page
    kv = plan.num_pages * per_page
    assert 0.9 * (70 * GiB - fixed) - per_page < kv <= 0.9 * (70 * GiB - fixed)
    assert plan.tokens == (plan.num_pages - 1) * 16 and not memory_problems(plan, plain)
    half, _ = _plan("check=off", "memory.fraction=0.45", reader=reader)
    assert abs(half.num_pages - plan.num_pages / 2) <= 1


def test_hisparse_auto_pages_also_fit_the_pinned_host_pool():
    reader = FixedMemory(80 * GiB, 70 * GiB, host_total=2 * GiB, host_free=1 * GiB)
    plan, plain = _plan("+deploy=cpu_dsa_hisparse", "kv.num_pages=auto", "check=off", reader=reader)
    host_per_page = plan.page_bytes(True)
    assert host_per_page and plan.num_pages < plan.pages_that_fit(plan.fraction)  # the host pool is the limit
    assert plan.num_pages * host_per_page <= 0.9 * GiB < (plan.num_pages + 1) * host_per_page + plan.fixed_bytes(True)
    assert not memory_problems(plan, plain)


def test_explicit_pages_win_and_the_cpu_keeps_its_fixed_default():
    reader = FixedMemory(80 * GiB, 70 * GiB)
    assert _plan("check=off", "kv.num_pages=300", reader=reader)[0].num_pages == 300
    cpu = DeviceInfo("cpu", "cpu", 0, False, None, "cpu")
    plan, _ = _plan("check=off", reader=reader, info=cpu)
    assert plan.auto and plan.num_pages == CPU_NUM_PAGES


def test_every_paged_line_and_the_engine_pools_agree():
    """The plan's per-page bytes (meta-device pools) are the bytes the built pools hold."""
    for over in (("+deploy=cpu_dsa_hisparse",), ("+deploy=cpu_speculative",), ("model=ring_hybrid_tiny",),
                 ("+deploy=cpu_dsa_hisparse", "hisparse=off", "speculative=eagle_chain")):  # the draft's indexer keys
        rt = containers.build(compose_config(*over, "check=off", "kv.num_pages=77"))
        plan, c = rt.container.memory_budget(), rt.container
        built = c.index_key_pool().nbytes if c.index_key_pool() is not None else 0
        if rt.config["speculative"]["enabled"]:
            built += c.draft_kv_pool().nbytes + (c.draft_index_key_pool().nbytes if c.draft_index_key_pool() else 0)
        built += c.kv_pool().nbytes
        built += c.req_to_token_pool().nbytes + sum(p.nbytes for p in c.request_states())
        planned = {x.name: x.nbytes for x in plan.fixed}
        per_page = sum(x.nbytes for x in plan.paged if not x.host)
        pools = per_page * 77 + sum(planned.get(k, 0) for k in ("request table", "linear-attention states"))
        assert pools == built if c.hisparse_coordinator() is None else 0 <= pools - built <= 4 * per_page, over
        hs = c.hisparse_coordinator()
        if hs is not None:
            assert planned["hisparse device buffers"] == hs.device_bytes
            host = sum(x.nbytes for x in plan.paged if x.host) * 77
            assert abs(host - hs.host_pool.numel() * hs.host_pool.element_size()) <= hs.host_pool[0, 0].nbytes * 2 * 8


BLACKWELL_ON_CPU = ("backend.kernel=emulate", "model.dtype=bfloat16", "speculative=eagle_chain")


@pytest.mark.parametrize("over", [
    ("backend=triton_mla", "speculative=eagle_chain"), ("model=tiny_dsa", "backend=dsa", "backend.impl=triton"),
    ("backend=trtllm_mla", "kv.page_size=32", "backend.workspace_bytes=65536", *BLACKWELL_ON_CPU),
    ("backend=tokenspeed_mla", "kv.page_size=16", *BLACKWELL_ON_CPU)])
def test_the_workspace_lines_are_what_the_ledger_holds(over):
    """One source: the plan's workspace lines and what the container acquires both come from the backend class's
    ``workspace_specs`` (the draft steps' own workspaces included)."""
    rt = containers.build(compose_config(*over, "device=cpu", "check=off", "kv.num_pages=64"))
    planned = {x.name.removeprefix("workspace: "): x.nbytes for x in rt.container.memory_budget().fixed
               if x.name.startswith("workspace: ") and x.nbytes}
    assert planned and planned == {k: n for k, n in rt.container.workspace_ledger().report().items() if n}


@pytest.mark.parametrize("over", [("backend=torch_mla",), ("backend=triton_mla",), ("backend=flashinfer_mla",),
                                  ("backend=trtllm_mla",), ("backend=tokenspeed_mla",),
                                  ("backend=dsa", "model=tiny_dsa", "backend.impl=triton"),
                                  ("backend=dsv4", "model=deepseek_v4_flash", "backend.impl=triton", "parallel.tp=2"),
                                  ("backend=dsv4", "model=deepseek_v4_flash", "backend.impl=flashinfer")])
def test_workspace_specs_are_the_ones_the_capabilities_name(over):
    plain = containers.to_plain(compose_config(*over, "speculative=eagle_chain"))
    cls = containers.BACKENDS[plain["backend"]["name"]]
    spec = ModelSpec.from_config(plain["model"]).for_rank(plain["parallel"]["tp"])
    specs = cls.workspace_specs(workspace_inputs(plain, spec, H100))
    assert {name.split(":")[0] for name in specs} <= cls.capabilities.workspaces
    assert all(name == s.name for name, s in specs.items())


@pytest.mark.parametrize("over", [(), ("model.weights=fp8",), ("model=tiny_dsa", "backend=dsa"),
                                  ("model=ring_hybrid_tiny",), ("model.dtype=bfloat16",)])
def test_weight_estimate_is_what_the_model_holds(over):
    rt = containers.build(compose_config(*over, "check=off", "device=cpu"))
    assert weight_bytes(rt.config["model"], 1, "tp") == rt.container.model().weights.bytes_by_dtype()


def test_tensor_parallel_ranks_take_the_smallest_count():
    assert agree_pages(500, FakeGroup([300, 700])) == 300
    assert agree_pages(500, SingleRank(torch.device("cpu"))) == 500
    plain = containers.to_plain(compose_config("check=off"))
    mine = plan_memory(plain, containers.BACKENDS, H100, FixedMemory(80 * GiB, 70 * GiB), SingleRank(torch.device("cpu")))
    low = plan_memory(plain, containers.BACKENDS, H100, FixedMemory(80 * GiB, 70 * GiB), FakeGroup([1000]))
    assert mine.num_pages > 1000 and low.num_pages == 1000


def test_a_peak_over_the_device_is_refused_listing_every_line_before_allocating():
    """deepseek_v3_tp8's 3.3 GB of weights and a pool of 100000 pages on a 4 GiB device: one refusal that lists the
    peak and every line over 1% of it (the weights, the pool), each with its fix."""
    c = containers.Container()
    c.memory_reader.override(providers.Object(FixedMemory(4 * GiB, 3 * GiB, host_total=4 * GiB, host_free=3 * GiB)))
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config("model=deepseek_v3_tp8", "device=cpu", "kv.num_pages=100000",
                                        "model.max_context=4096"), c)
    msg = str(e.value)
    assert "predicted peak" in msg and "3.00 GiB free" in msg
    assert "'weights: bfloat16'" in msg and "model.num_layers=" in msg and "parallel.tp=2" in msg
    assert "'kv pool'" in msg and "kv.num_pages=" in msg
    assert c.build_log().names == ["tp_group", "device", "memory_plan"]  # nothing else was built


def test_auto_that_leaves_too_few_pages_is_refused():
    plan, plain = _plan("model=deepseek_v3_tp8", "check=off", reader=FixedMemory(4 * GiB, 3 * GiB))
    problems = memory_problems(plan, plain)
    assert plan.num_pages == 0 and problems[0].what == "kv pool (memory plan)"
    assert any("'weights: bfloat16'" in p.what for p in problems)


def test_oversized_pool_on_the_cpu_is_refused_cleanly(tmp_path):
    run = subprocess.run([sys.executable, "-m", "runtime", "kv.num_pages=100000000", f"hydra.run.dir={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "configuration refused" in run.stderr and "memory plan line 'kv pool'" in run.stderr
    assert "kv.num_pages=" in run.stderr


def test_reference_that_cannot_fit_is_skipped_with_the_reason():
    """A bf16 model whose float32 reference needs twice the weights: planned on its own, and skipped here."""
    reader = FixedMemory(12 * GiB, 11 * GiB)
    plan, plain = _plan("+deploy=h100_dsv3_tp8", "model.max_context=4096", reader=reader)
    assert not memory_problems(plan, plain)  # the candidate fits
    assert plan.reference is not None and plan.reference.peak_bytes() > plan.peak_bytes()
    assert "check=off" in plan.reference_skip
    roomy, _ = _plan("+deploy=h100_dsv3_tp8", "model.max_context=4096", reader=FixedMemory(80 * GiB, 78 * GiB))
    assert roomy.reference is not None and not roomy.reference_skip


# ------------------------------------------------------------------------------------------ out of memory
class FlakyModel:
    """The real model, whose forward raises a CUDA out-of-memory error on the calls in ``fail_at`` (1-based)."""

    def __init__(self, model, fail_at: set[int]):
        self._model, self._fail_at, self.calls = model, set(fail_at), 0

    def forward(self, ids, batch):
        self.calls += 1
        if self.calls in self._fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self._model.forward(ids, batch)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.mark.parametrize("over", [("workload=smoke",), ("+deploy=cpu_small_pool",), ("+deploy=cpu_speculative",)])
def test_an_out_of_memory_step_is_retracted_and_nothing_is_lost(over):
    clean = containers.build(compose_config(*over, "check=off")).engine.run()
    c = containers.Container()
    c.model.override(providers.Singleton(FlakyModel, c.mla_model, {3, 4, 9}))
    res = containers.build(compose_config(*over, "check=off"), c).engine.run()
    assert len(res.oom_events) == 3 and res.lost == 0 and res.finished == len(clean.outputs)
    assert res.retracted >= clean.retracted + 3
    assert res.outputs == clean.outputs  # float32 torch reference: re-prefilled requests continue the same tokens
    running = compose_config(*over).workload.max_running_requests
    assert res.oom_events[0].plan.startswith("memory plan on cpu")
    assert res.oom_events[-1].limits["max_running_requests"] == max(1, running // 8)  # halved three times


def test_the_guard_stops_where_retracting_cannot_help():
    plan = SimpleNamespace(summary=lambda: "memory plan on x")
    batch = SimpleNamespace(mode=SimpleNamespace(value="decode"), batch_size=1, num_tokens=1)
    limits = {"max_running_requests": 4, "max_tokens_per_batch": 8, "chunked_prefill_size": 8}
    reader = FixedMemory(1, 1)
    with pytest.raises(OutOfMemoryStop, match="one request of one token"):
        OOMGuard(plan, SingleRank(torch.device("cpu")), reader, torch.device("cpu")).handle(
            RuntimeError("oom"), 3, batch, limits, 1)
    batch.batch_size = 4
    with pytest.raises(OutOfMemoryStop, match="Tensor parallelism"):
        OOMGuard(plan, FakeGroup([0]), reader, torch.device("cpu")).handle(RuntimeError("oom"), 3, batch, limits, 4)
    ev = OOMGuard(plan, SingleRank(torch.device("cpu")), reader, torch.device("cpu")).handle(
        RuntimeError("oom"), 3, batch, limits, 4)
    assert limits == {"max_running_requests": 2, "max_tokens_per_batch": 4, "chunked_prefill_size": 4} == ev.limits


def test_the_graph_line_counts_prefill_graphs_where_the_backend_takes_them():
    """The CUDA graph pool: the largest graphed prefill step (or the decode one) plus every prefill graph's output,
    only for a backend whose capabilities graph EXTEND (triton_mla), never with graph.prefill_tokens=[]."""
    def graph_line(*overrides):
        plain = containers.to_plain(compose_config("check=off", "device=cuda", "graph=decode", "model.dtype=bfloat16",
                                                   "model=deepseek_v3_tp8", "model.num_layers=4", *overrides))
        plan = plan_memory(plain, containers.BACKENDS, H100, FixedMemory(80 * GiB, 70 * GiB),
                           SingleRank(torch.device("cpu")))
        (line,) = [ln for ln in plan.fixed if ln.name.startswith("cuda graphs")]
        return line.nbytes, line.fix

    triton, fix = graph_line("backend=triton_mla")
    off, _ = graph_line("backend=triton_mla", "graph.prefill_tokens=[]")
    other, _ = graph_line("backend=flashinfer_mla")
    outputs = 2 * (256 + 512 + 1024 + 1536 + 2048 + 3072 + 4096) * 7168 * 2  # two copies of bf16 hidden states
    assert off == other and triton >= off + outputs and "graph.prefill_tokens" in fix
