#!/usr/bin/env bash
# Issue 49's serving goals on one GPU (16 layers of h100_dsv3_tp8, random weights, the server in its own process,
# warmed): the low-rate TTFT one request at a time (--max-concurrency 1) and at 2 req/s, against the offline
# engine's one-prompt TTFT, and the ITL / throughput at higher rates. Each run prints its table and goal ratios.
#   RATES="2 8 inf" LIMIT=280 OUT=/tmp scripts/serving_device.sh
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
run one_at_a_time --request-rate 2 --max-concurrency 1 --num-prompts 32
run rates --request-rate ${RATES:-2 8 inf}
