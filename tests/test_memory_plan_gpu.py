"""The memory plan on a real GPU (docs/memory.md): kv.num_pages=auto fills the device to memory.fraction and the
workload runs without retraction; an oversized pool is refused before anything is allocated. The V4-Flash default
run (parity or a clear skip) is in scripts/memory_device.sh (minutes)."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import compose_config

import containers
from runtime.core.errors import ConfigError

pytestmark = pytest.mark.gpu
DSV3 = ("+deploy=h100_dsv3_tp8", "model.max_context=4096")


def test_auto_fills_the_device_to_the_fraction_and_nothing_retracts():
    pytest.importorskip("flashinfer")
    gc.collect()
    torch.cuda.reset_peak_memory_stats()  # the peak of this run only, not of the tests before it
    rt = containers.build(compose_config(*DSV3, "kv.num_pages=auto", "check=off", "workload.num_requests=32"))
    plan = rt.container.memory_budget()
    res = rt.engine.run()
    fixed, per_page = plan.on_device()
    assert plan.auto and plan.num_pages * per_page >= 0.99 * plan.fraction * (plan.free - fixed) - per_page
    peak = torch.cuda.max_memory_allocated()
    assert plan.fraction - 0.05 <= peak / plan.free <= 1.0, (peak, plan.summary())
    assert res.lost == 0 and res.retracted == 0 and res.queued_for_memory == 0 and not res.oom_events


def test_an_oversized_pool_is_refused_before_allocating():
    pytest.importorskip("flashinfer")
    gc.collect()  # the previous test's runtime, caught in a reference cycle, is freed here, not by the plan's read
    before = torch.cuda.memory_allocated()
    with pytest.raises(ConfigError, match=r"memory plan line 'kv pool'.*kv\.num_pages="):
        containers.build(compose_config(*DSV3, "kv.num_pages=10000000"))
    assert torch.cuda.memory_allocated() <= before
