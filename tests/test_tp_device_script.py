"""scripts/tp_device.sh (the 2-GPU tensor-parallel run) starts and finishes on the CPU: ``SMOKE=1`` runs its steps
with gloo and a tiny model of the same structure (fp8 checkpoint, tp=1 / tp=2 moe=tp with the all_reduce sweep /
moe=ep, float32 parity) and prints both tables with equal tokens. Every step runs the test's own interpreter
(``PYTHON``): the ``python3`` on PATH is a stub that fails, as a system python without torch would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _executable(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return str(path)


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
    assert [s.split()[1] for s in steps] == (["runtime.app.make_checkpoint"] + ["bench.tp_decode"]
                                             + ["torch.distributed.run"] * 2 + ["bench.tp_decode"]
                                             + ["torch.distributed.run"] * 2 + ["bench.tp_decode"] * 2), steps
    assert "FAILED" not in p.stdout and "skipped" not in p.stdout, p.stdout[-3000:]
    tables = [line for line in p.stdout.splitlines() if line.startswith("BENCH_JSON ")]
    assert len(tables) == 2
    rows = [r for t in tables for r in json.loads(t[len("BENCH_JSON "):])["rows"] if r.get("tp") == 2]
    assert len(rows) == 4 and all(r["tokens vs first"].startswith("equal") and r["ranks agree"] for r in rows)
    assert any(r["busbw GB/s (peak)"] for r in rows)
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == [
        "bf16_tp1.json", "bf16_tp2_moe_ep.json", "bf16_tp2_moe_tp.json", "fp32_tp1.json", "fp32_tp2_moe_ep.json",
        "fp32_tp2_moe_tp.json"]
