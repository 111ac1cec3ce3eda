"""Several ``python -m runtime ARGS`` runs from one interpreter start: ``python tests/cli_batch.py SPEC OUT``.

Most of a short CLI run (one that stops at a bad input) is the interpreter's start and imports (~5 s), so the
imports happen once here and every run is a forked child of this process: ``runtime/__main__.py`` executed as
``python -m runtime`` executes it (``runpy``, ``__name__ == "__main__"``), its own stdout / stderr (file descriptors
1 and 2, so whatever writes them is caught) and exit code, as the interpreter sets it (a ``SystemExit`` message
printed and 1, an uncaught exception's traceback and 1). SPEC (JSON): ``[{"args": [...], "dir": RUN_DIR}, ...]``,
each run getting ``hydra.run.dir=RUN_DIR``; OUT (JSON): ``[{"returncode", "stdout", "stderr"}, ...]`` in that order.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(args: list[str], out_fd: int, err_fd: int) -> None:
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.argv = ["runtime", *args]
    code = 0
    try:
        runpy.run_module("runtime", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(args: list[str]) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _child(args, out.fileno(), err.fileno())
            finally:
                os._exit(70)  # not reached unless _child itself failed
        _, status = os.waitpid(pid, 0)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
    return {"returncode": os.waitstatus_to_exitcode(status), "stdout": texts[0], "stderr": texts[1]}


def main(spec_path: str, out_path: str) -> None:
    sys.path[0] = str(ROOT)  # this script's folder -> the project root, as `python -m runtime` from there has it
    # what runtime/__main__.py imports, once (the children inherit it)
    import hydra  # noqa: F401

    import runtime.core.config  # noqa: F401
    from runtime.app import cli  # noqa: F401

    spec = json.loads(Path(spec_path).read_text())
    results = [run([*s["args"], f"hydra.run.dir={s['dir']}"]) for s in spec]
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
