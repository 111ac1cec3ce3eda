"""Hybrid models: the wrapper routes layers and forwards typed hooks; the two failures seen in a leading
engine (a hook silently skipped by a hasattr guard; a FlashInfer-only flag passed to a one-argument hook)
cannot happen, and a missing hook fails at startup with a message that names it."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from dependency_injector import providers

import containers
from backends.hybrid_linear import HybridLinearBackend
from backends.torch_mla import TorchMLABackend
from runtime.core.errors import ConfigError, HookMismatch

HYBRID = ("device=cpu", "model=ring_hybrid_tiny")


class PlannedTokensHook:
    """An MHA hook that, like FlashInfer's ragged wrapper, insists q matches what it planned."""

    def __init__(self, inner: TorchMLABackend):
        self.inner, self.planned, self.checked = inner, None, 0

    def init_mha_chunk_metadata(self, batch):
        self.planned = batch.num_tokens
        self.inner.init_mha_chunk_metadata(batch)

    def _check(self, q):
        if q.shape[0] != self.planned:
            raise RuntimeError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] ({self.planned})")
        self.checked += 1

    def forward_mha_extend(self, q, k, v, layer_id, batch):
        self._check(q)
        return self.inner.forward_mha_extend(q, k, v, layer_id, batch)

    def forward_mha_prefix_chunk(self, q, k, v, chunk, layer_id, batch):
        self._check(q)
        return self.inner.forward_mha_prefix_chunk(q, k, v, chunk, layer_id, batch)

    def merge_states(self, out_a, lse_a, out_b, lse_b):
        return self.inner.merge_states(out_a, lse_a, out_b, lse_b)


def test_hybrid_builds_the_wrapper_and_its_state_pool_in_order():
    rt = containers.build(compose_config(*HYBRID))
    order = rt.build_order
    assert order.index("backend:torch_mla") < order.index("backend:hybrid_linear") < order.index("model")
    assert order.index("linear_state_pool") < order.index("backend:linear")
    assert type(rt.container.attention()) is HybridLinearBackend
    assert rt.container.mha_prefill() is rt.container.attention()  # the wrapper forwards the typed hook


def test_mla_model_builds_no_linear_pieces():
    order = containers.build(compose_config("device=cpu")).build_order
    assert not {"linear_state_pool", "backend:linear", "backend:hybrid_linear"} & set(order)


def test_chunked_prefill_through_the_wrapper_plans_the_batch_tokens():
    """Regression: the wrapper must forward init_mha_chunk_metadata, so the plan covers the batch's tokens."""
    container = containers.Container()
    holder = {}

    def hook(backend):
        holder["hook"] = PlannedTokensHook(backend)
        return holder["hook"]

    container.backend_mha_prefill.override(providers.Callable(hook, container.backend))
    rt = containers.build(compose_config(*HYBRID, "+deploy=cpu_long_prefix", "model=ring_hybrid_tiny"),
                          container=container)
    res = rt.engine.run()
    assert res.finished == len(res.outputs) and holder["hook"].checked > 0


def test_a_one_argument_hook_works_through_the_wrapper():
    """Regression: every hook takes the batch only; no backend-specific flag is ever passed per call."""
    calls = []

    class OneArg(PlannedTokensHook):
        def init_mha_chunk_metadata(self, batch):  # exactly one argument
            calls.append(batch.num_tokens)
            super().init_mha_chunk_metadata(batch)

    container = containers.Container()
    container.backend_mha_prefill.override(providers.Callable(OneArg, container.backend))
    rt = containers.build(compose_config(*HYBRID), container=container)
    assert rt.engine.run().lost == 0 and calls


def test_a_mistyped_hook_is_refused_when_the_wrapper_is_built():
    class TwoArgs(PlannedTokensHook):
        def init_mha_chunk_metadata(self, batch, disable_ragged):  # the FlashInfer-only flag, per call
            pass

    container = containers.Container()
    container.backend_mha_prefill.override(providers.Callable(TwoArgs, container.backend))
    with pytest.raises(HookMismatch) as e:
        containers.build(compose_config(*HYBRID), container=container)
    msg = str(e.value)
    assert "MHAChunkPrefill" in msg and "torch_mla" in msg and "init_mha_chunk_metadata" in msg and "Fix" in msg


def test_a_missing_hook_fails_at_startup_not_at_first_prefill(monkeypatch):
    """A full backend that declares the capability but lacks the method: refused by validation, by name."""
    monkeypatch.delattr(TorchMLABackend, "init_mha_chunk_metadata")
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config(*HYBRID))
    msg = str(e.value)
    assert "MHAChunkPrefill" in msg and "torch_mla" in msg and "init_mha_chunk_metadata" in msg


def test_requiring_mha_prefill_from_a_backend_without_the_hook_fails_at_startup():
    plain = containers.to_plain(compose_config(*HYBRID, "backend=triton_mla", "attention.prefill=mha_chunked"))
    from runtime.app.validation import validate
    from runtime.core.device import DeviceInfo

    gpu = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "H100")
    text = "\n".join(map(str, validate(plain, containers.BACKENDS, gpu, package_present=lambda n: True)))
    assert "backend 'triton_mla' hook MHAChunkPrefill" in text and "attention.prefill=auto" in text


def test_fla_on_cpu_is_refused():
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config(*HYBRID, "attention.linear_impl=fla"))
    assert "linear_impl=fla" in str(e.value)


def test_hybrid_prefill_then_decode_matches_one_long_prefill():
    """Chunked prefill carries linear state across chunks exactly: small chunks == one big chunk."""
    small = containers.build(compose_config(*HYBRID, "+deploy=cpu_long_prefix", "model=ring_hybrid_tiny")).engine.run()
    big = containers.build(compose_config(
        *HYBRID, "+deploy=cpu_long_prefix", "model=ring_hybrid_tiny", "workload.chunked_prefill_size=512",
        "workload.max_tokens_per_batch=4096")).engine.run()
    assert small.outputs == big.outputs
    for rid in small.hidden:
        torch.testing.assert_close(small.hidden[rid], big.hidden[rid], rtol=1e-4, atol=1e-4)


def test_request_states_come_back_and_are_reset():
    rt = containers.build(compose_config(*HYBRID, "+deploy=cpu_small_pool", "model=ring_hybrid_tiny"))
    res = rt.engine.run()
    assert res.retracted > 0 and res.lost == 0
    big = containers.build(compose_config(*HYBRID, "+deploy=cpu_small_pool", "model=ring_hybrid_tiny",
                                          "kv.num_pages=400")).engine.run()
    assert big.outputs == res.outputs  # a retracted request restarts from a reset state
