"""The overlap scheduler (engine.overlap): identical tokens with it on and off, EOS learned one step
late, graph capture that never dumps, graphed steps that run eagerly while a dump is wanted, steps.png."""

from __future__ import annotations

from collections import deque

import pytest
import torch
from conftest import compose_config

import containers
from runtime.core.batch import ForwardMode
from runtime.engine.graph_runner import GraphDecision, copies_per_size, overlap_enabled


def _run(*overrides):
    rt = containers.build(compose_config("device=cpu", "check=off", *overrides))
    return rt, rt.engine.run()


@pytest.mark.parametrize("preset", [
    (),  # plain: prefill, then decode steps
    ("+deploy=cpu_long_prefix",),  # chunked prefill over several steps, MHA prefix chunks
    ("+deploy=cpu_small_pool",),  # queueing and retraction under a small KV pool
    ("+deploy=cpu_speculative", "speculative.baseline=false"),  # rounds of draft, verify, draft extend
])
def test_overlap_on_and_off_emit_identical_tokens(preset):
    rt_on, on = _run(*preset, "engine.overlap=on")
    rt_off, off = _run(*preset, "engine.overlap=off")
    assert rt_on.engine.overlap and not rt_off.engine.overlap
    assert on.outputs == off.outputs and on.argmax == off.argmax
    assert on.finished == off.finished == len(on.outputs) and on.lost == 0
    assert on.retracted == off.retracted
    if "+deploy=cpu_small_pool" in preset:
        assert on.retracted > 0
    pages = rt_on.container.page_allocator()
    assert pages.available == pages.capacity  # every page came back, with overlap too


def test_overlap_auto_is_off_on_the_cpu():
    rt = containers.build(compose_config("device=cpu"))
    assert rt.config["engine"]["overlap"] == "auto" and rt.engine.overlap is False
    assert overlap_enabled("auto", torch.device("cuda", 0)) is True
    assert copies_per_size(True) == 2 and copies_per_size(False) == 1


def test_a_typo_in_overlap_fails_at_compose_time():
    with pytest.raises(Exception, match="overlap"):
        compose_config("device=cpu", "engine.overlap=maybe")


@pytest.mark.parametrize("preset", [(), ("+deploy=cpu_small_pool",), ("+deploy=cpu_speculative",
                                                                        "speculative.baseline=false")])
def test_eos_finishes_requests_identically_with_overlap_on_and_off(preset):
    _, base = _run(*preset, "engine.overlap=off")
    eos = next(toks[len(toks) // 2] for toks in base.outputs.values() if len(toks) >= 4)  # emitted midway
    want = {rid: toks[: toks.index(eos) + 1] if eos in toks else toks for rid, toks in base.outputs.items()}
    cut = sum(1 for rid in want if want[rid] != base.outputs[rid])
    assert cut > 0
    results = {}
    for mode in ("on", "off"):
        rt_m = containers.build(compose_config("device=cpu", "check=off", *preset, f"engine.overlap={mode}",
                                               f"workload.eos_token_ids=[{eos}]"))
        results[mode] = rt_m.engine.run()
        pages = rt_m.container.page_allocator()
        assert pages.available == pages.capacity
        assert rt_m.container.req_to_token_pool().available == rt_m.config["kv"]["max_requests"]
    on, off = results["on"], results["off"]
    assert on.outputs == off.outputs == want
    for rid, toks in want.items():
        assert len(on.argmax[rid]) == len(toks) and len(on.margins[rid]) == len(toks)
    assert on.finished == off.finished == len(want) and on.lost == 0
    if not any("speculative" in p for p in preset):
        # with overlap the EOS is learned one step late: a stopped request runs at most one extra decode step
        dec_on = sum(s.batch_size for s in on.steps if s.phase == "decode")
        dec_off = sum(s.batch_size for s in off.steps if s.phase == "decode")
        assert dec_off <= dec_on <= dec_off + cut


class _FakeGraphs:
    """A graphed mode that replays by running the function eagerly (CPU), counting replays."""

    decision = GraphDecision("decode", False, reason="fake: nothing to capture")

    def __init__(self, fn, planner):
        self.fn, self.planner, self.replays = fn, planner, 0

    def can_run(self, batch):
        return batch.mode == ForwardMode.DECODE

    def prepare(self, ids, batch):
        self._args = (ids, batch)
        self.planner.init_forward_metadata(batch)  # what a backend's replay hook refreshes

    def replay(self):
        self.replays += 1
        with torch.no_grad():
            return self.fn(*self._args)


def test_a_graphed_step_runs_eagerly_while_its_dump_is_wanted(tmp_path):
    """The first decode step (the one the dump keeps) runs eagerly, so the dump holds its real values;
    later decode steps replay."""
    rt = containers.build(compose_config("device=cpu", "check=off", f"+dump_dir={tmp_path}"))
    engine = rt.engine
    fake = _FakeGraphs(engine.model.forward, engine.backend)
    runner = rt.container.graph_runner()
    runner.modes["decode"] = fake
    res = engine.run()
    decode_steps = [s for s in res.steps if s.phase == "decode"]
    assert (tmp_path / "attn_decode.pt").exists()
    assert [s.graphed for s in decode_steps] == [False] + [True] * (len(decode_steps) - 1)
    assert fake.replays == len(decode_steps) - 1 > 0
    # the same run without a dump replays every decode step
    rt2 = containers.build(compose_config("device=cpu", "check=off"))
    fake2 = _FakeGraphs(rt2.engine.model.forward, rt2.engine.backend)
    rt2.container.graph_runner().modes["decode"] = fake2
    res2 = rt2.engine.run()
    assert fake2.replays == sum(1 for s in res2.steps if s.phase == "decode")
    assert res2.outputs == res.outputs


def test_graph_capture_never_dumps(tmp_path):
    """While the runner captures (padding inputs), the dumper is paused: nothing is saved."""
    rt = containers.build(compose_config("device=cpu", "check=off", f"+dump_dir={tmp_path}"))
    dumper = rt.container.dumper()
    seen = deque()
    with dumper.paused_if(dumper):
        seen.append(dumper.wants("decode"))
        rt.engine.model.forward(torch.zeros(1, dtype=torch.int64), _decode_batch(rt))
    assert list(seen) == [False] and not dumper.saved and dumper.wants("decode")


def _decode_batch(rt):
    from runtime.core.batch import ForwardMode, make_batch

    slots = rt.container.token_slots()
    row = slots.open()
    locs = slots.reserve_many([(row, 0, 1)])
    return make_batch(ForwardMode.DECODE, [row], [0], [1], locs, torch.device("cpu"))


def test_steps_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from runtime.app.plot import write_step_plot

    rt, res = _run("+deploy=cpu_speculative", "speculative.baseline=false")
    path = write_step_plot(res, tmp_path)
    assert path == tmp_path / "steps.png" and path.stat().st_size > 1000
    rt, res = _run()
    assert write_step_plot(res, tmp_path / "plain").exists()
