"""The bench harness on the CPU: the table and the BENCH_JSON line, the ratio helpers, the timers' host-clock
path, and every bench module importing and parsing ``--help`` without CUDA."""

from __future__ import annotations

import importlib
import io
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import harness
from bench.harness import Ceilings, Table, format_table, json_line, parse_json_line, report

ROOT = Path(__file__).resolve().parents[1]
BENCH_MODULES = ["bench_dsa", "bench_engine_decode", "bench_flashinfer", "bench_speculative", "profile_engine_step",
                 "triton_mla_kernels_gpu", "mla_decode_grid", "ceilings", "run_all", "tp_decode", "host_step",
                 "dsv4_decode_bench", "gemv_bench", "prefill_bench"]
CEIL = Ceilings("Fake GPU", copy_gbs=2000.0, matmul_tflops=500.0)


# ------------------------------------------------------------------------------------------------ table
def test_table_aligns_numbers_right_and_text_left_with_a_rule():
    rows = [{"row": "decode h16", "us": 452.123, "ok": True, "note": None},
            {"row": "b1", "us": 30.9, "ok": False, "note": "fixed cost"}]
    lines = format_table(rows, formats={"us": ".1f"}).split("\n")
    assert lines[0] == "row            us  ok   note"  # a number column's header is right-aligned too
    assert lines[1] == "----------  -----  ---  ----------"
    assert lines[2] == "decode h16  452.1  yes"
    assert lines[3] == "b1           30.9  no   fixed cost"
    assert all(line == line.rstrip() for line in lines)


def test_table_default_number_format_and_column_order():
    rows = [{"a": 12345.678, "b": 0.001234}, {"b": float("nan"), "c": 3}]
    lines = format_table(rows).split("\n")
    assert lines[0].split() == ["a", "b", "c"]  # keys in first-seen order
    assert lines[2].split() == ["12346", "0.001234"]
    assert lines[3].split() == ["nan", "3"]
    assert format_table(rows, columns=["c", "a"]).split("\n")[0].split() == ["c", "a"]


def test_table_mixed_column_is_left_aligned():
    out = format_table([{"v": 1.5}, {"v": "n/a"}]).split("\n")
    assert out[2] == "1.5" and out[3] == "n/a"


# ------------------------------------------------------------------------------------------------ JSON line
def test_json_line_is_strict_json_with_ceilings_device_rows_and_meta():
    ceil = CEIL.with_extra(h2d_gbs=53.0)
    line = json_line("bench_x", ceil, Table([{"row": "r", "v": float("nan"), "w": math.inf, "n": 3}]),
                     meta={"quick": True, "cfg": {"block_n": 64}})
    assert line.startswith("BENCH_JSON {") and "\n" not in line
    doc = json.loads(line[len("BENCH_JSON "):])  # strict: NaN would not parse as JSON null
    assert "NaN" not in line and "Infinity" not in line
    assert doc == {"bench": "bench_x", "device": "Fake GPU",
                   "ceilings": {"copy_gbs": 2000.0, "matmul_tflops": 500.0, "h2d_gbs": 53.0},
                   "rows": [{"row": "r", "v": None, "w": None, "n": 3}],
                   "meta": {"quick": True, "cfg": {"block_n": 64}}}
    assert parse_json_line(line) == doc


def test_json_line_names_the_table_of_each_row_when_there_are_several():
    doc = parse_json_line(json_line("b", CEIL, [Table([{"x": 1}], name="draft"), Table([{"y": 2}], name="tok")]))
    assert doc["rows"] == [{"table": "draft", "x": 1}, {"table": "tok", "y": 2}]


def test_parse_json_line_rejects_other_lines():
    with pytest.raises(ValueError, match="BENCH_JSON"):
        parse_json_line('{"bench": 1}')


def test_report_prints_ceilings_tables_and_the_json_line_last():
    out = io.StringIO()
    report("bench_x", CEIL, [Table([{"row": "a", "GB/s": 1500.0}], title="first"), Table([{"k": 1}])],
           meta={"m": 1}, file=out)
    lines = out.getvalue().rstrip("\n").split("\n")
    assert lines[0] == ""
    assert lines[1] == "ceilings: Fake GPU: copy 2000 GB/s (read+write), bf16 matmul 500 TFLOP/s"
    assert lines[2] == "first" and lines[3].split() == ["row", "GB/s"] and lines[5].split() == ["a", "1500"]
    assert lines[6] == "k"
    assert lines[-1].startswith("BENCH_JSON ") and parse_json_line(lines[-1])["meta"] == {"m": 1}


