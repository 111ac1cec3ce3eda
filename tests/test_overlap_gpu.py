"""Overlap scheduler and dumps under CUDA graphs, on a GPU (marked gpu; skipped without CUDA)."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import compose_config

import containers
from runtime.app.diff import compare_dumps

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="flashinfer not installed")]

SMALL = ["check=off", "progress=false", "model.num_layers=2", "workload=smoke", "workload.num_requests=10",
         "workload.max_running_requests=8", "workload.prompt_len.max=200", "workload.chunked_prefill_size=128",
         "workload.max_tokens_per_batch=256", "workload.output_len.max=20", "kv.num_pages=256",
         "graph.batch_sizes=[1,2,4,8]"]


def _run(*overrides):
    rt = containers.build(compose_config(*SMALL, *overrides))
    return rt, rt.engine.run()


@pytest.mark.parametrize("preset", ["h100_dsv3_tp8", "h100_dsv3_tp8_spec", "h100_triton_tp8"])
def test_overlap_on_and_off_emit_identical_tokens_with_graphs(preset):
    """h100_triton_tp8 also graphs prefill (steps of up to 7 requests), two executable graphs per count as decode."""
    extra = ["speculative.baseline=false"] if preset.endswith("spec") else []
    rt_on, on = _run(f"+deploy={preset}", "engine.overlap=on", *extra)
    rt_off, off = _run(f"+deploy={preset}", "engine.overlap=off", *extra)
    assert rt_on.engine.overlap and not rt_off.engine.overlap
    assert on.outputs == off.outputs and on.lost == 0 and on.finished == 10
    runner = rt_on.container.graph_runner()
    graphed = [m for m in runner.modes.values() if m.decision.graphed]
    assert graphed and all(m.replays > 0 for m in graphed)
    assert all(len(g) == 2 for m in graphed for g in m.graphs.values())  # alternating executable graphs


@pytest.mark.parametrize("preset,modes", [("h100_dsv3_tp8", {"attn_decode.pt"}),
                                          ("h100_dsv3_tp8_spec", {"attn_target_verify.pt"})])
def test_dumps_with_graphs_equal_dumps_without(preset, modes, tmp_path):
    extra = ["speculative.baseline=false"] if preset.endswith("spec") else []
    a, b = tmp_path / "graphs", tmp_path / "eager"
    rt, _ = _run(f"+deploy={preset}", f"+dump_dir={a}", *extra)
    assert any(m.replays > 0 for m in rt.container.graph_runner().modes.values())
    _run(f"+deploy={preset}", "graph=off", f"+dump_dir={b}", *extra)
    assert modes <= {p.name for p in a.glob("attn_*.pt")}
    rows, problems = compare_dumps(a, b, tol=2e-2)
    assert not problems, problems
    bad = [r for r in rows if not r[5]]
    assert rows and not bad, bad
