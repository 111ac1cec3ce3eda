"""Several ``python -m runtime`` runs in the ranks of one torchrun launch (``tests/tp_launch.py:run_tp2_scenarios``
starts it): ``torchrun --nproc-per-node 2 tests/tp_scenarios.py SPEC``.

Starting a launch costs ~9 s on two CPU cores (the launcher's and both ranks' imports), more than a tiny run does,
so a test module's tp=2 runs share one. SPEC (JSON): ``{"status_dir": DIR, "scenarios": [{"name", "args", "dir"}]}``.
Each scenario executes ``runtime/__main__.py`` as ``python -m runtime`` does (``runpy``, ``__name__ ==
"__main__"``) with ``sys.argv = [runtime, *args, hydra.run.dir=dir]``; every rank then appends ``{"name", "code"}`` to
``DIR/rank<R>.jsonl``. A run that exits non-zero or raises ends the launch there (the other rank may be waiting in a
collective: torchrun stops it), so the later scenarios are reported as not run.

One process group serves every scenario: the CLI ends it after a run (``runtime.app.cli.shutdown``), but a second
gloo rendezvous on torchrun's store reads the first one's stale addresses, so here it is ended once, after the last
scenario (the parity reference and the speculative baseline already build further runtimes on one group).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _exit_code(e: SystemExit) -> int:
    """What the interpreter exits with for ``e`` (a message is printed to stderr and gives 1)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def run_scenario(args: list[str], run_dir: str) -> int:
    """``python -m runtime *args hydra.run.dir=run_dir`` in this process: its exit code."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    argv = sys.argv
    sys.argv = ["runtime", *args, f"hydra.run.dir={run_dir}"]
    try:
        runpy.run_module("runtime", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        return _exit_code(e)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.argv = argv


def main(spec_path: str) -> int:
    sys.path[0] = str(ROOT)  # this script's folder -> the project root, as `python -m runtime` from there has it
    from runtime.app import cli
    from runtime.core.parallel import shutdown

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", 0))
    status = Path(spec["status_dir"]) / f"rank{rank}.jsonl"
    cli.shutdown = lambda: None  # the group outlives each run (module docstring); ended below
    try:
        for s in spec["scenarios"]:
            print(f"### scenario {s['name']}: start (rank {rank})", flush=True)
            print(f"### scenario {s['name']}: start (rank {rank})", file=sys.stderr, flush=True)
            code = run_scenario(s["args"], s["dir"])
            with status.open("a") as f:
                f.write(json.dumps({"name": s["name"], "code": code}) + "\n")
            print(f"### scenario {s['name']}: exit {code} (rank {rank})", file=sys.stderr, flush=True)
            if code:
                return code
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
