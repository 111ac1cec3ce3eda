#!/usr/bin/env bash
# DeepSeek-V4 on one GPU of a device machine, in parts (several in one call: scripts/v4_device.sh tests profile):
#   tests    # the GPU tests of V4's fused decoder ops (RoPE tail, routing, SwiGLU, compressor, mHC, fp4 experts, norms)
#            # and of the stored (fp8 + fp4) V4 model, graphed against eager
#   model    # tests/test_dsv4_gpu.py: the tiny V4 models end to end (torch / Triton impls, graphed decode)
#   profile  # 4 layers of V4-Flash in its release format, graphed decode at batch 1 and 32 under torch.profiler
#   fp4      # the fp4 expert kernels against the bf16 path, with the microscaled (tl.dot_scaled) candidates
#            # (bench.fp4_moe_bench --mx: decode 1 / 4 / 16 tokens, batch-32 decode, prefill 512 / 4096)
#   parity   # 4 layers of V4-Flash against the float32 reference on the same weights: fp8 matrices + fp4 experts
#            # (w8a16) and bf16 weights, 16 chat requests each (scripts/fp8_parity_device.sh, one table)
# Logs go to $OUT (or /tmp); each part has its own time limit (T_<part> seconds) so one slow part does not take the
# others. PYTHON: the interpreter (default python3 from PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp}
[ $# -gt 0 ] || { echo "usage: scripts/v4_device.sh tests|model|profile|fp4|parity ..." >&2; exit 2; }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
# shellcheck source=scripts/step.sh
source scripts/step.sh  # step NAME SECONDS CMD...
for part in "$@"; do
  case "$part" in
    tests)
      step v4_tests "${T_tests:-300}" "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_rope_tail.py \
        tests/test_v4_route.py tests/test_compress_decode.py tests/test_hc_mix.py tests/test_fp4_moe.py \
        tests/test_decoder_ops.py tests/test_dsv4_stored_gpu.py ;;
    model)
      step v4_model "${T_model:-300}" "$py" -m pytest -q -m gpu -p no:cacheprovider --durations=5 \
        tests/test_dsv4_gpu.py ;;
    profile)
      TAIL=2 step v4_profile "${T_profile:-200}" "$py" -m bench.tp_decode --preset deepseek_v4_flash --layers 4 \
        --backend dsv4 --batches 1 32 --prompt 256 --out-len 16 --graphs --profile --out "$out/v4_profile.json" \
        model.weights=fp8 model.fp8_compute=w8a16
      [ -f "$out/v4_profile.json" ] && "$py" -m bench.tp_decode --table "$out/v4_profile.json" | grep -v BENCH_JSON ;;
    fp4)
      TAIL=40 step v4_fp4 "${T_fp4:-330}" "$py" -m bench.fp4_moe_bench --tokens ${TOKENS:-1 4 16 32 512 4096} \
        --cases ${CASES:-tp2 tp8 ep8} --no-loop --mx ;;
    parity)
      OUT=$out VARIANTS="w8a16 bf16" LIMIT="${T_parity:-150}" \
        BASE="model=deepseek_v4_flash backend=dsv4 device=cuda workload=chat workload.num_requests=16" \
        scripts/fp8_parity_device.sh ;;
    *) echo "unknown part '$part': expected tests, model, profile, fp4 or parity" >&2; exit 2 ;;
  esac
done
