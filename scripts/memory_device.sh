#!/usr/bin/env bash
# The memory plan on a GPU (docs/memory.md), in one device call: each case runs `python -m runtime`, then one table
# prints its exit code, the page count the plan chose, the predicted peak against the allocator's measured peak,
# retractions, out-of-memory events and parity (or why it was skipped / refused).
#   scripts/memory_device.sh          # DeepSeek-V3 (h100_dsv3_tp8) auto / fixed / parity, oversized refusals
#   scripts/memory_device.sh v4       # the README's V4-Flash command with workload=chat and check=reference (the
#                                     # default): parity, or a clear skip where the float32 reference cannot fit
# Each part is meant for one device call (under 10 minutes; FlashInfer's first JIT builds take a few minutes).
# Reports and logs go to $OUT (or /tmp/memory_device). PYTHON: the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${OUT:-/tmp/memory_device}
mkdir -p "$out"
if [ "${1:-}" = v4 ]; then
  cases=("v4_flash_chat|model=deepseek_v4_flash backend=dsv4 device=cuda workload=chat")
else
  cases=(
    "dsv3_auto|+deploy=h100_dsv3_tp8 kv.num_pages=auto check=off"
    "dsv3_fixed_4096|+deploy=h100_dsv3_tp8 check=off"
    "dsv3_auto_parity|+deploy=h100_dsv3_tp8 kv.num_pages=auto workload.num_requests=16"
    "oversized|+deploy=h100_dsv3_tp8 kv.num_pages=10000000"
    "cpu_oversized|device=cpu kv.num_pages=100000000"
  )
fi
for c in "${cases[@]}"; do
  name=${c%%|*}; args=${c#*|}
  start=$(date +%s)
  # shellcheck disable=SC2086
  $PY -m runtime $args progress=false "hydra.run.dir=$out/$name" >"$out/$name.log" 2>&1
  echo "$? $(( $(date +%s) - start ))" >"$out/$name.rc"
done
$PY - "$out" "${cases[@]}" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
G = 1 << 30
print(f"{'case':<18} {'rc':>3} {'s':>5} {'pages':>8} {'tokens':>9} {'free GiB':>9} {'pred GiB':>9} {'meas GiB':>9} "
      f"{'retr':>5} {'queued':>6} {'oom':>4}  parity / message")
for c in sys.argv[2:]:
    name = c.split("|")[0]
    rc, secs = (out / f"{name}.rc").read_text().split()
    rep = out / name / "report.json"
    log = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()
    if rep.exists():
        r = json.loads(rep.read_text())
        p, q = r["memory"]["plan"], r["requests"]
        par = r["parity"]
        verdict = ("skipped: " + par["skipped"][:90]) if par.get("skipped") else (
            "off" if par.get("ok") is None else f"ok={par['ok']} mismatches={par['mismatches']} "
            f"rel={par['max_rel_err']:.1e}")
        print(f"{name:<18} {rc:>3} {secs:>5} {p['num_pages']:>8} {p['tokens']:>9} {p['free'] / G:>9.2f} "
              f"{p['peak_bytes'] / G:>9.2f} {p['measured_peak_bytes'] / G:>9.2f} {q['retracted']:>5} "
              f"{q['queued_for_memory']:>6} {len(r.get('oom_events', [])):>4}  {verdict}")
    else:
        msg = next((l for l in log if "refused" in l or "Error" in l), log[-1] if log else "")
        print(f"{name:<18} {rc:>3} {secs:>5} {'-':>8} {'-':>9} {'-':>9} {'-':>9} {'-':>9} {'-':>5} {'-':>6} {'-':>4}  "
              f"{msg[:110]}")
        for l in log[1:4]:
            print(f"{'':<18}      {l[:150]}")
EOF
if [ "${1:-}" != v4 ]; then  # the GPU tests of the plan (tests/test_memory_plan_gpu.py)
  $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_memory_plan_gpu.py 2>&1 | tail -4
fi
