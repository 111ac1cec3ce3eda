"""The container: what it builds, in which order, what it skips, and how tests swap collaborators."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from conftest import compose_config
from dependency_injector import providers

import containers
from backends.base import AttentionBackend, BackendCapabilities, no_workspaces
from runtime.app.validation import validate
from runtime.core.batch import ForwardMode
from runtime.core.device import DeviceInfo
from runtime.core.errors import ConfigError

CPU = DeviceInfo("cpu", "cpu", 0, False, None, "cpu")


def test_selector_and_validation_registry_agree():
    assert set(containers.Container.backend.providers) == set(containers.BACKENDS)


def test_build_order_reads_top_to_bottom():
    rt = containers.build(compose_config("device=cpu"))
    assert rt.build_order == [
        "tp_group", "device", "memory_plan", "req_to_token_pool", "page_allocator", "token_slots", "kv_pool",
        "workspace_ledger", "collectives", "backend:torch_mla", "weights:random", "model", "graph_runner", "workload",
        "engine",
    ]


def test_unconsumed_workspaces_cost_zero_bytes():
    rt = containers.build(compose_config("device=cpu"))
    report = rt.container.workspace_ledger().report()
    assert report == {"flashinfer_float": 0, "triton_split_kv": 0, "dsa_sparse_decode": 0, "dsa_indexer": 0,
                      "dsv4_decode_splits": 0, "allreduce_ipc": 0, "gemm_counters": 0}  # the fused ops': CUDA only
    assert rt.container.workspace_ledger().total_bytes == 0


@pytest.mark.parametrize("overrides", [
    ["device=cpu"],
    ["device=cpu", "workspace=skip"],
    ["device=cpu", "workload=chat", "model.max_context=2304", "kv.num_pages=160"],
    ["device=cpu", "backend.compute_dtype=float64", "model.dtype=float64"],
    ["device=cpu", "model.q_lora_rank=96"],
    ["+deploy=cpu_small_pool"],
    ["+deploy=cpu_long_prefix"],
])
def test_cpu_combinations_build(overrides):
    rt = containers.build(compose_config(*overrides))
    assert rt.build_order[-1] == "engine"


class RecordingBackend:
    """A fake that answers only the AttentionBackend protocol and records every attribute the runtime asks for."""

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        forward_modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE}), devices=frozenset({"cpu"}))
    PROTOCOL = {"init_forward_metadata", "forward_decode", "forward_extend", "capabilities"}

    @classmethod
    def config_problems(cls, backend_cfg, model_cfg, device):
        return []

    workspace_specs = classmethod(no_workspaces)

    def __init__(self):
        object.__setattr__(self, "calls", [])

    def __getattribute__(self, name):
        if not name.startswith("__") and name not in ("calls", "PROTOCOL"):
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)

    def init_forward_metadata(self, batch):
        self.last_mode = batch.mode

    def forward_decode(self, q_nope, q_pe, layer_id, batch):
        return torch.zeros_like(q_nope)

    def forward_extend(self, q_nope, q_pe, layer_id, batch):
        return torch.zeros_like(q_nope)


def test_engine_talks_to_the_backend_through_the_protocol_only():
    fake = RecordingBackend()
    assert isinstance(fake, AttentionBackend)  # the structural check itself reads every protocol member
    fake.calls.clear()
    container = containers.Container()
    container.backend.override(providers.Object(fake))
    rt = containers.build(compose_config("device=cpu"), container=container)
    res = rt.engine.run()
    assert res.finished == len(res.outputs) and res.lost == 0
    asked = set(fake.calls) - {"last_mode"}
    assert asked <= RecordingBackend.PROTOCOL, asked - RecordingBackend.PROTOCOL
    assert {"init_forward_metadata", "forward_decode", "forward_extend"} <= asked
    assert rt.container.mha_prefill() is None  # capabilities say no MHA prefill: the absorbed path ran


def _problems(*overrides, device=CPU):
    plain = containers.to_plain(compose_config(*overrides))
    return validate(plain, containers.BACKENDS, device, package_present=lambda name: False)


def test_validation_reports_every_problem_at_once():
    problems = _problems("backend=triton_mla", "hisparse=dsa_2048", "hisparse.device_buffer_size=16",
                         "workload.prompt_len.min=-3", "workload.num_requests=0", "speculative.enabled=true")
    text = "\n".join(map(str, problems))
    # Without CUDA the suite runs Triton in its CPU interpreter (conftest), where triton_mla declares the CPU.
    on_cpu = "cpu" in containers.BACKENDS["triton_mla"].capabilities.devices
    assert len(problems) >= (5 if on_cpu else 6), text
    for fragment in ("not sparse-capable", *(() if on_cpu else ("device cpu",)), "triton", "device_buffer_size",
                     "workload.prompt_len", "workload.num_requests", "speculative"):
        assert fragment in text, fragment


def test_build_raises_one_error_before_allocating(monkeypatch):
    allocated = []
    monkeypatch.setattr(containers.MLAKVPool, "__init__", lambda *a, **k: allocated.append(1))
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config("hisparse=dsa_2048", "device=cpu", "kv.num_pages=2"))
    assert len(e.value.problems) >= 2 and not allocated
    assert "Fix:" in str(e.value)


def test_unknown_backend_name_lists_valid_ones():
    plain = containers.to_plain(compose_config("device=cpu"))
    plain["backend"]["name"] = "magic_mla"
    (p,) = [p for p in validate(plain, containers.BACKENDS, CPU) if p.what == "backend"]
    assert "torch_mla" in p.expected and "triton_mla" in p.expected


def test_workspace_skip_refuses_a_backend_that_needs_the_shared_buffer():
    class NeedsShared(RecordingBackend):
        capabilities = BackendCapabilities(
            forward_modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE}), devices=frozenset({"cpu"}),
            workspaces=frozenset({"flashinfer_float"}))

    plain = containers.to_plain(compose_config("device=cpu", "workspace=skip"))
    problems = validate(plain, {"torch_mla": NeedsShared}, CPU)
    assert any("workspace.skip" in p.what for p in problems)
    plain["workspace"]["skip"] = False
    assert validate(plain, {"torch_mla": NeedsShared}, CPU) == []


def test_gpu_too_old_and_missing_package():
    plain = containers.to_plain(compose_config("device=cuda", "backend=triton_mla", "model.dtype=bfloat16"))
    old = DeviceInfo("cuda", "cuda", 0, True, (7, 0), "Tesla V100")
    text = "\n".join(str(p) for p in validate(plain, containers.BACKENDS, old, package_present=lambda n: False))
    assert "compute capability >= 8.0" in text and "'triton'" in text


def test_pool_too_small_for_one_request():
    text = "\n".join(map(str, _problems("kv.num_pages=2", "kv.page_size=4")))
    assert "room for one request" in text and "kv.num_pages=" in text


def test_prompt_longer_than_context():
    text = "\n".join(map(str, _problems("workload.prompt_len.max=5000")))
    assert "max_context" in text


def test_fa3_on_a_pre_hopper_gpu_is_refused_before_allocation():
    plain = containers.to_plain(compose_config("device=cuda", "backend=flashinfer_mla", "backend.kernel=fa3",
                                               "model=deepseek_v3_tp8"))
    a100 = DeviceInfo("cuda", "cuda", 0, True, (8, 0), "A100")
    text = "\n".join(map(str, validate(plain, containers.BACKENDS, a100, package_present=lambda n: True)))
    assert "kernel=fa3" in text and "compute capability 9.x" in text and "backend.kernel=auto" in text
    h100 = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "H100")
    assert validate(plain, containers.BACKENDS, h100, package_present=lambda n: True) == []


def test_flashinfer_needs_the_shared_workspace():
    plain = containers.to_plain(compose_config("device=cuda", "backend=flashinfer_mla", "workspace=skip",
                                               "model=deepseek_v3_tp8"))
    h100 = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "H100")
    text = "\n".join(map(str, validate(plain, containers.BACKENDS, h100, package_present=lambda n: True)))
    assert "workspace.skip=true" in text and "shared FlashInfer workspace" in text


@pytest.mark.parametrize("rows", [-1, 17])
def test_gemv_rows_out_of_range_is_refused_with_its_fix(rows):
    (p,) = [p for p in _problems(f"model.gemv_rows={rows}") if p.what == "model.gemv_rows"]
    assert p.got == str(rows) and "0 .. 16" in p.expected and p.fix == "model.gemv_rows=16"
