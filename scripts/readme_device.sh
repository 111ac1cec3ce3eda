#!/usr/bin/env bash
# Every command README.md shows, run on a GPU machine (issue 50: no out-of-memory traceback from any of them), in
# one device call: each line runs with a time limit, then one table prints its exit code, its seconds, whether
# the log holds an out-of-memory error or a traceback, and the log's last line. The "CPU" commands run with
# device=auto, so here on the GPU. The folder commands use a V3 checkpoint written by make_checkpoint (2 layers).
# bench.run_all, torchrun (scripts/tp_device.sh) and the V4-Flash run (scripts/memory_device.sh v4) have their own
# scripts. ONLY=name|name runs those cases alone. LIMIT: seconds per case (default 150; on a fresh machine the
# first FlashInfer and Triton builds take minutes: give the first run 300). Logs go to $OUT/readme (or
# /tmp/readme_device). PYTHON: the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${OUT:-/tmp/readme_device}/readme
LIMIT=${LIMIT:-150}
mkdir -p "$out"
ckpt=$out/ckpt
printf '{"prompt_ids": [3, 1, 4, 1, 5], "max_new_tokens": 8}\n{"prompt_ids": [9, 2, 6], "max_new_tokens": 4}\n' \
  >"$out/prompts.jsonl"
cases=(
  "checkpoint|$PY -m runtime.app.make_checkpoint model=deepseek_v3 model.num_layers=2 device=cuda out=$ckpt fp8=true"
  "hf_flashinfer|$PY -m runtime model=hf model.path=$ckpt backend=flashinfer_mla device=cuda model.dtype=bfloat16"
  "triton_tp8|$PY -m runtime +deploy=h100_triton_tp8"
  "triton_tp8_fp8|$PY -m runtime +deploy=h100_triton_tp8 model.weights=fp8"
  "prompts|$PY -m runtime workload=prompts workload.path=$out/prompts.jsonl model=hf model.path=$ckpt"
  "small_pool|$PY -m runtime +deploy=cpu_small_pool"
  "ring_hybrid|$PY -m runtime model=ring_hybrid_tiny"
  "dsa_hisparse|$PY -m runtime +deploy=cpu_dsa_hisparse"
  "speculative|$PY -m runtime +deploy=cpu_speculative"
  "explain|$PY -m runtime +explain=true"
  "dump_a|$PY -m runtime +dump_dir=$out/dumps/a"
  "dump_b|$PY -m runtime +dump_dir=$out/dumps/b backend=triton_mla"
  "diff|$PY -m runtime.app.diff $out/dumps/a $out/dumps/b"
  "refused|$PY -m runtime hisparse=dsa_2048 hisparse.device_buffer_size=16 kv.num_pages=2"
)
printf '%-15s %4s %5s %4s %5s  %s\n' case rc s oom trace "last line"
for c in "${cases[@]}"; do
  name=${c%%|*}; cmd=${c#*|}
  [[ "$name" =~ ^(${ONLY:-.*})$ ]] || continue
  start=$(date +%s)
  case "$cmd" in *" -m runtime "*) cmd="$cmd progress=false" ;; esac  # the runtime's own key, no progress bar
  # shellcheck disable=SC2086
  (cd "$out" && timeout "$LIMIT" $cmd) >"$out/$name.log" 2>&1
  rc=$?
  oom=$(grep -c "OutOfMemoryError" "$out/$name.log")
  trace=$(grep -c "^Traceback" "$out/$name.log")
  printf '%-15s %4s %5s %4s %5s  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$oom" "$trace" \
    "$(grep -v '^\s*$' "$out/$name.log" | tail -1 | cut -c1-110)"
done
