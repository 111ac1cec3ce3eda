"""The one-shot and fused all-reduce kernels on 2 GPUs (skipped without CUDA or with fewer than 2 GPUs): each mode
against NCCL's sums in bf16 and float32 for 1, 3, 17, 64 and 512 tokens (7168 wide, and 1000), the fused kernel
against the all-reduce followed by the add + RMSNorm kernel, both replayed in CUDA graphs, and a burst of 200
back-to-back calls (tests/allreduce_worker.py is one rank); then tp=2 vs tp=1 tokens with each mode in float32.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tp_launch import assert_same_tokens, free_port, run_tp2, tp1

from runtime.core.parallel import MULTICAST_OFF

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs 2 CUDA GPUs")]


def test_kernels_against_nccl_on_two_gpus():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **MULTICAST_OFF)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(ROOT / "tests" / "allreduce_worker.py")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and "ALLREDUCE_GPU_OK" in p.stdout, p.stdout[-4000:] + p.stderr[-4000:]


@pytest.mark.parametrize("mode", ["nccl", "oneshot", "fused"])
def test_tp2_tokens_equal_tp1_in_float32(tmp_path, mode):
    os.environ.update(MULTICAST_OFF)
    args = ("device=cuda", "model.dtype=float32", "backend=torch_mla", "model.fused=on")
    _, got = run_tp2(tmp_path, *args, f"parallel.allreduce={mode}", "check=off")
    want, margins = tp1(*args)
    assert_same_tokens(got, want, margins)
