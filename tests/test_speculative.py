"""Speculative decoding on the CPU: lossless against plain greedy (dense MLA and DeepSeek-V3.2 sparse layers),
retraction, slot accounting, validation."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config

import containers
from backends.multi_step_draft import SharedKVIndicesPass, step_batch
from runtime.app.validation import validate
from runtime.core.batch import ForwardMode, make_batch
from runtime.core.device import DeviceInfo
from runtime.core.errors import ConfigError

CPU = DeviceInfo("cpu", "cpu", 0, False, None, "cpu")
F64 = ("model.dtype=float64", "backend.compute_dtype=float64")  # no near-ties between verify and decode paths


def _run(*overrides, spec: bool = True, preset: str = "cpu_speculative"):
    extra = () if preset == "cpu_speculative" else ("speculative=eagle_chain", "model.num_layers=4")
    rt = containers.build(compose_config(f"+deploy={preset}", *extra, f"speculative.enabled={str(spec).lower()}",
                                         *overrides))
    return rt, rt.engine.run()


@pytest.mark.parametrize("overrides", [
    (),                                                            # smoke, 3 draft tokens, draft = layer 0
    ("speculative.num_steps=1",),                                  # no draft decode step: d_1 from the extend only
    ("speculative.num_steps=5", "speculative.draft_layers=2", "kv.page_size=1"),
    # longer requests, prefill in chunks of 16 tokens, batches mixing prefill and decoding requests
    ("workload.num_requests=12", "workload.prompt_len.max=90", "workload.output_len.max=40",
     "workload.chunked_prefill_size=16", "workload.max_tokens_per_batch=48", "speculative.num_steps=4"),
])
def test_speculative_tokens_equal_plain_greedy(overrides):
    rt, spec = _run(*F64, *overrides)
    _, plain = _run(*F64, *overrides, spec=False)
    assert spec.outputs == plain.outputs
    assert spec.lost == 0 and spec.finished == len(plain.outputs)
    st = rt.container.speculative().stats
    assert st.rounds > 0 and 1.0 <= st.acceptance_length <= rt.config["speculative"]["num_steps"] + 1
    assert sum(st.accept_hist) == st.request_rounds
    # every page and request row came back
    pages = rt.container.page_allocator()
    assert pages.available == pages.capacity
    assert rt.container.req_to_token_pool().available == rt.config["kv"]["max_requests"]


def test_speculative_in_float32_matches_plain_greedy_and_accepts_a_meaningful_share():
    rt, spec = _run()
    _, plain = _run(spec=False)
    assert spec.outputs == plain.outputs
    # the draft (first of 4 layers, GPT-2 residual init) agrees with the target often, but not always
    st = rt.container.speculative().stats
    assert 0.2 < st.acceptance_rate < 1.0, st


def test_a_draft_equal_to_the_target_is_always_accepted():
    rt, spec = _run(*F64, "speculative.draft_layers=4")
    st = rt.container.speculative().stats
    assert st.acceptance_rate == 1.0 and st.accept_hist[-1] == st.accept_hist[-1] > 0
    _, plain = _run(*F64, spec=False)
    assert spec.outputs == plain.outputs


def test_retraction_under_speculation_loses_nothing_and_returns_every_slot():
    rt, spec = _run(*F64, preset="cpu_small_pool")
    assert spec.retracted > 0 and spec.lost == 0
    _, big = _run(*F64, "kv.num_pages=400", spec=False, preset="cpu_small_pool")
    assert big.retracted == 0 and spec.outputs == big.outputs
    pages = rt.container.page_allocator()
    assert pages.available == pages.capacity


# DeepSeek-V3.2 sparse layers (backend dsa, top-8 indexer far below the contexts of 12-76 tokens): verify and draft
# extend are extends in which every token attends to its own causal top-k; the draft keeps its own indexer keys
DSA = ("+deploy=cpu_dsa_hisparse", "hisparse=off", "check=off", "progress=false", "workload.num_requests=6",
       "workload.max_running_requests=6")  # prompts 12-60 tokens prefilled in chunks of 32, batched


@pytest.mark.parametrize("overrides", [
    (),                                                                   # draft = the first of 2 sparse layers
    ("kv.num_pages=30",),                                                 # retraction
    ("model.layer_pattern=[full,sparse]", "model.num_layers=4", "speculative.num_steps=2"),  # dense full layers too
])
def test_speculative_on_sparse_layers_equals_plain_greedy(overrides):
    rt = containers.build(compose_config(*DSA, "speculative=eagle_chain", *overrides))
    spec = rt.engine.run()
    plain = containers.build(compose_config(*DSA, *overrides)).engine.run()
    assert spec.outputs == plain.outputs and spec.lost == 0
    assert spec.retracted > 0 if overrides == ("kv.num_pages=30",) else spec.retracted == 0
    st = rt.container.speculative().stats
    assert st.rounds > 0 and 0 < st.acceptance_rate < 1
    c = rt.container
    assert c.backend().prefill_stats()["sparse"] < c.backend().prefill_stats()["dense"]  # really sparse
    draft = c.draft_attention()
    assert draft.extend_backend.prefill_stats()["sparse"] < draft.extend_backend.prefill_stats()["dense"]
    assert c.draft_index_key_pool() is not c.index_key_pool()
    pages = c.page_allocator()
    assert pages.available == pages.capacity


def test_a_sparse_draft_equal_to_the_target_is_accepted():
    """Both layers as the draft: its own sparse state computes the target's selection (float32: the decode and
    verify paths round differently, so a near-tie may reject one draft)."""
    rt = containers.build(compose_config(*DSA, "speculative=eagle_chain", "speculative.draft_layers=2"))
    spec = rt.engine.run()
    assert spec.outputs == containers.build(compose_config(*DSA)).engine.run().outputs
    assert rt.container.speculative().stats.acceptance_rate >= 0.95


def test_sparse_verify_and_draft_extend_are_graphed_with_the_decode_kernels():
    """dsa graphs verify / draft extend as uniform batches (Triton runs them with the decode kernels); the torch
    impl graphs nothing (its reference loops on the host)."""
    from backends.dsa import DSABackend
    from runtime.engine.graph_runner import decide_graphs

    d = decide_graphs(True, "cuda", [object.__new__(DSABackend) for _ in range(4)], True, [1, 2])
    assert d["draft_decode"].graphed and d["target_verify"].graphed and d["draft_extend"].graphed


def test_shared_kv_indices_pass_when_forced_changes_nothing_but_runs_every_round():
    rt, forced = _run(*F64, "speculative.shared_kv_indices=always")
    kv_pass = rt.container.draft_kv_indices()
    assert kv_pass is not None and kv_pass.runs == rt.container.speculative().stats.rounds
    rt2, auto = _run(*F64)
    assert rt2.container.draft_kv_indices() is None  # torch_mla builds its own kv indices
    assert forced.outputs == auto.outputs


def test_shared_kv_indices_pass_gives_every_step_the_request_pages():
    rt = containers.build(compose_config("+deploy=cpu_speculative", "kv.page_size=4"))
    slots = rt.container.token_slots()
    rows = [slots.open(), slots.open()]
    lens = [5, 9]
    slots.reserve_many([(r, 0, n + 4) for r, n in zip(rows, lens)])
    table = rt.container.req_to_token_pool().req_to_token
    base = make_batch(ForwardMode.DECODE, rows, lens, [1, 1], [int(table[r, n]) for r, n in zip(rows, lens)],
                      torch.device("cpu"))
    steps = [step_batch(base, j, table) for j in range(3)]
    assert [s.seq_lens_cpu.tolist() for s in steps] == [[6, 10], [7, 11], [8, 12]]
    assert steps[2].out_cache_loc.tolist() == [int(table[r, n + 2]) for r, n in zip(rows, lens)]
    SharedKVIndicesPass(rt.container.req_to_token_pool(), 4).run(steps)
    pages = steps[0].kv_page_table
    assert all(s.kv_page_table is pages for s in steps) and pages.shape == (2, 3)
    for b, (r, n) in enumerate(zip(rows, lens)):
        want = [int(table[r, p * 4]) // 4 for p in range(-(-(n + 3) // 4))]
        assert pages[b, : len(want)].tolist() == want


def test_report_has_acceptance_phase_times_and_baseline(tmp_path):
    from runtime.app.cli import run

    cfg = compose_config("+deploy=cpu_speculative", "progress=false")
    assert run(cfg, tmp_path) == 0
    import json

    rep = json.loads((tmp_path / "report.json").read_text())
    sp = rep["speculative"]
    assert sp["rounds"] > 0 and sp["acceptance_length"] >= 1.0 and sp["baseline_decode_tokens_per_s"] > 0
    assert all(sp["phases"][p]["steps"] > 0 for p in ("draft_decode", "target_verify", "draft_extend"))
    assert set(rep["graphs"]) == {"draft_decode", "target_verify", "draft_extend"}
    assert rep["parity"]["ok"] and rep["parity"]["tokens_equal"]
    # the plain run fed the speculative tokens: the same choices everywhere, each mode's error within tolerance
    vb = sp["vs_baseline"]
    assert vb["tokens"]["equal"] == vb["tokens"]["positions"] > 0 and vb["tokens"]["by_source"]["accepted"]["equal"]
    assert set(vb["hidden_err"]) == {"target_verify", "decode"}
    assert all(v["max_rel_err"] <= rep["parity"]["tolerance"] for by in vb["hidden_err"].values() for v in by.values())
    assert rep["memory"]["draft_kv_pool_bytes"] > 0
    assert rep["build_order"].index("draft_model") > rep["build_order"].index("model")


@pytest.mark.parametrize("overrides,fragment", [
    (("speculative.topk=2",), "speculative.topk"),
    (("speculative.num_steps=0",), "speculative.num_steps"),
    (("speculative.draft_layers=9",), "speculative.draft_layers"),
    (("model=ring_hybrid_tiny",), "linear-attention layers"),
    (("model.max_context=60",), "speculative look-ahead"),  # 48 + 10 fits, + 3 + 2 does not
    (("backend=dsa", "model=tiny_dsa", "hisparse=dsa_tiny"), "Fix: use hisparse=off to speculate on a sparse model"),
])
def test_invalid_speculative_configs_are_refused_with_the_fix(overrides, fragment):
    plain = containers.to_plain(compose_config("+deploy=cpu_speculative", *overrides))
    problems = validate(plain, containers.BACKENDS, CPU)
    assert any(fragment in str(p) for p in problems), problems
    with pytest.raises(ConfigError):
        containers.build(plain)


def test_sparse_layers_without_hisparse_may_speculate():
    plain = containers.to_plain(compose_config("+deploy=cpu_speculative", "backend=dsa", "model=tiny_dsa"))
    assert validate(plain, containers.BACKENDS, CPU) == []
    hs = containers.to_plain(compose_config("+deploy=cpu_speculative", "backend=dsa", "model=tiny_dsa",
                                            "hisparse=dsa_tiny"))
    [p] = [p for p in validate(hs, containers.BACKENDS, CPU) if "speculative" in p.what]
    assert "hisparse.enabled=true" in p.what and "not implemented" in p.expected and "hisparse=off" in p.fix
