#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs, in ONE device call of at most 10 minutes (kind nvidia-h100-x2 or nvidia-h200-x2):
#   0. NVLink multicast stays off everywhere: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (exported here;
#      runtime/core/parallel.py sets them again before any process group exists);
#   1. the all-reduce kernels' GPU test (tests/test_allreduce_gpu.py -k kernels: oneshot / fused against NCCL, bf16
#      and fp32, 1..512 tokens, CUDA graphs, a burst of 200 calls);
#   2. the per-mode all-reduce sweep inside CUDA graphs (bench.tp_decode --sweep-only: nccl, nccl+norm, oneshot,
#      fused for 1..512 tokens x 7168 bf16) with the measured NCCL crossing for parallel.oneshot_max_bytes;
#   3. bench.tp_decode on 16 layers of the V3-width preset (random block-fp8 weights, 16 routed experts: batch 1 is
#      weight-bound, the weights fit one GPU), bf16, triton_mla, decode CUDA graphs: tp=1, then tp=2 with
#      parallel.allreduce = nccl, oneshot, fused, auto; decode tokens/s at batch 1 and 32 and the collectives per
#      decode step (count, KiB, ms by probe), and (--profile) the graphed step's kernel and collective-kernel time;
#   4. (time permitting) the 2-layer fp8 checkpoint of the earlier script (64 experts): tp=1 and tp=2 nccl / fused,
#      so issue 47's first table has its after column; then float32 parity of tp=2 fused vs tp=1 on it;
#   5. the tables last (bench/tp_decode.py --table), results also under $OUT.
# On the device machine, from the repository root:  OUT=$OUT/tp scripts/tp_device.sh
# Each launch is capped at T seconds and the script skips what would start after DEADLINE seconds (560), so the
# tables always print within one 10-minute device call.
# PARTS: which of "tests sweep wide ckpt" run (default all; e.g. PARTS="wide ckpt" once the kernels' tests and the
# sweep have run on that kind of machine). T0: the first model launch's cap (default T; the fp8 GEMM library
# compiles its kernels there on a fresh machine, minutes).
# SMOKE=1: the same steps on the CPU (gloo, allreduce nccl / auto: the kernel modes need GPUs) with a tiny model of
# the same structure, to check the script runs. PYTHON: the interpreter every step runs (default python3 from PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tp_device}            # the run files (JSON); the checkpoint stays out of it (CKPT)
mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/tp_ckpt}
NPROC=${NPROC:-2}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # no NVLink multicast, ever
port=$((29500 + RANDOM % 1000))

if [ "${SMOKE:-0}" = 1 ]; then
  # heads 8: NPROC up to 8 divides every sharded width (SMOKE=1 NPROC=8 is the 8-rank gloo check); the fp8
  # weights stay fp8 (model.weights=stored), so q LoRA and the intermediates cut on whole 128-blocks up to 8 ranks
  MODEL="model.hidden_size=256 model.num_heads=8 model.q_lora_rank=128 model.intermediate_size=1024
         model.moe_intermediate_size=1024 model.n_routed_experts=16 model.vocab_size=512 model.dtype=float32"
  DEV=cpu; BF16="--dtype float32 --backend torch_mla --no-graphs"; SIZES="--batches 1 4 --prompt 16 --out-len 4"
  WIDE="--preset deepseek_v3 --layers 2 $MODEL"; MODES="auto"; CKPT_MODES="nccl"  # gloo: every mode is nccl
  FP32SIZES="--batches 4 --prompt 16 --out-len 4"; T=120
else
  MODEL="model.n_routed_experts=64"
  DEV=cuda; BF16="--dtype bfloat16 --backend ${BACKEND:-triton_mla} --graphs"
  SIZES="--batches 1 32 --prompt 256 --out-len 32"
  WIDE="--preset deepseek_v3 --layers 16 model.n_routed_experts=16 model.weights=fp8"; MODES=${MODES:-nccl oneshot fused auto}
  CKPT_MODES="nccl fused"; FP32SIZES="--batches 16 --prompt 128 --out-len 16"; T=${T:-120}
fi