# ------------------------------------------------------------------------------------------------ ratios
def test_ratio_helpers():
    assert harness.gb_per_s(3e9, 1000.0) == pytest.approx(3.0)
    assert harness.tflop_per_s(5e12, 2000.0) == pytest.approx(2.5)
    # 1e9 bytes in 1 ms = 1000 GB/s = 50% of 2000 GB/s; 1e11 FLOP in 1 ms = 100 TFLOP/s = 20% of 500
    assert CEIL.pct_copy(1e9, 1.0) == pytest.approx(50.0)
    assert CEIL.pct_matmul(1e11, 1.0) == pytest.approx(20.0)
    assert CEIL.as_dict() == {"device": "Fake GPU", "copy_gbs": 2000.0, "matmul_tflops": 500.0}
    assert CEIL.with_extra(h2d_gbs=1.0).extra == {"h2d_gbs": 1.0} and CEIL.extra == {}


# ------------------------------------------------------------------------------------------------ timers (CPU)
def test_eager_ms_on_the_host_clock_times_one_call():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)

    ms = harness.eager_ms(fn, warmup_ms=4, rep_ms=20, device="cpu")
    assert 2.0 <= ms < 50.0
    assert len(calls) >= 3  # the first call, estimates, timed calls


def test_eager_ms_returns_the_estimate_for_slow_calls():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.03)

    assert harness.eager_ms(fn, rep_ms=20, device="cpu") >= 30.0
    assert len(calls) == 2  # the first call, then one estimate that already spans rep_ms


def test_loop_graph_host_timers_on_the_cpu():
    calls = []
    assert harness.loop_ms(lambda: calls.append(1), 7, warmup=2, device="cpu") >= 0.0
    assert len(calls) == 9
    assert math.isnan(harness.graph_ms([lambda: None], device="cpu"))
    assert harness.host_us(lambda: time.sleep(0.001), 3, device="cpu") >= 1000.0
    with pytest.raises(ValueError, match="iters"):
        harness.loop_ms(lambda: None, 0, device="cpu")


def test_rotation_helpers():
    seen = []
    run = harness.rotating([lambda: seen.append(0), lambda: seen.append(1), lambda: seen.append(2)])
    for _ in range(7):
        run()
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    # the CPU stands in with a 64 KiB "L2": 3 x 64 KiB of inputs
    assert harness.copies_for_l2(1 << 20, "cpu") == 1
    assert harness.copies_for_l2(64 * 1024, "cpu") == 3
    assert harness.copies_for_l2(1000, "cpu") == 8  # capped


def test_measure_ceilings_on_the_cpu_is_finite():
    c = harness.measure_ceilings("cpu")
    assert c.device == "cpu" and c.copy_gbs > 0 and c.matmul_tflops > 0
    assert math.isfinite(c.copy_gbs) and math.isfinite(c.matmul_tflops)
    assert math.isnan(harness.h2d_copy_gbs(1024, "cpu"))


# ------------------------------------------------------------------------------------------------ the benches
@pytest.mark.parametrize("name", BENCH_MODULES)
def test_bench_module_imports_and_parses_help_without_cuda(name, capsys):
    mod = importlib.import_module(f"bench.{name}")
    if name == "ceilings":
        assert callable(mod.measure_ceilings)
        return
    parser = mod.build_parser()
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out
    assert parser.parse_args(["--quick"]).quick is True


def test_run_all_runs_every_bench():
    from bench.run_all import BENCHES

    mains = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if re.search(r"^def main\(", p.read_text(), re.M)
                   and p.stem not in ("run_all", "ceilings"))
    assert sorted(BENCHES) == mains
    assert all("--quick" in args for args in BENCHES.values())


