#!/usr/bin/env bash
# Time to first token of long prompts on deepseek_v32 (4 layers, dsa backend), HiSparse on and off (issue 48):
# bench.serving self-hosts python -m runtime.serve with +deploy=h100_dsa_hisparse, sends LENS-token prompts one
# at a time (--max-concurrency 1) after an untimed warm-up, and prints TTFT p50 against the server's own mean.
#   LENS="32768 131072" HISPARSE="dsa_2048 off" LIMIT=150 OUT=/tmp scripts/sparse_ttft_device.sh
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
for len in ${LENS:-32768 131072}; do
  for hs in ${HISPARSE:-dsa_2048 off}; do
    log="$out/ttft_${len}_${hs}.log"
    echo "=== prompt $len, hisparse=$hs"
    timeout "${LIMIT:-150}" "$py" -m bench.serving --serve +deploy=h100_dsa_hisparse "hisparse=$hs" check=off \
      workload=long_context workload.chunked_prefill_size=8192 workload.max_tokens_per_batch=8192 \
      workload.max_running_requests=2 kv.max_requests=4 kv.num_pages=4500 "graph.batch_sizes=[1,2]" \
      model.max_context=$((len + 1024)) \
      --num-prompts 2 --input-len "$len" --output-len 4 --max-concurrency 1 >"$log" 2>&1
    echo "=== exit $?"
    grep -v BENCH_JSON "$log" | tail -n 8
  done
done
