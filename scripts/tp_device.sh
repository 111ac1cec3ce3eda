#!/usr/bin/env bash
# Tensor parallelism on 2 GPUs, in one device call (kind nvidia-h200-x2; about 5-7 minutes):
#   1. a random DeepSeek-V3-shaped checkpoint: real widths (hidden 7168, 128 heads, q LoRA 1536, dense MLP 18432,
#      experts 2048 wide, 1 shared, top-8 of 4 of 8 groups, YaRN), 2 layers (1 dense + 1 MoE), 64 routed experts
#      (of the real 256, to keep the write and the three loads short), block-fp8 weights as the release has them
#      (so every rank dequantises its own slices);
#   2. bf16, triton_mla (BACKEND=flashinfer_mla to switch; its cold JIT builds cost minutes), decode CUDA graphs
#      (the NCCL collectives captured), overlap on: tp=1, then torchrun
#      tp=2 with parallel.moe=tp (plus the all_reduce bus-bandwidth sweep in the same process group) and moe=ep;
#      decode tokens/s at batch 1 and 32, collectives per decode step (count, KiB, ms by probe), and token parity
#      against tp=1 (requests that differ, and how many first differ at a near-tie);
#   3. float32, torch_mla, no graphs: tp=1, tp=2 moe=tp, tp=2 moe=ep: tokens must be equal (the ranks' partial
#      sums are added in another order, so only a near-tie could flip a token);
#   4. the two tables (bench/tp_decode.py --table), results also under $OUT.
# On the device machine, from the repository root:  OUT=$OUT/tp scripts/tp_device.sh
# Each launch is capped at T seconds and the script skips what would start after DEADLINE seconds (540), so the
# tables always print within one 10-minute device call. A graphed tp run that fails is retried once without graphs.
# SMOKE=1: the same steps on the CPU (gloo) with a tiny model of the same structure, to check the script runs.
# PYTHON: the interpreter every step runs (default python3 from PATH; the tests pass their own, sys.executable).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tp_device}            # the run files (JSON); the checkpoint stays out of it (CKPT)
mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/tp_ckpt}
NPROC=${NPROC:-2}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
port=$((29500 + RANDOM % 1000))

if [ "${SMOKE:-0}" = 1 ]; then
  # heads 8: NPROC up to 8 divides every sharded width (SMOKE=1 NPROC=8 is the 8-rank gloo check); the fp8
  # weights stay fp8 (model.weights=stored), so q LoRA and the intermediates cut on whole 128-blocks up to 8 ranks
  MODEL="model.hidden_size=256 model.num_heads=8 model.q_lora_rank=128 model.intermediate_size=1024
         model.moe_intermediate_size=1024 model.n_routed_experts=16 model.vocab_size=512 model.dtype=float32"
  DEV=cpu; BF16="--dtype float32 --backend torch_mla --no-graphs"; SIZES="--batches 1 4 --prompt 16 --out-len 4"
  FP32SIZES="--batches 4 --prompt 16 --out-len 4"; SWEEP_MAX=$((1 << 20)); T=120
else
  MODEL="model.n_routed_experts=64"
  DEV=cuda; BF16="--dtype bfloat16 --backend ${BACKEND:-triton_mla} --graphs"
  SIZES="--batches 1 32 --prompt 256 --out-len 32"
  FP32SIZES="--batches 16 --prompt 128 --out-len 16"; SWEEP_MAX=$((256 << 20)); T=${T:-200}
fi

DEADLINE=${DEADLINE:-540}
step() { echo; echo "=== $* ($(date +%T), ${SECONDS}s)"; }
left() {  # seconds this launch may take; 0 once past the deadline
  local l=$((DEADLINE - SECONDS)); [ $l -gt "$T" ] && l=$T; [ $l -lt 0 ] && l=0; echo $l
}
one() {
  local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped: past the deadline"; return 124; }
  timeout "$l" "$PY" -m bench.tp_decode --device $DEV --model-path "$CKPT" "$@"
}
many() {
  local l; l=$(left); [ "$l" -lt 20 ] && { echo "skipped: past the deadline"; return 124; }
  port=$((port + 1))
  timeout "$l" "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1 \
    --master-port $port -m bench.tp_decode --device $DEV --model-path "$CKPT" "$@"
}

step "checkpoint -> $CKPT"
if [ ! -f "$CKPT/config.json" ]; then
  # shellcheck disable=SC2086
  timeout "$T" "$PY" -m runtime.app.make_checkpoint model=deepseek_v3 model.num_layers=2 \
    model.first_k_dense_replace=1 $MODEL device=$DEV out="$CKPT" fp8=true || { echo "checkpoint FAILED"; exit 1; }
fi
du -sh "$CKPT"
[ "$DEV" = cuda ] && nvidia-smi topo -m 2>/dev/null | head -4

step "bf16 speed and parity: tp=1"
# shellcheck disable=SC2086
one --out "$OUT/bf16_tp1.json" $BF16 $SIZES || echo "bf16 tp=1 FAILED ($?)"
step "bf16: tp=$NPROC moe=tp, with the all_reduce sweep"
# shellcheck disable=SC2086
if ! many --out "$OUT/bf16_tp${NPROC}_moe_tp.json" $BF16 $SIZES --moe tp --sweep --sweep-max $SWEEP_MAX; then
  echo "bf16 tp=$NPROC moe=tp FAILED; once more without CUDA graphs"
  # shellcheck disable=SC2086
  many --out "$OUT/bf16_tp${NPROC}_moe_tp_nographs.json" $BF16 --no-graphs $SIZES --moe tp --sweep \
    --sweep-max $SWEEP_MAX || echo "bf16 tp=$NPROC moe=tp without graphs FAILED ($?)"
fi
step "bf16: tp=$NPROC moe=ep"
# shellcheck disable=SC2086
many --out "$OUT/bf16_tp${NPROC}_moe_ep.json" $BF16 $SIZES --moe ep || echo "bf16 tp=$NPROC moe=ep FAILED ($?)"

FP32="--dtype float32 --backend torch_mla --no-graphs"
step "float32 exact parity: tp=1"
# shellcheck disable=SC2086
one --out "$OUT/fp32_tp1.json" $FP32 $FP32SIZES || echo "fp32 tp=1 FAILED ($?)"
for moe in tp ep; do
  step "float32: tp=$NPROC moe=$moe"
  # shellcheck disable=SC2086
  many --out "$OUT/fp32_tp${NPROC}_moe_$moe.json" $FP32 $FP32SIZES --moe $moe || echo "fp32 moe=$moe FAILED ($?)"
done

step "tables"
for kind in bf16 fp32; do
  files=$(ls "$OUT"/${kind}_tp1.json "$OUT"/${kind}_tp"${NPROC}"_*.json 2>/dev/null)
  # shellcheck disable=SC2086
  [ -n "$files" ] && "$PY" -m bench.tp_decode --table $files
done
