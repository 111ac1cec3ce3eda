"""Launch ``python -m runtime`` under torchrun (``torch.distributed.run``) from a test: N CPU processes over gloo;
the same workload at tp=1 in this process, and the token comparison of the two."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from conftest import compose_config

from containers import build
from runtime.core.parallel import MULTICAST_OFF

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, out_dir: Path, nproc: int = 2, module: str = "runtime",
             timeout: int = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m module args hydra.run.dir=out_dir`` on this machine's CPU."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **MULTICAST_OFF)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
    if module == "runtime":
        cmd.append(f"hydra.run.dir={out_dir}")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def report_outputs(out_dir: Path) -> tuple[dict, dict[int, list[int]]]:
    """The report and its output ids by request id."""
    rep = json.loads((Path(out_dir) / "report.json").read_text())
    return rep, {o["rid"]: o["output_ids"] for o in rep["outputs"]}


def tp1(*overrides: str):
    """The same config at tp=1, in this process: (outputs by rid, greedy margins by rid)."""
    res = build(compose_config(*overrides, "check=off", "progress=false")).engine.run()
    return res.outputs, res.margins


def assert_same_tokens(got: dict, want: dict, margins: dict) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        if got[rid] != want[rid]:
            i = next(j for j, (a, b) in enumerate(zip(got[rid], want[rid])) if a != b)
            raise AssertionError(f"request {rid}: tp=2 {got[rid]} vs tp=1 {want[rid]}; first difference at "
                                 f"position {i}, where tp=1's top-2 margin is {margins[rid][i]:.3e}")


def run_tp2(tmp_path, *overrides: str):
    """``overrides`` at tp=2 under torchrun (a failed run fails the test with its output): (report, outputs by rid)."""
    p = torchrun("parallel.tp=2", "progress=false", *overrides, out_dir=tmp_path / "run")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return report_outputs(tmp_path / "run")
