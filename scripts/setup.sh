#!/usr/bin/env bash
# All the set-up a fresh machine needs; quick no-op when already done. Called by `make run` / `make test`.
# torch is installed first and pinned to the CPU build when absent: a plain `torch` requirement would pull
# several GB of CUDA wheels on a CPU machine. On a GPU host, install the CUDA build of torch before this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -f .setup-stamp ] && [ .setup-stamp -nt pyproject.toml ] && $PY -c "import torch, hydra, dependency_injector, runtime" 2>/dev/null; then
  exit 0
fi
if ! $PY -c "import torch" 2>/dev/null; then
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e ".[dev]"
touch .setup-stamp
