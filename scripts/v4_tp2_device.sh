#!/usr/bin/env bash
# DeepSeek-V4-Flash, the whole model (43 layers, 256 experts), in its release format (fp8 matrices, fp4 routed
# experts; random weights generated on the device, no checkpoint), parallel.tp=2 on two GPUs of 141 GB (H200: a
# rank holds ~78 GB of weights): decode tokens/s at batch 1 and 32 (prompt 256, 32 out, decode CUDA graphs),
# peak memory per rank, and the ranks' tokens compared. First (TESTS=0 skips it) the V4 stored-weights GPU test on one
# GPU.   OUT=$OUT scripts/v4_tp2_device.sh          (kind nvidia-h200-x2, needs_h200)
# GRAPHS=0: eager decode. LAYERS: fewer layers (a smoke run). The model launch is capped at T seconds (420).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ "${TESTS:-1}" = 1 ]; then
  echo "=== V4 stored-weights GPU test"
  timeout 240 "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_dsv4_stored_gpu.py 2>&1 | tail -4
fi
graphs=--graphs; [ "${GRAPHS:-1}" = 0 ] && graphs=--no-graphs
echo "=== V4-Flash ${LAYERS:-43} layers, fp8 + fp4 experts, tp=2 ($graphs)"
timeout "${T:-420}" "$py" -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29631 \
  -m bench.tp_decode --out "$out/v4_flash_tp2.json" --preset deepseek_v4_flash --layers "${LAYERS:-43}" \
  --backend dsv4 --batches 1 32 --prompt 256 --out-len 32 $graphs model.weights=fp8 >"$out/v4_flash_tp2.log" 2>&1
echo "=== exit $?"
grep -v "^\[rank\|Warning\|warn(" "$out/v4_flash_tp2.log" | tail -n 12
[ -f "$out/v4_flash_tp2.json" ] && "$py" -m bench.tp_decode --table "$out/v4_flash_tp2.json" | grep -v BENCH_JSON \
  && "$py" -c "import json,sys; r=json.load(open(sys.argv[1])); print('build s', r['build_s'], 'peak GiB/rank', \
r.get('peak_gib_per_rank'), {b: round(v['step_ms'], 2) for b, v in r['batches'].items()})" "$out/v4_flash_tp2.json"
exit 0
