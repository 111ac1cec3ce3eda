"""The engine: continuous batching, chunked prefill, retraction under memory pressure, parity, dumps."""

from __future__ import annotations

import torch
from conftest import compose_config

import containers
from runtime.app.parity import compare, reference_config


def _run(*overrides):
    rt = containers.build(compose_config("device=cpu", *overrides))
    return rt, rt.engine.run()


def test_smoke_every_request_finishes_with_its_length():
    rt, res = _run()
    wl = rt.config["workload"]
    assert res.finished == wl["num_requests"] and res.lost == 0
    from runtime.engine.workload import make_requests

    want = {r.rid: r.max_new_tokens for r in make_requests(wl, rt.config["model"]["vocab_size"])}
    assert {rid: len(toks) for rid, toks in res.outputs.items()} == want


def test_small_pool_retracts_and_loses_nothing():
    rt, res = _run("+deploy=cpu_small_pool")
    assert res.retracted > 0 and res.lost == 0 and res.finished == 8
    pages = rt.container.page_allocator()
    assert pages.available == pages.capacity  # every page came back
    assert rt.container.req_to_token_pool().available == rt.config["kv"]["max_requests"]
    # retraction recomputes: tokens equal a run with a pool big enough for everything
    _, big = _run("+deploy=cpu_small_pool", "kv.num_pages=400")
    assert big.retracted == 0 and big.outputs == res.outputs


def test_chunked_prefill_matches_one_shot_prefill():
    _, chunked = _run("+deploy=cpu_long_prefix")
    _, whole = _run("+deploy=cpu_long_prefix", "workload.chunked_prefill_size=512",
                    "workload.max_tokens_per_batch=2048", "workload.mha_prefix_chunk_tokens=4096")
    assert chunked.outputs == whole.outputs
    assert compare(chunked, whole, "float32").max_rel_err < 1e-4


def test_mha_prefill_and_absorbed_prefill_agree():
    rt, mha = _run("+deploy=cpu_long_prefix")
    assert rt.container.mha_prefill() is not None
    container = containers.Container()
    from dependency_injector import providers

    container.mha_prefill.override(providers.Object(None))  # force the absorbed path
    rt2 = containers.build(compose_config("device=cpu", "+deploy=cpu_long_prefix"), container=container)
    absorbed = rt2.engine.run()
    assert mha.outputs == absorbed.outputs
    assert compare(mha, absorbed, "float32").max_rel_err < 1e-4


def test_parity_detects_a_wrong_backend():
    rt, res = _run()
    ref = containers.build(reference_config(rt.config)).engine.run(forced=res.outputs)
    assert compare(res, ref, "float32").ok
    broken = {rid: h * 1.01 for rid, h in res.hidden.items()}
    res.hidden = broken
    assert not compare(res, ref, "float32").ok
    res.hidden = {rid: torch.full_like(h, float("nan")) for rid, h in broken.items()}
    assert not compare(res, ref, "float32").ok
