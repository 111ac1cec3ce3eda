#!/usr/bin/env bash
# DeepSeek-V4-Flash, the whole model (43 layers, 256 experts), in its release format (fp8 matrices, fp4 routed
# experts; random weights generated on the device, no checkpoint), parallel.tp=2 on two GPUs of 141 GB (H200: a
# rank holds ~78 GB of weights): decode tokens/s at batch 1 and 32 (prompt 256, 32 out, decode CUDA graphs),
# peak memory per rank, and the ranks' tokens compared. First (TESTS=0 skips it) the V4 GPU tests on one GPU.
#   OUT=$OUT scripts/v4_tp2_device.sh          (kind nvidia-h200-x2, needs_h200)
# GRAPHS=0: eager decode. LAYERS: fewer layers (a smoke run). The model launch is capped at T seconds (420); once it
# has written its results it gets 15 s to exit (its process-group shutdown has hung after a graphed run) and is
# then stopped.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ "${TESTS:-1}" = 1 ]; then
  echo "=== V4 GPU tests"
  tests=$(ls tests/test_dsv4_gpu.py tests/test_dsv4_stored_gpu.py tests/test_fp4_moe.py tests/test_hc_mix.py \
    tests/test_compress_decode.py \
    2>/dev/null)
  timeout "${TEST_T:-240}" "$py" -m pytest -q -m gpu -p no:cacheprovider $tests 2>&1 | tail -6
fi
graphs=--graphs; [ "${GRAPHS:-1}" = 0 ] && graphs=--no-graphs
res="$out/v4_flash_tp2.json"
rm -f "$res"
echo "=== V4-Flash ${LAYERS:-43} layers, fp8 + fp4 experts, tp=2 ($graphs)"
"$py" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29631 \
  -m bench.tp_decode --out "$res" --preset deepseek_v4_flash --layers "${LAYERS:-43}" \
  --backend dsv4 --batches 1 32 --prompt 256 --out-len 32 $graphs model.weights=fp8 >"$out/v4_flash_tp2.log" 2>&1 &
pid=$!
for _ in $(seq 1 "${T:-420}"); do
  sleep 1
  kill -0 "$pid" 2>/dev/null || break
  if [ -f "$res" ]; then
    sleep 15
    if kill -0 "$pid" 2>/dev/null; then echo "=== results written; the launch did not exit in 15 s: stopped"; fi
    break
  fi
done
if kill -0 "$pid" 2>/dev/null; then kill "$pid"; sleep 3; pkill -9 -f "bench.tp_decode" 2>/dev/null; fi
wait "$pid" 2>/dev/null
grep -v "^\[rank\|Warning\|warn(" "$out/v4_flash_tp2.log" | tail -n 12
[ -f "$res" ] && "$py" -m bench.tp_decode --table "$res" | grep -v BENCH_JSON \
  && "$py" -c "import json,sys; r=json.load(open(sys.argv[1])); print('build s', r['build_s'], 'peak GiB/rank', \
r.get('peak_gib_per_rank'), {b: round(v['step_ms'], 2) for b, v in r['batches'].items()})" "$res"
exit 0
