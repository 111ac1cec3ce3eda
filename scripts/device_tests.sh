#!/usr/bin/env bash
# The GPU tests on a device machine, in one of five parts that each fit a 10-minute device call (where pytest-timeout
# is installed, a test that hangs is stopped after PYTEST_TIMEOUT seconds, default 300, and reported as failed):
#   scripts/device_tests.sh kernels   # kernel-level tests: GEMMs, fp8, decoder ops, FlashInfer, linear attention, V4
#   scripts/device_tests.sh decode    # the MLA decode / extend / sparse Triton and Gluon kernels
#   scripts/device_tests.sh engine    # engine end-to-end tests (every preset, graphs, speculative), HF parity
#   scripts/device_tests.sh serving   # sparse (DSA), Blackwell, DeepSeek-V4 and overlap-scheduler serving tests
#   scripts/device_tests.sh features  # sampling + the HTTP server, the memory plan, V3.2 sparse prefill, fp4 experts
# Writes the full log (one line per test) to $OUT/pytest-<part>.log when $OUT is set, and prints the summary last.
# PYTHON: the interpreter that runs pytest (default python3 from PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: scripts/device_tests.sh kernels|decode|engine|serving|features}
case "$part" in
  engine) files="tests/test_engine_gpu.py tests/test_hf_parity_gpu.py" ;;
  serving) files="tests/test_dsv4_gpu.py tests/test_dsa_gpu.py tests/test_blackwell_gpu.py tests/test_overlap_gpu.py" ;;
  decode) files=$(ls tests/test_mla_decode_*.py tests/test_sparse_kernels.py tests/test_triton_kernels_gpu.py) ;;
  features) files="tests/test_sampling_gpu.py tests/test_memory_plan_gpu.py tests/test_sparse_prefill_kernels.py
                   tests/test_dsa_sparse_prefill.py tests/test_fp4_moe.py" ;;
  kernels) files=$(grep -l "mark.gpu" tests/test_*.py | grep -v -e test_engine_gpu -e test_hf_parity_gpu \
                    -e test_dsa_gpu -e test_blackwell_gpu -e test_overlap_gpu -e test_dsv4_gpu -e test_mla_decode_ \
                    -e test_sparse_kernels -e test_triton_kernels_gpu -e test_sampling_gpu -e test_memory_plan_gpu \
                    -e test_sparse_prefill_kernels -e test_dsa_sparse_prefill -e test_fp4_moe) ;;
  *) echo "unknown part '$part': expected kernels, decode, engine, serving or features" >&2; exit 2 ;;
esac
log=${OUT:-/tmp}/pytest-$part.log
export PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-300}  # read by pytest-timeout: a kernel that never returns fails one test
echo "files: $files"
"${PYTHON:-python3}" -m pytest -v -m gpu -p no:cacheprovider --durations=10 $files 2>&1 | tee "$log" | tail -40
