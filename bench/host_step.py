"""The host side of a decode step, on the CPU: the engine with the model's forward replaced by a stub.

The container's ``model`` provider is overridden with :class:`StubModel`, whose forward and logits return
preallocated, correctly shaped tensors at once; what a decode step still costs is pure host time: scheduling,
slot reservation, building the ForwardBatch, the backend's metadata, sampling (topk on the stub logits, the
last-token table write), step outputs (read-back, EOS), progress and report bookkeeping.

For each batch size, ``--repeats`` engine runs (prompts of ``--prompt`` tokens, ``--out-len`` new tokens, every
request running at once, overlap on) give:

* ``step_us``: median period of the full-batch decode steps (start mark to next start mark), best run;
* one more run with every phase timed (exclusive time, ``time.perf_counter_ns``): µs per decode step by phase.
  Timing adds ~1 µs per timed call, so the phases sum to a bit more than ``step_us``.

``--cprofile N`` also prints the N functions with the most own time (one run per batch, decode only).
The GPU's host cost per torch op (a kernel launch) is larger than the CPU's, so this measures the Python
side; the GPU effect is measured by ``bench.bench_engine_decode`` / ``bench.decode_roofline`` on a device.

``--preset NAME --layers N`` (on a GPU): the real model of that ``+deploy`` preset instead of the stub, with the
graph launch split into its parts (input copies, the backend's replay hook, ``cudaGraphLaunch``), the fence wait
and the CUDA event marks. ``step_us`` is then the GPU's step period (the longer of host and GPU), and the
phases are per decode step but include the prefill's share of the run (its eager forward lands in "model
(forward, logits)").

Run: ``python -m bench.host_step [--quick] [--batches 1 32] [--out-len 256] [--repeats 3] [--cprofile 25]
[--preset h100_dsv3_tp8 --layers 8]``
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.engine_config import compose_config, decode_periods_us, fixed_workload, preset_overrides  # noqa: E402
from bench.harness import Ceilings, Table, measure_ceilings, report  # noqa: E402


class StubModel:
    """The model's engine-facing surface (``spec``, ``forward``, ``logits``) without computing anything:
    hidden states and logits are slices of buffers allocated once (the logits favour token ``argmax_token``,
    so greedy decoding is deterministic)."""

    def __init__(self, spec, device: torch.device, max_tokens: int = 8192):
        self.spec = spec
        self._h = torch.zeros(max_tokens, spec.hidden_size, device=device)
        logits = torch.zeros(max_tokens, spec.vocab_size, device=device)
        logits[:, 7], logits[:, 3] = 2.0, 1.0
        self._logits = logits

    def forward(self, ids: torch.Tensor, batch) -> torch.Tensor:
        return self._h[: ids.shape[0]]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._logits[: h.shape[0]]

    def top2(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.topk(self.logits(h), 2, dim=-1))


class PhaseTimer:
    """Exclusive time per phase: a timed call's time minus the timed calls it made."""

    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[int] = []  # child time accumulated per open frame

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._stack.append(0)
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                child = self._stack.pop()
                self.ns[name] += dt - child
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1] += dt
        return timed


