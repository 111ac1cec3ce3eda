#!/usr/bin/env bash
# The GPU tests on a device machine, in one of three parts that each fit a 10-minute device call:
#   scripts/device_tests.sh kernels   # kernel-level tests (FlashInfer, Triton, sparse, linear attention, ...)
#   scripts/device_tests.sh engine    # engine end-to-end tests (every preset, graphs, speculative), HF parity
#   scripts/device_tests.sh serving   # sparse (DSA), Blackwell, DeepSeek-V4 and overlap-scheduler serving tests
# Writes the full log (one line per test) to $OUT/pytest-<part>.log when $OUT is set, and prints the summary last.
# PYTHON: the interpreter that runs pytest (default python3 from PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: scripts/device_tests.sh kernels|engine|serving}
case "$part" in
  engine) files="tests/test_engine_gpu.py tests/test_hf_parity_gpu.py" ;;
  serving) files="tests/test_dsv4_gpu.py tests/test_dsa_gpu.py tests/test_blackwell_gpu.py tests/test_overlap_gpu.py" ;;
  kernels) files=$(grep -l "mark.gpu" tests/test_*.py | grep -v -e test_engine_gpu -e test_hf_parity_gpu \
                    -e test_dsa_gpu -e test_blackwell_gpu -e test_overlap_gpu -e test_dsv4_gpu) ;;
  *) echo "unknown part '$part': expected kernels, engine or serving" >&2; exit 2 ;;
esac
log=${OUT:-/tmp}/pytest-$part.log
echo "files: $files"
"${PYTHON:-python3}" -m pytest -v -m gpu -p no:cacheprovider $files 2>&1 | tee "$log" | tail -40
