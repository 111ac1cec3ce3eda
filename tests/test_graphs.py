"""Which forward modes get CUDA graphs is decided from capabilities (data), never from backend classes."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from conftest import compose_config

import containers
from backends.base import BackendCapabilities, CudaGraphLevel
from runtime.batch import ForwardMode
from runtime.device import DeviceInfo
from runtime.graph_runner import decide_decode_graphs
from runtime.validation import validate

CUDA = torch.device("cuda", 0)
GPU = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "H100")


def fake(level: CudaGraphLevel, with_hooks: bool = True):
    class Fake:
        capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
            forward_modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE}),
            cuda_graph=((ForwardMode.DECODE, level),), devices=frozenset({"cuda", "cpu"}))

        @classmethod
        def config_problems(cls, backend_cfg, model_cfg, device):
            return []

    if with_hooks:
        Fake.init_graph_state = lambda self, batch: None
        Fake.init_forward_metadata_capture = lambda self, batch: None
        Fake.init_forward_metadata_replay = lambda self, batch: None
    return Fake


@pytest.mark.parametrize("level,enabled,device,graphed", [
    (CudaGraphLevel.NEVER, True, CUDA, False),
    (CudaGraphLevel.SINGLE_TOKEN_DECODE, True, CUDA, True),
    (CudaGraphLevel.UNIFORM_BATCH, True, CUDA, True),
    (CudaGraphLevel.ALWAYS, True, CUDA, True),
    (CudaGraphLevel.ALWAYS, False, CUDA, False),
    (CudaGraphLevel.ALWAYS, True, torch.device("cpu"), False),
])
def test_decode_graph_decision_from_capabilities(level, enabled, device, graphed):
    backend = fake(level)()
    hook = containers._decode_graph_hook(backend)
    d = decide_decode_graphs(enabled, device, [backend], hook, [4, 1, 2, 4])
    assert d.graphed is graphed
    assert (d.sizes == [1, 2, 4]) if graphed else (d.reason and not d.sizes)
    if level == CudaGraphLevel.NEVER and enabled and device.type == "cuda":
        assert "NEVER" in d.reason and hook is None


def test_the_minimum_level_over_every_backend_in_use_decides():
    full, linear = fake(CudaGraphLevel.ALWAYS)(), fake(CudaGraphLevel.NEVER)()
    d = decide_decode_graphs(True, CUDA, [full, linear], containers._decode_graph_hook(full), [8])
    assert not d.graphed and "NEVER" in d.reason and "ALWAYS" in d.reason
    both = [full, fake(CudaGraphLevel.SINGLE_TOKEN_DECODE)()]
    assert decide_decode_graphs(True, CUDA, both, containers._decode_graph_hook(full), [8]).graphed


def test_graphable_backend_without_hooks_is_refused_at_startup():
    plain = containers.to_plain(compose_config("device=cuda", "graph=decode", "model.dtype=bfloat16"))
    problems = validate(plain, {"torch_mla": fake(CudaGraphLevel.SINGLE_TOKEN_DECODE, with_hooks=False)}, GPU)
    text = "\n".join(map(str, problems))
    assert "DecodeGraph" in text and "init_forward_metadata_replay" in text
    assert validate(plain, {"torch_mla": fake(CudaGraphLevel.SINGLE_TOKEN_DECODE)}, GPU) == []


def test_graphs_on_cpu_are_refused():
    plain = containers.to_plain(compose_config("device=cpu", "graph=decode"))
    assert any("graph.enabled" in p.what for p in validate(plain, containers.BACKENDS, DeviceInfo(
        "cpu", "cpu", 0, False, None, "cpu")))


def test_report_says_why_decode_was_not_graphed():
    rt = containers.build(compose_config("device=cpu"))
    d = rt.container.graph_runner().decision
    assert not d.graphed and d.reason == "graph.enabled=false"
