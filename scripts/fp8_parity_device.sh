#!/usr/bin/env bash
# Parity of the block-fp8 preset on a GPU (issue 46), variant by variant, one table at the end: which precision
# choice the hidden-state error follows. Each variant is `python -m runtime +deploy=h100_triton_tp8 ...` with the
# parity check on (float32 torch reference); its report.json gives the row.
#   scripts/fp8_parity_device.sh                 # fp8 w8a8 / fp8 w8a16 / bf16, 64 chat requests, and 16 requests
#   SEEDS="1234 7" scripts/fp8_parity_device.sh  # the same per weight seed
#   VARIANTS="w8a8 bf16" ...                     # a subset (names below)
#   BASE="model=deepseek_v4_flash backend=dsv4 device=cuda workload=chat workload.num_requests=16" ...
#                                                # another model than the V3 TP8 rank (here V4-Flash, 4 layers:
#                                                # fp8 matrices + fp4 experts against bf16 weights)
# Logs and reports go to $OUT/fp8_parity (or /tmp/fp8_parity). LIMIT: seconds per run (default 240).
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
out=${OUT:-/tmp}/fp8_parity
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
declare -A args=(
  [w8a8]="model.weights=fp8 model.fp8_compute=w8a8"
  [w8a16]="model.weights=fp8 model.fp8_compute=w8a16"
  [bf16]="model.weights=bf16"
  [w8a8_16req]="model.weights=fp8 model.fp8_compute=w8a8 workload.num_requests=16"
)
for seed in ${SEEDS:-1234}; do
  for v in ${VARIANTS:-w8a8 w8a16 bf16 w8a8_16req}; do
    dir=$out/${v}_seed$seed
    start=$(date +%s)
    # shellcheck disable=SC2086
    timeout "${LIMIT:-240}" "$py" -m runtime ${BASE:-+deploy=h100_triton_tp8} ${args[$v]} model.weight_seed="$seed" \
      progress=false hydra.run.dir="$dir" >"$out/${v}_seed$seed.log" 2>&1
    echo "$v seed $seed: exit $? in $(( $(date +%s) - start )) s"
  done
done
"$py" - "$out" <<'PY'
import json, sys
from pathlib import Path
print(f"{'variant':<22} {'ok':<5} {'max rel':>8} {'median':>8} {'worst req@pos':>14} {'pos err':>8} {'flips':>9} "
      f"{'prefill tok/s':>13} {'decode tok/s':>12}")
for rep in sorted(Path(sys.argv[1]).glob("*/report.json")):
    r = json.loads(rep.read_text())
    p, ph = r["parity"], r["phases"]
    if not p.get("reference"):
        print(f"{rep.parent.name:<22} parity {p}")
        continue
    print(f"{rep.parent.name:<22} {str(p['ok']):<5} {p['max_rel_err']:8.2e} {p['median_rel_err']:8.2e} "
          f"{str(p['worst_request']) + '@' + str(p['worst_position']):>14} {p['worst_position_rel_err']:8.2e} "
          f"{p['mismatches']:>4}/{p['near_tie_mismatches']:<4} {ph['prefill']['tokens_per_s']:13.0f} "
          f"{ph['decode']['tokens_per_s']:12.0f}")
PY
