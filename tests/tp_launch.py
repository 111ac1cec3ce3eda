"""Launch ``python -m runtime`` under torchrun (``torch.distributed.run``) from a test: N CPU processes over gloo."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str, out_dir: Path, nproc: int = 2, module: str = "runtime",
             timeout: int = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m module args hydra.run.dir=out_dir`` on this machine's CPU."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
    if module == "runtime":
        cmd.append(f"hydra.run.dir={out_dir}")
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def report_outputs(out_dir: Path) -> tuple[dict, dict[int, list[int]]]:
    """The report and its output ids by request id."""
    rep = json.loads((Path(out_dir) / "report.json").read_text())
    return rep, {o["rid"]: o["output_ids"] for o in rep["outputs"]}