DEADLINE=${DEADLINE:-560}
PARTS=${PARTS:-tests sweep wide ckpt}
part() { [[ " $PARTS " == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date +%T), ${SECONDS}s)"; }
left() {  # seconds this launch may take; 0 once past the deadline
  local l=$((DEADLINE - SECONDS)); [ $l -gt "$T" ] && l=$T; [ $l -lt 0 ] && l=0; echo $l
}
one() {
  local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped: past the deadline"; return 124; }
  timeout "$l" "$PY" -m bench.tp_decode --device $DEV "$@"
}
many() {
  local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped: past the deadline"; return 124; }
  port=$((port + 1))
  timeout "$l" "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1 \
    --master-port $port -m bench.tp_decode --device $DEV "$@"
}

if [ "$DEV" = cuda ] && part tests; then
  nvidia-smi topo -m 2>/dev/null | head -4
  step "GPU tests of the all-reduce modes"
  # the kernels against NCCL (the float32 tp=2 vs tp=1 token runs of that file: step 4 below, on the checkpoint)
  timeout 180 "$PY" -m pytest -q -p no:cacheprovider -x tests/test_allreduce_gpu.py -k kernels 2>&1 | tail -25
fi

if part sweep; then
  step "all-reduce per mode inside CUDA graphs: tp=$NPROC"
  many --sweep-only --out "$OUT/allreduce_sweep.json" || echo "all-reduce sweep FAILED ($?)"
fi

if part wide; then
  step "V3 width, 16 layers: tp=1"
  T_RUN=$T; T=${T0:-$T}
  # shellcheck disable=SC2086
  one --out "$OUT/wide_tp1.json" $BF16 $SIZES $WIDE --profile || echo "wide tp=1 FAILED ($?)"
  T=$T_RUN
  for mode in $MODES; do
    step "V3 width, 16 layers: tp=$NPROC allreduce=$mode"
    # shellcheck disable=SC2086
    many --out "$OUT/wide_tp${NPROC}_$mode.json" $BF16 $SIZES $WIDE --allreduce $mode --profile \
      || echo "wide tp=$NPROC allreduce=$mode FAILED ($?)"
  done
fi

part ckpt && step "checkpoint (2 layers) -> $CKPT"
if part ckpt && [ ! -f "$CKPT/config.json" ]; then
  # shellcheck disable=SC2086
  timeout "$(left)" "$PY" -m runtime.app.make_checkpoint model=deepseek_v3 model.num_layers=2 \
    model.first_k_dense_replace=1 $MODEL device=$DEV out="$CKPT" fp8=true || echo "checkpoint FAILED"
fi
if part ckpt && [ -f "$CKPT/config.json" ]; then
  step "2-layer checkpoint bf16: tp=1"
  # shellcheck disable=SC2086
  one --model-path "$CKPT" --out "$OUT/bf16_tp1.json" $BF16 $SIZES || echo "bf16 tp=1 FAILED ($?)"
  for mode in $CKPT_MODES; do
    step "2-layer checkpoint bf16: tp=$NPROC allreduce=$mode (with the all_reduce bus-bandwidth sweep)"
    # shellcheck disable=SC2086
    many --model-path "$CKPT" --out "$OUT/bf16_tp${NPROC}_$mode.json" $BF16 $SIZES --allreduce $mode \
      $([ $mode = nccl ] && echo "--sweep --sweep-max $((64 << 20))") || echo "bf16 tp=$NPROC $mode FAILED ($?)"
  done
  FP32="--dtype float32 --backend torch_mla --no-graphs"
  step "2-layer checkpoint float32 exact parity: tp=1"
  # shellcheck disable=SC2086
  one --model-path "$CKPT" --out "$OUT/fp32_tp1.json" $FP32 $FP32SIZES || echo "fp32 tp=1 FAILED ($?)"
  step "2-layer checkpoint float32: tp=$NPROC allreduce=auto"
  # shellcheck disable=SC2086
  many --model-path "$CKPT" --out "$OUT/fp32_tp${NPROC}_auto.json" $FP32 $FP32SIZES || echo "fp32 tp=$NPROC FAILED ($?)"
fi

step "tables"
for kind in bf16 fp32 wide; do
  files=$(ls "$OUT"/${kind}_tp1.json "$OUT"/${kind}_tp"${NPROC}"_*.json 2>/dev/null)
  # shellcheck disable=SC2086
  [ -n "$files" ] && "$PY" -m bench.tp_decode --table $files
done
[ -f "$OUT/allreduce_sweep.json" ] && "$PY" -c "import json,sys; r=json.load(open(sys.argv[1])); \
print('all-reduce crossing (NCCL faster from):', r['crossing']); print('fused slower than oneshot + norm from:', r.get('fused_crossing'))" "$OUT/allreduce_sweep.json"
exit 0
