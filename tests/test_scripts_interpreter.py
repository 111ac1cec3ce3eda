"""Every script under scripts/ runs the interpreter it is given (``PYTHON``, default ``python3``), never a bare
``python3`` from PATH: ``VENV/bin/python -m pytest`` from a virtualenv that is not activated must reach the same
torch in every process a test starts (tests pass ``PYTHON=sys.executable``, or call ``sys.executable`` directly)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))
# an interpreter called by name: python, python3, python3.11 as a command word (not inside ${PYTHON:-python3})
BARE = re.compile(r"(?<![\w/:.-])python[\d.]*(?=\s)")


def bare_python_lines(text: str) -> list[str]:
    """The lines of a shell script that call ``python``/``python3`` from PATH (comments aside)."""
    out = []
    for line in text.splitlines():
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#!") else ""
        if BARE.search(code.replace("${PYTHON:-python3}", "")):
            out.append(line.strip())
    return out


def test_checker_finds_a_bare_python():
    assert bare_python_lines('timeout 5 python3 -m bench.x\n[ -n "$f" ] && python -c 1\n') == [
        "timeout 5 python3 -m bench.x", '[ -n "$f" ] && python -c 1']
    assert bare_python_lines('# python3 -m x\nPY=${PYTHON:-python3}\n"$PY" -m x\n"${PYTHON:-python3}" -m y\n') == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_calls_no_python_from_path(script):
    bad = bare_python_lines(script.read_text())
    assert not bad, f"{script.name} calls python from PATH; use ${{PYTHON:-python3}}:\n" + "\n".join(bad)


def test_device_tests_script_runs_the_given_interpreter(tmp_path):
    """scripts/device_tests.sh hands pytest to ``PYTHON`` (a stub here that records its arguments)."""
    used = tmp_path / "used.log"
    stub = tmp_path / "python"
    stub.write_text(f'#!/bin/sh\necho "$*" >> "{used}"\necho "1 passed"\n')
    stub.chmod(0o755)
    env = dict(os.environ, PYTHON=str(stub), OUT=str(tmp_path))
    p = subprocess.run(["bash", "scripts/device_tests.sh", "engine"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert used.read_text().split()[:5] == ["-m", "pytest", "-v", "-m", "gpu"]
    assert "tests/test_engine_gpu.py" in used.read_text()


def test_make_test_runs_pytest_with_the_given_interpreter():
    """``make test PY=...``: pytest runs under PY, so every ``sys.executable`` a test passes on is PY."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    p = subprocess.run(["make", "-n", "test", f"PY={sys.executable}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert f"{sys.executable} -m pytest" in p.stdout and f"PYTHON={sys.executable}" in p.stdout