def build_runtime(batch: int, prompt: int, out_len: int, overrides: list[str], preset: str | None = None,
                  layers: int = 8):
    """The stub-model CPU engine, or with ``preset`` the real model of that ``+deploy`` preset (``layers``
    layers; on its device, CUDA graphs as the preset says)."""
    from dependency_injector import providers

    import containers

    if preset is not None:
        cfg = compose_config([*preset_overrides(preset, batch, layers, prompt, out_len), "engine.overlap=on",
                              *overrides])
        return containers.build(cfg)
    pages = batch * -(-(prompt + out_len + 1) // 16) + 16
    cfg = compose_config([
        "device=cpu", "model=tiny_mla", "check=off", "progress=false", "engine.overlap=on",
        f"model.max_context={max(1024, prompt + out_len + 8)}",
        *fixed_workload(batch, prompt, out_len),
        f"workload.max_tokens_per_batch={max(4096, batch * prompt)}",
        f"workload.chunked_prefill_size={max(4096, batch * prompt)}",
        "kv.page_size=16", f"kv.num_pages={pages}", f"kv.max_requests={max(batch, 8)}", *overrides,
    ])
    container = containers.Container()
    container.model.override(providers.Factory(StubModel, container.model_spec, container.device))
    return containers.build(cfg, container=container)


def decode_period_us(res, batch: int) -> float:
    """Median start-to-start period of consecutive full-batch decode steps (the first few skipped)."""
    return statistics.median(decode_periods_us(res, batch)[4:])  # on a GPU: the GPU's period


def timed_phases(rt, batch: int) -> tuple[dict[str, float], int]:
    """One run with every phase wrapped; (µs per decode step by phase, decode steps)."""
    from runtime.engine import engine as engine_mod

    eng = rt.engine
    timer = PhaseTimer()
    for name, attr in [("schedule: prefill check", "_prefill_step"), ("schedule: decode", "_decode_step"),
                       ("schedule: reserve/retract", "_reserve_decoding"), ("launch: fence+graph/plan", "_launch"),
                       ("sample (topk, last-token, to_host)", "_sample"), ("finish_step", "_finish_step"),
                       ("release_stopped", "_release_stopped")]:
        setattr(eng, attr, timer.wrap(name, getattr(eng, attr)))
    slots = eng.slots
    slots.reserve_many = timer.wrap("reserve_many (slots, table write)", slots.reserve_many)
    eng.clock.wait = timer.wrap("fence wait (GPU started the previous step)", eng.clock.wait)
    eng.clock.mark = timer.wrap("clock marks (CUDA events)", eng.clock.mark)
    eng.clock.to_host = timer.wrap("to_host (pinned copies)", eng.clock.to_host)
    graphs = eng.graphs.get("decode")
    if graphs is not None and graphs.decision.graphed:  # the real model with graphs: the launch in its parts
        graphs.prepare = timer.wrap("graph prepare (input copies)", graphs.prepare)
        graphs.replay = timer.wrap("graph replay (cudaGraphLaunch)", graphs.replay)
        graphs.hooks.init_forward_metadata_replay = timer.wrap("backend replay hook (plan)",
                                                               graphs.hooks.init_forward_metadata_replay)
    eng.backend.init_forward_metadata = timer.wrap("backend metadata", eng.backend.init_forward_metadata)
    eng.model.forward = timer.wrap("model (forward, logits)", eng.model.forward)
    eng.model.logits = timer.wrap("model (forward, logits)", eng.model.logits)
    make_batch = engine_mod.make_batch
    engine_mod.make_batch = timer.wrap("make_batch", make_batch)
    outputs_cls = engine_mod.StepOutputs
    orig = {k: getattr(outputs_cls, k) for k in ("push", "resolve_older", "resolve_all")}
    for k, fn in orig.items():
        setattr(outputs_cls, k, timer.wrap(f"step outputs ({k})", fn))
    try:
        t0 = time.perf_counter_ns()
        res = eng.run(record_hidden=False)
        total = time.perf_counter_ns() - t0
    finally:
        engine_mod.make_batch = make_batch
        for k, fn in orig.items():
            setattr(outputs_cls, k, fn)
    steps = len([s for s in res.steps if s.phase == "decode"])
    phases = {k: v / 1e3 / steps for k, v in timer.ns.items()}
    phases["run loop, other"] = total / 1e3 / steps - sum(phases.values())
    return phases, steps


def profile_top(rt, n: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    rt.engine.run(record_hidden=False)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(n)
    return out.getvalue()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="outputs of 32, one run per batch (a smoke run)")
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=None, help="default 256 (--quick: 32)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per batch, the best median is reported; default 3 (--quick: 1)")
    ap.add_argument("--cprofile", type=int, default=0, help="print this many top functions (own time) per batch")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--preset", default=None,
                    help="time the real model of this +deploy preset on its device instead of the CPU stub "
                         "(e.g. h100_dsv3_tp8 on a GPU)")
    ap.add_argument("--layers", type=int, default=8, help="with --preset: model.num_layers")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides (e.g. engine.overlap=off)")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.out_len = args.out_len or (32 if args.quick else 256)
    args.repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)
    rows, phase_rows = [], []
    for b in args.batches:
        rt = build_runtime(b, args.prompt, args.out_len, args.overrides, args.preset, args.layers)
        rt.engine.run(record_hidden=False)  # warm-up
        periods = [decode_period_us(rt.engine.run(record_hidden=False), b) for _ in range(args.repeats)]
        runs = " ".join(f"{p:.1f}" for p in periods)
        print(f"[batch {b}] host step {min(periods):.1f} us (runs: {runs})", flush=True)
        if args.cprofile:
            print(profile_top(rt, args.cprofile), flush=True)
        phases, steps = timed_phases(rt, b)  # last: it wraps the engine's methods
        rows.append({"batch": b, "step_us": min(periods), "runs_us": runs, "decode_steps": steps})
        for name, us in sorted(phases.items(), key=lambda kv: -kv[1]):
            phase_rows.append({"batch": b, "phase": name, "us_per_step": us})
    if args.preset is None:
        ceil, what = Ceilings("cpu", float("nan"), float("nan")), "stub model (CPU, tiny_mla"
    else:
        ceil, what = measure_ceilings(), f"{args.preset}, {args.layers} layers ({torch.cuda.get_device_name()}"
    tables = [
        Table(rows, title=f"host time per decode step, {what}, prompt {args.prompt}, "
                          f"output {args.out_len})", formats={"step_us": ".1f"}, name="steps"),
        Table(phase_rows, title="µs per decode step by phase (exclusive; timing adds ~1 µs per call)",
              formats={"us_per_step": ".1f"}, name="phases"),
    ]
    report("host_step", ceil, tables, meta={"prompt": args.prompt, "out_len": args.out_len, "quick": args.quick,
                                             "preset": args.preset, "layers": args.layers,
                                             "overrides": args.overrides, "threads": args.threads})


if __name__ == "__main__":
    main()
