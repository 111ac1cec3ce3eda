#!/usr/bin/env bash
# Issue 49's serving goals on one GPU (16 layers of h100_dsv3_tp8, random weights, the server in its own process,
# warmed), each run against the offline engine on the same requests, printing its table and the goal ratios:
#   one    the low-rate TTFT, one request at a time (--max-concurrency 1, 2 req/s, 32 prompts)
#   rates  RATES (default 2 8 inf) req/s, 64 prompts: TTFT, ITL and throughput against the offline figures
#   sat    saturation: 256 requests of 512 in / 128 out at once (a run long enough for a steady state)
#   PARTS="one sat" LIMIT=280 OUT=/tmp scripts/serving_device.sh
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp}
serve=(--serve +deploy=h100_dsv3_tp8 model.num_layers=16 check=off --offline)
run() {  # name, then bench.serving arguments
  local name=$1; shift
  echo "=== $name: $*"
  timeout "${LIMIT:-280}" "$py" -m bench.serving "${serve[@]}" "$@" >"$out/serving_$name.log" 2>&1
  echo "=== exit $?"
  grep -v BENCH_JSON "$out/serving_$name.log" | tail -n 16
}
for part in ${PARTS:-one rates}; do
  case "$part" in
    one) run one_at_a_time --request-rate 2 --max-concurrency 1 --num-prompts 32 ;;
    rates) run rates --request-rate ${RATES:-2 8 inf} ;;
    sat) run saturation --request-rate inf --num-prompts 256 --input-len 512 --output-len 128 ;;
    *) echo "unknown part '$part': expected one, rates or sat" >&2; exit 2 ;;
  esac
done
