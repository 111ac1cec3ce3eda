"""Run every benchmark, one subprocess each, and summarize (device only).

    python -m bench.run_all --quick              # every bench in its quick mode (one device call)
    python -m bench.run_all --only bench_dsa     # some benches, full size
    python -m bench.run_all --quick --skip profile_engine_step

Each bench runs as ``python -m bench.<name>`` from the repository root, its output streamed through as it
comes; a bench that runs past ``--timeout`` seconds is killed and counted as failed. The FlashInfer bench runs
first so its JIT builds are cached for the others. The end is a table (bench, exit status, seconds, rows in its
``BENCH_JSON`` line) and one line ``RUN_ALL {...}`` with the same; the exit status is 1 if any bench failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import JSON_PREFIX, Table, parse_json_line  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# name -> extra arguments in --quick mode (fa3 only: the fa2 path is the same code, and its JIT build costs a minute)
BENCHES: dict[str, list[str]] = {
    "bench_flashinfer": ["--quick", "--kernels", "fa3"],
    "mla_decode_grid": ["--quick"],
    "triton_mla_kernels_gpu": ["--quick"],
    "gemv_bench": ["--quick"],
    "bench_dsa": ["--quick"],
    "bench_engine_decode": ["--quick"],
    "bench_speculative": ["--quick"],
    "profile_engine_step": ["--quick"],
    "host_step": ["--quick"],  # CPU only: the host side of a decode step, model stubbed
    "decode_roofline": ["--quick", "--overlap", "off", "on"],
    "dsv4_decode_bench": ["--quick"],
    "tp_decode": ["--quick"],  # tp=1 here; tensor parallelism needs torchrun (scripts/tp_device.sh)
    "fp8_gemm_bench": ["--quick"],  # block-fp8 linear layers (model.weights=stored / fp8)
    "fp8_moe_bench": ["--quick"],  # block-fp8 experts
    "fp4_moe_bench": ["--quick"],  # V4's packed fp4 experts
    "dsa_prefill_bench": ["--quick"],  # V3.2 sparse prefill vs dense, one layer (issue 48)
    "prefill_bench": ["--quick"],  # eager prefill of a preset per fp8 GEMM variant
    "serving": ["--quick"],  # the OpenAI server under Poisson arrivals against the offline engine
}


def run_bench(name: str, args: list[str], timeout_s: float) -> dict:
    """Run ``python -m bench.<name> *args``, stream its output, and return its summary row."""
    cmd = [sys.executable, "-m", f"bench.{name}", *args]
    print(f"\n######## {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    docs: list[dict] = []

    def pump() -> None:
        for line in proc.stdout:
            print(line, end="", flush=True)
            if line.startswith(JSON_PREFIX):
                docs.append(parse_json_line(line.strip()))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    reader.join(timeout=10)
    rows = len(docs[-1]["rows"]) if docs else None
    ok = rc == 0 and docs
    return {"bench": name, "status": "ok" if ok else "FAIL", "rc": str(rc), "seconds": time.perf_counter() - t0,
            "json_rows": rows}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="every bench in its quick mode")
    ap.add_argument("--only", nargs="+", choices=list(BENCHES), default=None, help="run these benches only")
    ap.add_argument("--skip", nargs="+", choices=list(BENCHES), default=[], help="leave these out")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per bench (default 240 quick, 3600 full)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = [n for n in (args.only or BENCHES) if n not in args.skip]
    timeout = args.timeout or (240 if args.quick else 3600)
    t0 = time.perf_counter()
    rows = [run_bench(n, BENCHES[n] if args.quick else [], timeout) for n in names]
    print(f"\nrun_all ({'quick' if args.quick else 'full'}): {len(rows)} benches in {time.perf_counter() - t0:.0f} s")
    print(Table(rows, formats={"seconds": ".0f"}).render())
    print("RUN_ALL " + json.dumps({"quick": args.quick, "benches": rows}), flush=True)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
