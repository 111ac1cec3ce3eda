"""Speculative vs plain decoding on the same tokens (runtime/app/spec_compare.py): token sources, the per-source
token comparison and the hidden-state error of each mode against a reference (issue 51's measurement)."""

from __future__ import annotations

import math

import torch
from conftest import compose_config

import containers
from runtime.app.spec_compare import (
    hidden_errors_by_source,
    sources_of,
    speculative_parity,
    summary_line,
    tokens_vs_baseline,
)
from runtime.engine.engine import RunResult

F64 = ("model.dtype=float64", "backend.compute_dtype=float64")


def _result(outputs, argmax=None, margins=None, hidden=None, sources=None) -> RunResult:
    return RunResult(outputs=outputs, argmax=argmax or {}, margins=margins or {}, hidden=hidden or {},
                     sources=sources or {})


def test_tokens_against_the_plain_choices_by_source():
    spec = _result({0: [5, 6, 7, 8], 1: [1, 2]},
                   sources={0: ["prefill", "accepted", "correction", "bonus"], 1: ["prefill", "correction"]})
    base = _result({0: [5, 6, 7, 8], 1: [1, 2]}, argmax={0: [5, 9, 7, 3], 1: [1, 2]},
                   margins={0: [1.0, 0.01, 2.0, 0.5], 1: [1.0, 1.0]})
    got = tokens_vs_baseline(spec, base, tie_margin=0.05)
    assert (got["positions"], got["equal"], got["near_ties"], got["other"]) == (6, 4, 1, 1)
    assert got["by_source"]["accepted"] == {"positions": 1, "equal": 0, "near_ties": 1, "other": 0}
    assert got["by_source"]["bonus"] == {"positions": 1, "equal": 0, "near_ties": 0, "other": 1}
    assert got["by_source"]["correction"]["equal"] == 2 and got["by_source"]["prefill"]["equal"] == 2


def test_sources_of_a_plain_run_and_of_prefill_tokens_after_the_last_round():
    plain = _result({0: [1, 2, 3], 1: []})
    assert sources_of(plain, 0) == ["prefill", "decode", "decode"] and sources_of(plain, 1) == []
    spec = _result({0: [1, 2, 3, 4], 1: [9]}, sources={0: ["prefill", "accepted", "bonus"]})
    assert sources_of(spec, 0) == ["prefill", "accepted", "bonus", "prefill"]  # re-prefilled after retraction
    assert sources_of(spec, 1) == ["prefill"]  # finished at its prefill token, never in a round


def test_hidden_errors_per_position_and_nan_never_passes():
    b = torch.ones(3, 4)
    a = b.clone()
    a[1] *= 1.5
    a[2, 0] = float("nan")
    spec = _result({0: [1, 2, 3]}, hidden={0: a}, sources={0: ["prefill", "accepted", "correction"]})
    ref = _result({0: [1, 2, 3]}, hidden={0: b})
    got = hidden_errors_by_source(spec, ref)
    assert got["prefill"]["max_rel_err"] == 0.0 and math.isclose(got["accepted"]["max_rel_err"], 0.5)
    assert got["correction"]["max_rel_err"] == float("inf")


def _build(*overrides, spec: bool):
    small = ("workload.num_requests=4", "workload.output_len.min=8", "workload.output_len.max=16")
    return containers.build(compose_config("+deploy=cpu_speculative", *F64, f"speculative.enabled={str(spec).lower()}",
                                           *small, *overrides))


def test_speculative_run_records_a_source_per_token_and_matches_plain_decoding_on_its_tokens():
    rt = _build(spec=True)
    spec = rt.engine.run(record_hidden=True)
    st = rt.container.speculative().stats
    base = _build(spec=False).engine.run(forced=spec.outputs, record_hidden=True)
    for rid, toks in spec.outputs.items():
        src = sources_of(spec, rid)
        assert len(src) == len(toks) and src[0] == "prefill"
        assert set(src[1:]) <= {"accepted", "bonus", "correction"}
    n = {s: sum(sources_of(spec, rid).count(s) for rid in spec.outputs) for s in ("accepted", "bonus", "correction")}
    assert n["accepted"] > 0 and n["correction"] > 0  # the draft (first layer of 4) is right only sometimes
    assert n["accepted"] <= st.accepted and n["bonus"] + n["correction"] <= st.request_rounds
    entry = speculative_parity(spec, base, base, tie_margin=1e-6)
    t = entry["tokens"]
    assert t["equal"] == t["positions"] == sum(len(v) for v in spec.outputs.values())  # float64: lossless
    # verify and decode compute the same float64 hidden states (a reference here: the plain run itself)
    assert all(v["max_rel_err"] < 1e-10 for v in entry["hidden_err"]["target_verify"].values())
    assert all(v["max_rel_err"] == 0.0 for v in entry["hidden_err"]["decode"].values())
    assert "equal" in summary_line(entry) and "target_verify" in summary_line(entry)