def test_a_bench_runs_as_a_file():
    """``python bench/<name>.py`` puts the repository root on the path itself (``-m`` runs as imported above)."""
    res = subprocess.run([sys.executable, "bench/bench_engine_decode.py", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usage:" in res.stdout


def test_host_step_runs_on_the_cpu_with_the_stub_model(capsys):
    """bench.host_step: the engine with its model overridden in the container serves every decode step."""
    from bench import host_step

    host_step.main(["--quick", "--batches", "1", "2", "--out-len", "12"])
    out = parse_json_line(capsys.readouterr().out.strip().splitlines()[-1])
    steps = [r for r in out["rows"] if r["table"] == "steps"]
    assert [r["batch"] for r in steps] == [1, 2] and all(r["decode_steps"] == 11 for r in steps)
    assert all(r["step_us"] > 0 for r in steps)
    phases = {r["phase"] for r in out["rows"] if r["table"] == "phases"}
    assert {"make_batch", "backend metadata", "model (forward, logits)"} <= phases


def test_decode_roofline_gaps_split_graph_bubbles_from_host_waits():
    """bench.decode_roofline: idle gaps between GPU activities inside the window, overlaps merged, clipped."""
    from bench.decode_roofline import BUBBLE_US, gaps_us

    iv = [(0, 5, "k"), (6, 10, "k"), (8, 12, "m"), (30, 40, "k"), (50, 70, "k"), (90, 95, "k")]
    gaps = gaps_us(iv, 2, 60)
    assert gaps == [1, 18, 10]
    assert [g for g in gaps if g < BUBBLE_US] == [1]  # a bubble; 18 and 10 count as waits for the host


def test_kernel_breakdown_charges_a_pdl_wait_to_the_kernel_waited_for():
    """A kernel launched with PDL starts inside the one before it and waits: its span counts the wait, its own
    time starts where everything before it ended (a copy's time too); the own times of the kernels and the copy
    add up to the union of GPU activity; kernels that start outside the window are not listed."""
    from bench.decode_roofline import kernel_breakdown, union_us

    ev = [(-4, 1, "kernel", "before"), (0, 10, "kernel", "a"), (5, 20, "kernel", "b(int)"), (20, 22, "kernel", "c"),
          (21, 25, "gpu_memcpy", "copy"), (24, 30, "kernel", "b(int)"), (31, 40, "kernel", "late")]
    rows = {r["kernel"]: r for r in kernel_breakdown(ev, 0, 30, steps=2, layers=1)}
    assert set(rows) == {"a", "b", "c"}
    assert rows["b"]["per_step"] == 1 and rows["b"]["us_per_step"] == (15 + 6) / 2
    assert rows["b"]["own_us_per_step"] == (10 + 5) / 2 and rows["a"]["own_us_per_step"] == (10 - 1) / 2
    own = sum(r["own_us_per_step"] for r in rows.values()) * 2 + (25 - 22)  # the copy's own time
    assert own == union_us([(s, e, c) for s, e, c, _ in ev], 1, 30)
    assert abs(sum(r["share"] for r in rows.values()) - 1) < 1e-12
    assert list(rows) == ["b", "a", "c"]  # by own time


def test_mla_decode_grid_variant_knobs_and_a_bad_one():
    from bench.mla_decode_grid import variant_kwargs

    assert variant_kwargs("default", 132) == {}
    assert variant_kwargs("tma.s3.n128.w4.p2", 132) == dict(use_tma=True, num_stages=3, block_n=128, num_warps=4,
                                                            target_programs=264)
    assert variant_kwargs("ptr.h32.r128", 132) == dict(use_tma=False, block_h=32, max_regs=128)
    assert variant_kwargs("wgmma.pdl", 132) == dict(use_wgmma=True, pdl=True)
    assert variant_kwargs("wgmma.pdl.reuse.g4", 132) == dict(use_wgmma=True, pdl=True, reuse_plan=True,
                                                              merge_programs=528)
    assert variant_kwargs("wgmma.seesaw", 132) == dict(use_wgmma=True, seesaw=True)
    assert variant_kwargs("wgmma.lockstep", 132) == dict(use_wgmma=True, seesaw=False)
    assert variant_kwargs("wgmma.fp16prod", 132) == dict(use_wgmma=True, fp8_scores=False)
    assert variant_kwargs("wgmma.reuse.fp8scores", 132) == dict(use_wgmma=True, reuse_plan=True, fp8_scores=True)
    with pytest.raises(SystemExit, match="knob 'x3'"):
        variant_kwargs("tma.x3", 132)


def test_decode_roofline_fits_layers_by_kind():
    """--layers auto: 3 dense layers then MoE layers that weigh far more; the dense layers' cost must not stand
    in for the MoE layers' (the 1-layer estimate asked for 61 DeepSeek-V3 TP8 layers and ran out of memory)."""
    from bench.decode_roofline import layers_that_fit

    dense, moe, kv = 170, 2900, 10
    assert layers_that_fit([dense] * 3 + [moe], kv, 3 * (dense + kv) + 5 * (moe + kv) + 100, 61) == 8
    assert layers_that_fit([dense] * 3 + [moe], kv, 10**9, 61) == 61
    assert layers_that_fit([moe], kv, 5, 61) == 1  # at least one layer


def test_prefill_bench_shapes_variants_and_its_runs_config():
    """bench.prefill_bench: BxP shapes (bad ones refused with the form), each variant's launcher constants set for
    its block and restored after (an error inside included), and a shape's run prefilling all B requests at once."""
    import argparse

    from backends.kernels.gemm import fp8_gemm, fp8_moe
    from bench.decode_roofline import overrides
    from bench.engine_config import compose_config
    from bench.prefill_bench import build_parser, parse_shape, variant

    assert parse_shape("8x1000") == (8, 1000)
    for bad in ("8", "0x10", "ax2", "4x"):
        with pytest.raises(argparse.ArgumentTypeError, match="BxP"):
            parse_shape(bad)
    args = build_parser().parse_args(["--shapes", "2x64", "--variants", "cublas_2048", "no_tma", "--quick",
                                      "--host", "5"])
    assert args.shapes == [(2, 64)] and args.variants == ["cublas_2048", "no_tma"] and args.host == 5
    assert args.graphs == ["off", "on"] and build_parser().parse_args(["--graphs", "on"]).graphs == ["on"]
    before = (fp8_gemm.SCALED_MM_ROWS, fp8_moe.TMA_ROWS)
    with variant("cublas_2048"):
        assert fp8_gemm.SCALED_MM_ROWS == 2048 and fp8_moe.TMA_ROWS == before[1]
    with variant("no_cublas"):
        assert fp8_gemm.SCALED_MM_ROWS is None
    with pytest.raises(RuntimeError), variant("no_tma"):
        assert fp8_moe.TMA_ROWS == 0
        raise RuntimeError("inside")
    assert (fp8_gemm.SCALED_MM_ROWS, fp8_moe.TMA_ROWS) == before
    cfg = compose_config(overrides("h100_triton_tp8", 4, 2, 1024, 2, "on", extra=("model.weights=fp8",)))
    assert cfg.workload.chunked_prefill_size >= 4 * 1024 and cfg.model.weights == "fp8"
    assert max(cfg.graph.prefill_tokens) == 4096  # graphs on: the preset's counts; off: none
    off = compose_config(overrides("h100_triton_tp8", 4, 2, 1024, 2, "on", extra=("graph.prefill_tokens=[]",)))
    assert list(off.graph.prefill_tokens) == []


def test_prefill_bench_times_the_hosts_prefill_forwards_and_the_collector():
    """HostTime records the host ms of each eager prefill forward (none of the decode steps) and gives the model
    its own method back; CollectorTime counts the collections it sees."""
    import gc

    from bench.engine_config import compose_config
    from bench.prefill_bench import CollectorTime, HostTime
    from containers import build

    rt = build(compose_config(["device=cpu", "workload=smoke", "workload.num_requests=2", "check=off"]))
    model = rt.container.model()
    with HostTime(model) as host:
        res = rt.engine.run(record_hidden=False)
    assert len(host.ms) == sum(s.phase == "prefill" for s in res.steps) >= 1 and min(host.ms) > 0
    assert "forward" not in vars(model)  # the class's method again
    with CollectorTime() as collected:
        gc.collect()
    assert collected.count >= 1 and collected.ms >= 0 and collected not in gc.callbacks


def test_decode_roofline_set_adds_overrides_to_every_run():
    """--set KEY=VALUE reaches the composed config of each run (e.g. FlashInfer's fa2 kernel against fa3), last,
    so it wins over the preset."""
    from bench.decode_roofline import build_parser, overrides
    from bench.engine_config import compose_config

    args = build_parser().parse_args(["--set", "backend.kernel=fa2", "model.pdl=false", "--batches", "1"])
    assert args.set == ["backend.kernel=fa2", "model.pdl=false"]
    ov = overrides("h100_dsv3_tp8", 1, 4, 64, 4, "on", pdl="on", extra=tuple(args.set))
    assert ov[-2:] == args.set
    cfg = compose_config(ov)
    assert cfg.backend.kernel == "fa2" and cfg.model.pdl is False


def test_decode_window_ends_at_the_trace_and_spans_the_steps():
    """bench.decode_roofline.decode_window (decode_roofline and tp_decode --profile): the GPU events of the
    trace, and the window the decode steps' CUDA-event marks span, placed at the trace's last activity."""
    import json as _json
    from types import SimpleNamespace

    from bench.decode_roofline import decode_window

    events = [{"ph": "X", "cat": "kernel", "name": "a", "ts": 0.0, "dur": 5.0},
              {"ph": "X", "cat": "kernel", "name": "b", "ts": 90.0, "dur": 10.0},
              {"ph": "X", "cat": "cpu_op", "name": "host", "ts": 200.0, "dur": 1.0}]
    prof = SimpleNamespace(export_chrome_trace=lambda path: open(path, "w").write(_json.dumps({"traceEvents": events})))
    start = SimpleNamespace(elapsed_time=lambda other: 0.04)  # ms: 40 us from the first mark to the last
    dec = [SimpleNamespace(marks=(start, None)), SimpleNamespace(marks=(None, "end"))]
    ev, lo, end = decode_window(prof, dec)
    assert [e[3] for e in ev] == ["a", "b"] and (lo, end) == (60.0, 100.0)
