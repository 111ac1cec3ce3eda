"""DeepSeek sparse attention on a GPU, end to end through the CLI (marked gpu; skipped without CUDA): the
Triton indexer, sparse decode and host-gather kernels, HiSparse with pinned host memory, decode CUDA graphs,
parity against the float32 torch impl of the same sparse model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["workload=smoke", "workload.num_requests=12", "workload.max_running_requests=8",
         "workload.prompt_len.max=300", "workload.chunked_prefill_size=128", "workload.max_tokens_per_batch=256",
         "workload.output_len.max=24", "kv.num_pages=256", "kv.max_requests=16", "graph.batch_sizes=[1,2,4,8]",
         # attention only: these tests bound what the indexer's discrete selection does; MoE routing would add
         # its own bf16 flips (the parity report allows those separately) and needs bf16 for graphs
         "model.mlp=none"]
# top-64 of up to 324 tokens, 128 device slots: the indexer really selects, the buffer evicts
SELECTING = ["model.index_topk=64", "hisparse.top_k=64", "hisparse.device_buffer_size=128"]

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")]


def run_cli(tmp_path: Path, *args: str, parity_may_fail: bool = False) -> dict:
    p = subprocess.run([sys.executable, "-m", "runtime", *args, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    ok_codes = (0, 1) if parity_may_fail else (0,)  # 1: ran to the end, parity reported a difference
    assert p.returncode in ok_codes, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((tmp_path / "report.json").read_text())


def _check_run(rep: dict, hisparse: bool) -> None:
    assert rep["requests"]["lost"] == 0 and rep["requests"]["finished"] == 12
    assert rep["graphs"]["decode"]["graphed"] and rep["graphs"]["decode"]["replays"] > 0
    if hisparse:
        hs = rep["hisparse"]
        assert hs["swap_ins"] > 0 and hs["host_kv_bytes"] > 0
        assert rep["build_order"].index("hisparse_coordinator") < rep["build_order"].index("backend:dsa")


@pytest.mark.parametrize("extra", [[], [*SELECTING, "model.dtype=float32"]], ids=["top2048_bf16", "top64_fp32"])
def test_dsa_end_to_end_with_parity_and_graphs(extra, tmp_path):
    """Contexts below top-k (every token selected), or float32: the run matches the float32 reference."""
    rep = run_cli(tmp_path, "+deploy=h100_dsa_hisparse", *SMALL, *extra)
    _check_run(rep, hisparse=True)
    assert rep["parity"]["ok"] is True, rep["parity"]


@pytest.mark.parametrize("extra", [SELECTING, ["hisparse=off", *SELECTING]], ids=["top64_bf16", "no_hisparse_bf16"])
def test_bf16_selection_stays_close_to_the_reference(extra, tmp_path):
    """bf16 with contexts past top-k: rounding can move an indexer score across the k-th one, so a few tokens
    may differ from the float32 reference beyond near-ties (measured: 2 of 170, max rel err 7.6e-2, the same
    with and without HiSparse). Bounded here at twice what was measured; NaN never passes."""
    rep = run_cli(tmp_path, "+deploy=h100_dsa_hisparse", *SMALL, *extra, parity_may_fail=True)
    _check_run(rep, hisparse="hisparse=off" not in extra)
    par, generated = rep["parity"], rep["requests"]["generated_tokens"]
    assert par["max_rel_err"] < 0.15, par
    assert par["mismatches"] - par["near_tie_mismatches"] <= max(4, generated // 40), par


def test_graph_replay_equals_eager_with_hisparse(tmp_path):
    graphed = run_cli(tmp_path / "g", "+deploy=h100_dsa_hisparse", *SMALL, *SELECTING, "check=off")
    eager = run_cli(tmp_path / "e", "+deploy=h100_dsa_hisparse", *SMALL, *SELECTING, "check=off", "graph=off")
    assert graphed["graphs"]["decode"]["replays"] > 0 and not eager["graphs"]["decode"]["graphed"]
    assert graphed["requests"]["outputs_sha1"] == eager["requests"]["outputs_sha1"]
    assert graphed["hisparse"]["swap_ins"] == eager["hisparse"]["swap_ins"]
