"""scripts/tp_device.sh (the 2-GPU tensor-parallel run) starts and finishes on the CPU: ``SMOKE=1`` runs its steps
with gloo and a tiny model of the same structure (the per-mode all-reduce sweep; the wide preset at tp=1 and tp=2
allreduce auto; the fp8 checkpoint at tp=1 / tp=2 nccl with the all_reduce sweep, float32 parity; with gloo every
mode runs as nccl, so one mode per part) and prints the
tables with equal tokens. Every step runs the test's own interpreter
(``PYTHON``): the ``python3`` on PATH is a stub that fails, as a system python without torch would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _executable(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


@pytest.mark.slow  # ~85 s of torchrun launches: RUN_SLOW=1 (CPU CI is at its 20-minute limit)
def test_device_script_smoke_on_cpu(tmp_path):
    used = tmp_path / "python_used.log"
    # PYTHON: a wrapper that records each step, then runs this test's interpreter; PATH's python3: a stub that fails
    wrapper = _executable(tmp_path / "wrapper" / "python",
                          f'#!/bin/sh\necho "$*" >> "{used}"\nexec "{sys.executable}" "$@"\n')
    _executable(tmp_path / "bin" / "python3", "#!/bin/sh\necho 'python3 from PATH ran' >&2\nexit 97\n")
    env = dict(os.environ, SMOKE="1", OUT=str(tmp_path / "out"), CKPT=str(tmp_path / "ckpt"), OMP_NUM_THREADS="1",
               PYTHON=wrapper, PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    p = subprocess.run(["bash", "scripts/tp_device.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "python3 from PATH ran" not in p.stderr, p.stderr[-3000:]
    steps = used.read_text().splitlines()
    assert [s.split()[1] for s in steps] == (["torch.distributed.run", "bench.tp_decode", "torch.distributed.run",
                                              "runtime.app.make_checkpoint", "bench.tp_decode", "torch.distributed.run",
                                              "bench.tp_decode", "torch.distributed.run"]
                                             + ["bench.tp_decode"] * 3 + ["import"]), steps
    assert "FAILED" not in p.stdout and "skipped" not in p.stdout, p.stdout[-3000:]
    tables = [json.loads(line[len("BENCH_JSON "):]) for line in p.stdout.splitlines() if line.startswith("BENCH_JSON ")]
    assert len(tables) == 4  # the all-reduce sweep, then bf16, fp32 and the wide runs
    rows = [r for t in tables[1:] for r in t["rows"] if r.get("tp") == 2]
    assert len(rows) == 3 and all(r["tokens vs first"].startswith("equal") and r["ranks agree"] for r in rows)
    assert sorted(r["allreduce"] for r in rows) == ["nccl"] * 3  # gloo: auto runs as nccl
    assert any(r["busbw GB/s (peak)"] for r in rows)
    assert "all-reduce crossing" in p.stdout
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == [
        "allreduce_sweep.json", "bf16_tp1.json", "bf16_tp2_nccl.json", "fp32_tp1.json", "fp32_tp2_auto.json",
        "wide_tp1.json", "wide_tp2_auto.json"]


def test_table_prints_the_profiled_step(tmp_path, capsys):
    """`--profile` results (kernel and collective-kernel time per graphed step, the costliest kernels) reach the
    table and its JSON line."""
    from bench import tp_decode

    top = [{"kernel": "ncclDevKernel_AllReduce", "per_step": 33.0, "per_layer": 2.06, "us_per_step": 510.0,
            "share": 0.12}]
    files = []
    for tp in (1, 2):
        batch = {"decode_tok_s": 100.0 * tp, "coll_ms_per_step": 1.0, "coll_bytes_per_step": 2048.0,
                 "profile": {"kernel_us_per_step": 4000.0, "collective_us_per_step": 500.0 * (tp - 1),
                             "other_us_per_step": 4000.0 - 500.0 * (tp - 1), "top": top}}
        doc = {"tp": tp, "moe": "tp", "allreduce": "nccl", "dtype": "bfloat16", "backend": "triton_mla",
               "device": "cpu", "batches": {"32": batch}, "outputs": {}, "margins": {}, "sweep": [],
               "ranks_agree": True}
        files.append(tmp_path / f"r{tp}.json")
        files[-1].write_text(json.dumps(doc))
    assert tp_decode.table([str(f) for f in files]) == 0
    out = capsys.readouterr().out
    doc = json.loads(next(line for line in out.splitlines() if line.startswith("BENCH_JSON "))[len("BENCH_JSON "):])
    row = doc["rows"][1]
    assert row["kernels ms/step b32"] == 4.0 and row["coll kernels ms/step b32"] == 0.5
    assert "costliest kernels per decode step" in out and "ncclDevKernel_AllReduce" in out
