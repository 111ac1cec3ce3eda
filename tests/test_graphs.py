"""Which forward modes get CUDA graphs is decided from capabilities (data), never from backend classes."""

from __future__ import annotations

from typing import ClassVar

import pytest
from conftest import compose_config
from dependency_injector import providers

import containers
from backends.base import BackendCapabilities, CudaGraphLevel, decode_graph_hook
from runtime.app.validation import validate
from runtime.core.batch import ForwardMode
from runtime.core.device import DeviceInfo
from runtime.engine.graph_runner import decide_graphs

GPU = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "H100")


def fake(level: CudaGraphLevel | dict, with_hooks: bool = True, builds_own: bool = True):
    """A backend class whose only content is capability data (a level for DECODE, or a level per mode)."""
    levels = level if isinstance(level, dict) else {ForwardMode.DECODE: level}

    class Fake:
        capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
            forward_modes=frozenset(ForwardMode), cuda_graph=tuple(levels.items()),
            builds_own_kv_indices=builds_own, devices=frozenset({"cuda", "cpu"}))

        @classmethod
        def config_problems(cls, backend_cfg, model_cfg, device):
            return []

    if with_hooks:
        Fake.init_graph_state = lambda self, batch: None
        Fake.init_forward_metadata_capture = lambda self, batch: None
        Fake.init_forward_metadata_replay = lambda self, batch: None
    return Fake


@pytest.mark.parametrize("level,enabled,device,graphed", [
    (CudaGraphLevel.NEVER, True, "cuda", False),
    (CudaGraphLevel.SINGLE_TOKEN_DECODE, True, "cuda", True),
    (CudaGraphLevel.UNIFORM_BATCH, True, "cuda", True),
    (CudaGraphLevel.ALWAYS, True, "cuda", True),
    (CudaGraphLevel.ALWAYS, False, "cuda", False),
    (CudaGraphLevel.ALWAYS, True, "cpu", False),
])
def test_decode_graph_decision_from_capabilities(level, enabled, device, graphed):
    backend = fake(level)()
    d = decide_graphs(enabled, device, [backend], False, [4, 1, 2, 4])
    assert list(d) == ["prefill", "decode"]
    d = d["decode"]
    assert d.graphed is graphed
    assert (d.sizes == [1, 2, 4]) if graphed else (d.reason and not d.sizes)
    if level == CudaGraphLevel.NEVER and enabled and device == "cuda":
        assert "NEVER" in d.reason and decode_graph_hook(backend) is None


def test_the_minimum_level_over_every_backend_in_use_decides():
    full, linear = fake(CudaGraphLevel.ALWAYS)(), fake(CudaGraphLevel.NEVER)()
    d = decide_graphs(True, "cuda", [full, linear], False, [8])["decode"]
    assert not d.graphed and "NEVER" in d.reason and "ALWAYS" in d.reason
    both = [full, fake(CudaGraphLevel.SINGLE_TOKEN_DECODE)()]
    assert decide_graphs(True, "cuda", both, False, [8])["decode"].graphed


def test_prefill_graph_decision_from_capabilities():
    """Prefill is graphed over padded token counts when every backend in use gives EXTEND the level ALWAYS (only
    triton_mla ships that), never with speculation (its modes are the round's), never with no counts listed."""
    graphs = fake({ForwardMode.DECODE: CudaGraphLevel.SINGLE_TOKEN_DECODE, ForwardMode.EXTEND: CudaGraphLevel.ALWAYS})
    d = decide_graphs(True, "cuda", [graphs()], False, [8], [1024, 256, 256])["prefill"]
    assert d.graphed and d.sizes == [256, 1024]
    d = decide_graphs(True, "cuda", [graphs()], False, [8], [])["prefill"]
    assert not d.graphed and d.reason == "graph.prefill_tokens=[]"
    assert decide_graphs(True, "cuda", [graphs()], False, [8], [256])["decode"].graphed
    d = decide_graphs(True, "cuda", [graphs(), fake(CudaGraphLevel.SINGLE_TOKEN_DECODE)()], False, [8], [256])
    assert d["decode"].graphed and not d["prefill"].graphed and "needs ALWAYS" in d["prefill"].reason
    assert "prefill" not in decide_graphs(True, "cuda", [graphs()], True, [8], [256])
    extend = {name for name, cls in containers.BACKENDS.items()
              if cls.capabilities.graph_level(ForwardMode.EXTEND) >= CudaGraphLevel.ALWAYS}
    assert extend == {"triton_mla"}


