#!/usr/bin/env bash
# The GPU tests on a device machine, in one of two halves that each fit a 10-minute device call:
#   scripts/device_tests.sh kernels   # kernel-level tests (FlashInfer, Triton, sparse, linear attention, ...)
#   scripts/device_tests.sh engine    # engine end-to-end tests (every preset, graphs, speculative, checkpoints)
# Writes the full log to $OUT/pytest-<half>.log when $OUT is set, and prints pytest's summary last.
set -uo pipefail
cd "$(dirname "$0")/.."
half=${1:?usage: scripts/device_tests.sh kernels|engine}
case "$half" in
  engine) files="tests/test_engine_gpu.py tests/test_hf_parity_gpu.py tests/test_dsa_gpu.py tests/test_blackwell_gpu.py tests/test_dsv4_gpu.py
                 tests/test_overlap_gpu.py" ;;
  kernels) files=$(grep -l "mark.gpu" tests/test_*.py | grep -v -e test_engine_gpu -e test_hf_parity_gpu \
                    -e test_dsa_gpu -e test_blackwell_gpu -e test_overlap_gpu -e test_dsv4_gpu) ;;
  *) echo "unknown half '$half': expected kernels or engine" >&2; exit 2 ;;
esac
log=${OUT:-/tmp}/pytest-$half.log
echo "files: $files"
python3 -m pytest -q -m gpu -p no:cacheprovider $files 2>&1 | tee "$log" | tail -40
