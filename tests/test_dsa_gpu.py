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


@pytest.fixture(scope="module")
def bf16_floor(tmp_path_factory) -> dict:
    """Parity of the same bf16 model on the dsa backend's torch impl (float32 scoring and attention math over bf16
    tensors, eager, no HiSparse): what bf16 rounding alone does to the tokens, against the same float32 reference."""
    rep = run_cli(tmp_path_factory.mktemp("floor"), "+deploy=h100_dsa_hisparse", *SMALL, "hisparse=off", *SELECTING,
                  "backend.impl=torch", "graph=off", parity_may_fail=True)
    return rep["parity"]


@pytest.mark.parametrize("extra", [SELECTING, ["hisparse=off", *SELECTING]], ids=["top64_bf16", "no_hisparse_bf16"])
def test_bf16_selection_stays_close_to_the_reference(extra, tmp_path, bf16_floor):
    """bf16 with contexts past top-k: rounding can move an indexer score across the k-th one, so some tokens differ
    from the float32 reference beyond near-ties. What bf16 does by itself is measured in the same session: the
    torch impl in bf16 (``bf16_floor``). Measured on an H100 (182 tokens, two weight seeds): Triton kernels 6 and 2
    flips beyond near-ties, the torch impl 4 and 0; both at margins 0.05-0.10 where the logit error vs float32 has
    median 0.031 and 90th percentile 0.19-0.21 in either impl (max rel err 4.5e-2 vs 4.8e-2), identical with and
    without HiSparse. So the Triton indexer, sparse decode and HiSparse may add at most the parity report's routing
    budget (max(4, tokens / 40)) of such flips to the floor's, and no more hidden-state error than 1.5x its; NaN
    never passes."""
    rep = run_cli(tmp_path, "+deploy=h100_dsa_hisparse", *SMALL, *extra, parity_may_fail=True)
    _check_run(rep, hisparse="hisparse=off" not in extra)
    par, floor = rep["parity"], bf16_floor
    beyond, floor_beyond = (p["mismatches"] - p["near_tie_mismatches"] for p in (par, floor))
    print(f"\nparity {par}\nbf16 floor (torch impl) {floor}")
    assert par["max_rel_err"] <= 1.5 * floor["max_rel_err"], (par, floor)
    assert beyond <= floor_beyond + par["routing_flip_budget"], (par, floor)


def test_graph_replay_equals_eager_with_hisparse(tmp_path):
    graphed = run_cli(tmp_path / "g", "+deploy=h100_dsa_hisparse", *SMALL, *SELECTING, "check=off")
    eager = run_cli(tmp_path / "e", "+deploy=h100_dsa_hisparse", *SMALL, *SELECTING, "check=off", "graph=off")
    assert graphed["graphs"]["decode"]["replays"] > 0 and not eager["graphs"]["decode"]["graphed"]
    assert graphed["requests"]["outputs_sha1"] == eager["requests"]["outputs_sha1"]
    assert graphed["hisparse"]["swap_ins"] == eager["hisparse"]["swap_ins"]


def test_speculative_verify_graphed_on_the_decode_kernels_equals_plain_decoding(tmp_path):
    """Speculation on sparse layers (no HiSparse), float32, top-64 of up to 324 tokens: verify and draft extend
    replay CUDA graphs of the decode kernels (each verify token's own top-k up to its position), and every emitted
    token equals plain decoding's on the same sequence (the report's replayed baseline)."""
    rep = run_cli(tmp_path, "+deploy=h100_dsa_hisparse", *SMALL, *SELECTING, "hisparse=off", "model.dtype=float32",
                  "speculative=eagle_chain", "check=reference")
    g = rep["graphs"]
    assert all(g[m]["graphed"] and g[m]["replays"] > 0 for m in ("draft_decode", "target_verify", "draft_extend")), g
    tokens = rep["speculative"]["vs_baseline"]["tokens"]
    assert tokens["equal"] == tokens["positions"] > 0, tokens
    assert rep["parity"]["ok"] is True, rep["parity"]
