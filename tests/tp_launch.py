"""Launch ``python -m runtime`` under torchrun (``torch.distributed.run``) from a test: N CPU processes over gloo
(one run, or several in the same ranks: :func:`run_tp2_scenarios`); the same workload at tp=1 in this process, and
the token comparison of the two."""

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


def torchrun(*args: str, out_dir: Path, nproc: int = 2, module: str = "runtime", script: Path | None = None,
             timeout: int = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc -m module args hydra.run.dir=out_dir`` on this machine's CPU
    (``torchrun ... script args`` when ``script`` is given)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **MULTICAST_OFF)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), *([str(script)] if script else ["-m", module]), *args]
    if module == "runtime" and script is None:
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


class Scenarios:
    """What :func:`run_tp2_scenarios` launched: :meth:`result` gives one scenario's (report, outputs by rid), or
    fails its test with the launch's output."""

    def __init__(self, out_dir: Path, names: list[str], proc: subprocess.CompletedProcess):
        self.out_dir, self.names, self.proc = out_dir, names, proc
        self.codes: dict[str, dict[int, int]] = {}  # scenario -> rank -> exit code
        for f in sorted((out_dir / "status").glob("rank*.jsonl")):
            for line in f.read_text().splitlines():
                row = json.loads(line)
                self.codes.setdefault(row["name"], {})[int(f.stem.removeprefix("rank"))] = row["code"]

    def _log(self, name: str) -> str:
        """The launch's output from ``name``'s start on rank 0 (which prints the report) on, the ends kept."""
        out = []
        for text in (self.proc.stdout, self.proc.stderr):
            i = text.find(f"### scenario {name}: start (rank 0)")
            text = text[i:] if i >= 0 else text
            out.append(text if len(text) <= 6000 else text[:3000] + "\n[...]\n" + text[-3000:])
        return "\n--- stdout ---\n" + out[0] + "\n--- stderr ---\n" + out[1]

    def ok(self, name: str) -> bool:
        """Both ranks ran ``name`` and exited 0."""
        return self.codes.get(name) == {0: 0, 1: 0}

    def result(self, name: str):
        if not self.ok(name):
            first = next(n for n in self.names if not self.ok(n))
            if first != name and name not in self.codes:
                raise AssertionError(f"scenario {name} did not run: scenario {first} ended the launch first (its "
                                     f"test shows why)")
            raise AssertionError(f"scenario {name}: exit codes by rank {self.codes.get(name)}, launch exit "
                                 f"{self.proc.returncode}" + self._log(name))
        if self.proc.returncode != 0 and all(self.ok(n) for n in self.names):
            raise AssertionError(f"every scenario exited 0 on both ranks, but the launch exited "
                                 f"{self.proc.returncode}" + self._log(self.names[-1]))
        return report_outputs(self.out_dir / name)


def run_tp2_scenarios(out_dir: Path, scenarios: dict[str, tuple[str, ...]], timeout: int = 600) -> Scenarios:
    """Each scenario's ``python -m runtime parallel.tp=2 progress=false *overrides`` in turn, in the 2 ranks of one
    torchrun launch (tests/tp_scenarios.py: the launch's startup, most of a tiny run's time, is paid once); its
    run folder is ``out_dir/<name>``."""
    (out_dir / "status").mkdir(parents=True)
    spec = {"status_dir": str(out_dir / "status"),
            "scenarios": [{"name": n, "args": ["parallel.tp=2", "progress=false", *a], "dir": str(out_dir / n)}
                          for n, a in scenarios.items()]}
    (out_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    proc = torchrun(str(out_dir / "spec.json"), out_dir=out_dir, script=ROOT / "tests" / "tp_scenarios.py",
                    timeout=timeout)
    return Scenarios(out_dir, list(scenarios), proc)
