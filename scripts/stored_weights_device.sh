#!/usr/bin/env bash
# Stored-precision (block-fp8) weights on a GPU device machine, in two parts that each fit a 10-minute call:
#   scripts/stored_weights_device.sh kernels   # the fp8 GEMM / MoE kernels' GPU tests, then both kernel benches
#   scripts/stored_weights_device.sh tune      # sweeps of the few-row tiles (linear, experts)
#   scripts/stored_weights_device.sh tiled     # the tiled W8A8 GEMM's tiles at M (default 4096), TMA variants too
#   scripts/stored_weights_device.sh serve     # the fp8 preset end to end (parity), then decode_roofline bf16 vs fp8
#   scripts/stored_weights_device.sh fulldepth # one TP8 rank of DeepSeek-V3 at all 61 layers, fp8 (an H200: ~78 GB
#                                              # of weights): the chat workload served over HTTP at 1 / 32 / 128
#                                              # requests in flight, then decode_roofline 1/32/128 (ROOFLINE=0: not)
# Logs go to $OUT (or /tmp); each step has its own time limit so one slow step does not take the others.
# PYTHON: the interpreter (default python3 from PATH).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp}
part=${1:?usage: scripts/stored_weights_device.sh kernels|tune|tiled|serve|fulldepth}
# shellcheck source=scripts/step.sh
source scripts/step.sh  # step NAME SECONDS CMD...
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
case "$part" in
  kernels)
    step tests 200 "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gemm.py tests/test_fp8_moe.py
    step gemm 150 "$py" -m bench.fp8_gemm_bench --m 1,4,16,32,64,4096
    step moe 150 "$py" -m bench.fp8_moe_bench --no-libs --tokens 1 16 64 512 4096
    ;;
  tune)  # the few-row tiles of the fp8 linear and expert kernels
    step sweep_gemm 240 "$py" -m bench.fp8_gemm_bench --no-libs --m 1 --shapes gate_up,o_proj,qkv_a --sweep
    step sweep_moe 150 "$py" -m bench.fp8_moe_bench --no-libs --tokens 1 --sweep
    ;;
  tiled)  # the tiled W8A8 GEMM's tiles at prefill rows (TMA and warp-specialized variants included), FlashInfer beside
    step tests 150 "$py" -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gemm.py -k "tma or graph or tp8"
    step sweep_tiled "${SWEEP_S:-400}" "$py" -m bench.fp8_gemm_bench --path w8a8 --m "${M:-4096}" \
      --shapes "${SHAPES:-qkv_a,gate_up}" --sweep
    ;;
  serve)
    step e2e 200 "$py" -m runtime +deploy=h100_triton_tp8 model.weights=fp8 workload.num_requests=16
    step roofline 330 "$py" -m bench.decode_roofline --preset h100_triton_tp8 --layers 16 --batches 1 32 \
      --weights bf16 fp8
    ;;
  fulldepth)  # issue 46's first decode figure of a real deployment's rank: 61 layers, 256 experts (moe=tp slices).
    # The chat workload served over HTTP at 1 / 32 / 128 requests in flight (bench.serving, one server build), then
    # decode_roofline 1/32/128 (ROOFLINE=0 skips it).
    step chat "${CHAT_S:-540}" "$py" -m bench.serving --num-prompts 256 --input-len 1024 --output-len 128 \
      --range-ratio 0.5 --max-concurrency 1 32 128 --waves 2 --server-dir "$out/chat_server" \
      --serve +deploy=h100_triton_tp8 model.weights=fp8 \
      model.num_layers=61 check=off workload.max_running_requests=128 \
      "graph.batch_sizes=[1,2,4,8,16,32,64,128]"
    [ "${ROOFLINE:-1}" = 0 ] && exit 0
    step roofline 330 "$py" -m bench.decode_roofline --preset h100_triton_tp8 --layers 61 --batches 1 32 128 \
      --out-len 16 --weights fp8
    ;;
  *) echo "unknown part '$part': expected kernels, tune, tiled, serve or fulldepth" >&2; exit 2 ;;
esac