def test_prefill_graph_config_problems():
    def problems(*overrides):
        plain = containers.to_plain(compose_config("device=cuda", "graph=decode", "model.dtype=bfloat16", *overrides))
        return "\n".join(map(str, validate(plain, {"torch_mla": fake(CudaGraphLevel.SINGLE_TOKEN_DECODE)}, GPU)))

    assert problems() == ""
    text = problems("graph.prefill_tokens=[0,512]", "graph.prefill_requests=1")
    assert "graph.prefill_tokens" in text and "token counts >= 1" in text
    assert "graph.prefill_requests" in text and "graph.prefill_requests=8" in text
    assert problems("graph.prefill_tokens=[]", "graph.prefill_requests=1") == ""  # no prefill graphs: unused


A, U, S, N = CudaGraphLevel.ALWAYS, CudaGraphLevel.UNIFORM_BATCH, CudaGraphLevel.SINGLE_TOKEN_DECODE, CudaGraphLevel.NEVER
D, V, E = ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND


@pytest.mark.parametrize("target,draft,graphed", [
    # every mode allowed by both
    ({D: A, V: A, E: A}, {D: A, V: A, E: A}, {"draft_decode", "target_verify", "draft_extend"}),
    # what the shipped GPU backends declare
    ({D: S, V: U, E: U}, {D: S, V: U, E: U}, {"draft_decode", "target_verify", "draft_extend"}),
    # decode-only backends: the round's draft steps are graphed, verify and draft extend run eagerly
    ({D: S}, {D: S}, {"draft_decode"}),
    # verify needs uniform batches: single-token decode is not enough
    ({D: S, V: S, E: U}, {D: S, V: S, E: U}, {"draft_decode", "draft_extend"}),
    # the minimum over draft + target: one backend that never graphs a mode takes it off for all
    ({D: A, V: A, E: A}, {D: N, V: A, E: A}, {"target_verify", "draft_extend"}),
    ({D: A, V: A, E: A}, {D: A, V: A, E: N}, {"draft_decode", "target_verify"}),
    ({D: A, V: A, E: A}, {}, set()),
])
def test_speculative_graph_modes_from_fake_backend_capabilities(target, draft, graphed):
    """Fakes replace the target and the draft-step backends through provider overrides; the decision reads
    only their capability data (no backend class is named anywhere in it)."""
    plain = containers.to_plain(compose_config("+deploy=cpu_speculative", "graph=decode"))
    c = containers.Container()
    c.config.from_dict(plain)
    c.backend.override(providers.Object(fake(target)()))
    c.draft_backends.override(providers.Object([fake(draft)() for _ in range(3)]))
    c.device_type.override(providers.Object("cuda"))
    decisions = c.graph_decisions()
    assert set(decisions) == {"draft_decode", "target_verify", "draft_extend"}
    assert {m for m, d in decisions.items() if d.graphed} == graphed
    for mode, d in decisions.items():
        assert d.graphed or ("needs" in d.reason and "Fake" in d.reason), (mode, d.reason)


@pytest.mark.parametrize("builds_own,mode,expect_pass", [
    (True, "auto", False), (False, "auto", True), (True, "always", True),
])
def test_shared_kv_indices_pass_only_for_backends_that_need_it(builds_own, mode, expect_pass):
    plain = containers.to_plain(compose_config("+deploy=cpu_speculative", f"speculative.shared_kv_indices={mode}"))
    c = containers.Container()
    c.config.from_dict(plain)
    c.draft_backends.override(providers.Object([fake(N, builds_own=builds_own)() for _ in range(3)]))
    assert (c.draft_kv_indices() is not None) is expect_pass


def test_graphable_backend_without_hooks_is_refused_at_startup():
    plain = containers.to_plain(compose_config("device=cuda", "graph=decode", "model.dtype=bfloat16"))
    problems = validate(plain, {"torch_mla": fake(CudaGraphLevel.SINGLE_TOKEN_DECODE, with_hooks=False)}, GPU)
    text = "\n".join(map(str, problems))
    assert "GraphHooks" in text and "init_forward_metadata_replay" in text
    assert validate(plain, {"torch_mla": fake(CudaGraphLevel.SINGLE_TOKEN_DECODE)}, GPU) == []


def test_graphs_on_cpu_are_refused():
    plain = containers.to_plain(compose_config("device=cpu", "graph=decode"))
    assert any("graph.enabled" in p.what for p in validate(plain, containers.BACKENDS, DeviceInfo(
        "cpu", "cpu", 0, False, None, "cpu")))


def test_report_says_why_decode_was_not_graphed():
    rt = containers.build(compose_config("device=cpu"))
    d = rt.container.graph_runner().modes["decode"].decision
    assert not d.graphed and d.reason == "graph.enabled=false"
