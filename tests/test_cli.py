"""`python -m runtime` end to end, as a person runs it (subprocess), and the dump diff tool. The bad-input cases run
in one interpreter (tests/cli_batch.py: each a forked child executing `python -m runtime`'s main with its own exit
code and output), the interpreter's start paid once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, tmp_path: Path, module: str = "runtime") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args, *( [f"hydra.run.dir={tmp_path}/run"] if module == "runtime" else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize("preset", [None, "cpu_small_pool", "cpu_long_prefix"])
def test_cli_runs_and_writes_a_consistent_report(preset, tmp_path):
    args = ["device=cpu"] + ([f"+deploy={preset}"] if preset else [])
    p = cli(*args, tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "report:" in p.stdout
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    for key in ("backend", "device", "build_order", "memory", "phases", "requests", "parity"):
        assert key in rep
    assert rep["build_order"][-1] == "engine" and rep["memory"]["kv_pool_bytes"] > 0
    assert set(rep["memory"]["workspaces"]) >= {"flashinfer_float"}
    req, dec, pre = rep["requests"], rep["phases"]["decode"], rep["phases"]["prefill"]
    assert req["finished"] == req["total"] and req["lost"] == 0
    # every generated token came from a prefill's last position or a decode step
    assert dec["tokens"] + req["finished"] + req["retracted"] >= req["generated_tokens"]
    assert pre["tokens"] >= req["prompt_tokens"] and dec["p99_step_ms"] >= dec["p50_step_ms"] > 0
    assert rep["parity"]["ok"] is True and rep["parity"]["tokens_equal"] is True
    # one output per request, in input order, synthetic workloads too (no tokenizer: no text)
    outs = rep["outputs"]
    assert [o["rid"] for o in outs] == list(range(req["total"]))
    assert sum(len(o["output_ids"]) for o in outs) == req["generated_tokens"] > 0
    assert all(o["finish_reason"] == "length" and "text" not in o and o["prompt_tokens"] > 0 for o in outs)
    assert "outputs" in p.stdout and "#0 (" in p.stdout
    if preset == "cpu_small_pool":
        assert req["retracted"] > 0


def test_dumps_and_diff_against_itself(tmp_path):
    dumps = tmp_path / "dumps"
    p = cli("device=cpu", "+deploy=cpu_long_prefix", f"+dump_dir={dumps}", tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    import torch

    mha, dec = torch.load(dumps / "attn_extend_mha.pt"), torch.load(dumps / "attn_decode.pt")
    t, h = dec["q_nope"].shape[:2]
    assert dec["q_pe"].shape == (t, h, 64) and dec["out"].shape == (t, h, 512)
    assert dec["ckv"].shape[0] == dec["kv_indptr"][-1] and dec["causal"] is True
    assert mha["q"].shape[-1] == 192 and mha["v"].shape[-1] == 128 and mha["k"].shape[0] == mha["kv_indptr"][-1]
    d = cli(str(dumps), str(dumps), tmp_path=tmp_path, module="runtime.app.diff")
    assert d.returncode == 0 and "dumps match" in d.stdout, d.stdout + d.stderr
    assert "0.000e+00" in d.stdout


def test_explain_prints_the_plan_without_running(tmp_path):
    p = cli("device=cpu", "+explain=true", tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "build order" in p.stdout and "kv_pool" in p.stdout and "workspace:flashinfer_float" in p.stdout
    assert not (tmp_path / "run" / "report.json").exists()


BAD_INPUTS = [
    (["backend=nope"], ["backend", "torch_mla"]),
    (["workload.num_requests=many"], ["num_requests"]),
    (["workload.prompt_len.min=-4"], ["workload.prompt_len", "Fix:"]),
    (["workload.prompt_len.max=4000"], ["max_context", "Fix:"]),
    (["kv.num_pages=3"], ["room for one request", "kv.num_pages="]),
    (["hisparse=dsa_2048", "device=cpu"], ["not sparse-capable"]),
    (["+explian=true"], ["explian"]),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """Every BAD_INPUTS run through tests/cli_batch.py, by its args: {"returncode", "stdout", "stderr"}."""
    d = tmp_path_factory.mktemp("bad_inputs")
    (d / "spec.json").write_text(json.dumps([{"args": a, "dir": str(d / f"run{i}")}
                                             for i, (a, _) in enumerate(BAD_INPUTS)]))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "cli_batch.py"), str(d / "spec.json"),
                        str(d / "out.json")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return {tuple(a): r for (a, _), r in zip(BAD_INPUTS, json.loads((d / "out.json").read_text()), strict=True)}


@pytest.mark.parametrize("args,fragments", BAD_INPUTS)
def test_bad_input_gives_one_clear_message(args, fragments, bad_input_runs):
    p = bad_input_runs[tuple(args)]
    assert p["returncode"] != 0
    out = p["stdout"] + p["stderr"]
    assert "Traceback" not in out, out
    for f in fragments:
        assert f in out, (f, out)
