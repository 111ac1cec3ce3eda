"""Shared fixtures: Hydra compose over conf/, and auto-skip of GPU tests on machines without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, every Triton kernel runs in Triton's CPU interpreter. Set it here, before any test module
# imports a kernel: Triton reads the variable when a kernel module is first imported, so a test file that sets
# it itself only works when it happens to be collected before every other importer.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hydra import compose, initialize_config_dir

import runtime.core.config  # noqa: F401  (registers the schemas)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def compose_config(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.fixture
def cfg_of():
    """cfg_of("backend=torch_mla", ...) -> the composed DictConfig."""
    return compose_config


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls: one thread is faster (and immune to a busy machine's oversubscription).
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def no_indexer_ties(monkeypatch):
    """Fail a DeepSeek-V4 test whose indexer scores tie exactly at the top-k boundary: which pick wins is not
    defined (in the reference either), so the comparison would be ill-posed (tests/dsv4_harness.py)."""
    from dsv4_harness import guard_indexer_ties

    ties = guard_indexer_ties(monkeypatch)
    yield
    assert not ties, f"indexer top-k ties at positions {ties}: the comparison is ill-posed; change the seed"


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip without CUDA; ``slow`` ones (minutes of subprocesses, kept out of the default run so CPU CI
    stays under its 20 minutes) run with ``RUN_SLOW=1`` or ``-m slow``."""
    slow = os.environ.get("RUN_SLOW") == "1" or "slow" in (config.getoption("markexpr") or "")
    gpu_skip = pytest.mark.skip(reason="needs a CUDA GPU")
    slow_skip = pytest.mark.skip(reason="slow: RUN_SLOW=1 or -m slow runs it (left out of the default run: CI time)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(gpu_skip)
        if "slow" in item.keywords and not slow:
            item.add_marker(slow_skip)
