"""What `python -m runtime` does: compose, validate, build, run, check parity, report.

Under ``torchrun`` (``parallel.tp`` > 1) every rank runs all of this in lockstep (the builds, the workload, the
parity reference, the end-of-run checks are the same on every rank); only rank 0 prints and writes the report.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

from omegaconf import DictConfig
from rich.console import Console

from containers import build, to_plain
from runtime.app.memory_checks import release, run_released
from runtime.app.parallel_report import disagreements, parallel_section
from runtime.app.parity import TIE_MARGIN, compare, quantization_effect, reference_config, unquantized_config
from runtime.app.plot import write_step_plot
from runtime.app.report import (
    fp8_compute,
    make_report,
    memory_plan,
    print_report,
    shared_kv_indices_section,
    speculative_section,
    write_report,
)
from runtime.app.spec_compare import speculative_parity
from runtime.core.config import Config
from runtime.core.errors import ConfigError, Problem
from runtime.core.parallel import LaunchEnv, shutdown

EXTRA_KEYS = {"dump_dir": "a directory path (+dump_dir=DIR)", "explain": "true or false (+explain=true)"}


def _extras(plain: dict) -> list[Problem]:
    problems = []
    if plain.get("explain") is not None and not isinstance(plain["explain"], bool):
        problems.append(Problem("explain", repr(plain["explain"]), "true or false", "+explain=true"))
    if plain.get("dump_dir") is not None and not isinstance(plain["dump_dir"], str):
        problems.append(Problem("dump_dir", repr(plain["dump_dir"]), "a directory path", "+dump_dir=dumps/run1"))
    known = set(EXTRA_KEYS) | {f.name for f in dataclasses.fields(Config)}
    for key in sorted(set(plain) - known):
        problems.append(Problem(f"key '{key}'", f"+{key}=...", f"one of {sorted(known)}",
                                f"drop +{key}, or fix its spelling"))
    return problems


def explain(runtime, console: Console) -> None:
    console.print("[bold]build order[/bold]: " + " -> ".join(runtime.build_order))
    plan = memory_plan(runtime.container)
    console.print("[bold]memory plan[/bold] (bytes):")
    rows = {"kv_pool": plan["kv_pool_bytes"], "draft_kv_pool": plan["draft_kv_pool_bytes"],
            "index_keys": plan["index_key_bytes"], "hisparse_device": plan["hisparse_device_bytes"],
            "request_states": plan["request_state_bytes"],
            **{k.removesuffix("_bytes"): v for k, v in plan.items() if k.startswith("dsv4_")},
            "req_to_token": plan["req_to_token_bytes"],
            "weights": plan["weights_bytes"], **{f"  weights:{k}": v for k, v in plan["weights_by_dtype"].items()},
            **{f"workspace:{k}": v for k, v in plan["workspaces"].items()}}
    for name, n in rows.items():
        console.print(f"  {name:<32} {n:>16,d}")
    console.print(f"  {'total':<32} {plan['total_bytes']:>16,d}")
    budget = runtime.container.memory_budget()  # what the plan predicted before allocating (docs/memory.md)
    console.print(f"[bold]memory budget[/bold] (bytes; {budget.summary()}):")
    for name, n in budget.rows():
        console.print(f"  {name[:56]:<56} {n:>18,d}")
    if budget.reference_skip:
        console.print(f"  parity reference skipped: {budget.reference_skip}")
    coordinator = runtime.container.hisparse_coordinator()
    if coordinator is not None:
        host = coordinator.host_pool.numel() * coordinator.host_pool.element_size()
        console.print(f"  {'host (pinned): hisparse KV':<32} {host:>16,d}")


def run(cfg: DictConfig, output_dir: Path) -> int:
    try:
        return _run(cfg, output_dir, LaunchEnv.from_environ())
    finally:
        shutdown()  # the process group, if this run started one


def _run(cfg: DictConfig, output_dir: Path, launch: LaunchEnv) -> int:
    lead = launch.rank == 0  # only rank 0 prints and writes
    console = Console(quiet=not lead)
    plain = to_plain(cfg)
    try:
        problems = _extras(plain)
        if problems:
            raise ConfigError(problems)
        runtime = build(plain)
    except ConfigError as e:
        if lead:
            print(str(e), file=sys.stderr)
        return 2
    if plain.get("explain"):
        explain(runtime, console)
        return 0
    res = runtime.engine.run(progress=plain["progress"] and lead, record_hidden=plain["check"] != "off")
    # everything the report needs from this run is read now: its model is freed before any other model is built
    # (the speculative baseline, the parity reference), so no two models are ever held at once (docs/memory.md)
    spec, plan, model_spec = plain["speculative"], runtime.container.memory_budget(), runtime.container.model_spec()
    w8a8 = fp8_compute(runtime) == "w8a8"  # read before the model is freed
    stats = runtime.container.speculative().stats if spec["enabled"] else None
    shared = shared_kv_indices_section(runtime.container, spec["shared_kv_indices"]) if spec["enabled"] else None
    differ = disagreements(runtime, res)
    if differ:
        print(f"rank {launch.rank}: tensor-parallel ranks DISAGREE (each rank schedules on its own and must produce "
              "the same tokens):\n  " + "\n  ".join(differ), file=sys.stderr)
        return 3
    parallel = parallel_section(runtime, res)
    dumps = {m: str(p) for m, p in runtime.container.dumper().saved.items()}
    report = make_report(runtime, res, None, dumps) if lead else None
    release(runtime)
    del runtime
    speculative, replayed = None, None
    if spec["enabled"]:  # the same workload on the same backend without speculation, for tokens/s
        baseline = None
        if spec["baseline"]:
            base_cfg = copy.deepcopy(plain)
            base_cfg["speculative"]["enabled"] = False
            baseline = run_released(build(base_cfg), lambda engine: engine.run(record_hidden=False))
            if plain["check"] != "off":  # and fed the speculative tokens: choices and errors position by position
                replayed = run_released(build(base_cfg), lambda engine: engine.run(forced=res.outputs))
        speculative = speculative_section(res, stats, baseline)
        speculative["shared_kv_indices"] = shared
    parity = None
    if plain["check"] != "off" and plan.reference_skip:
        parity = {"reference": None, "ok": None, "skipped": plan.reference_skip}
        console.print(f"[yellow]parity skipped[/yellow]: {plan.reference_skip}")
    elif plain["check"] != "off":
        ref_cfg = reference_config(plain)
        ref_res = run_released(build(ref_cfg), lambda engine: engine.run(forced=res.outputs))
        ref_name = f"{ref_cfg['backend']['name']}/{ref_cfg['model']['dtype']}"
        routing = model_spec.has_moe or bool(model_spec.sparse_layers)
        parity = compare(res, ref_res, plain["model"]["dtype"], ref_name, discrete_routing=routing,
                         w8a8=w8a8).as_dict()
    if replayed is not None:  # speculative vs plain decoding on the same tokens, and each against the reference
        speculative["vs_baseline"] = speculative_parity(res, replayed, ref_res if parity.get("reference") else None,
                                                        TIE_MARGIN[plain["model"]["dtype"]])
    if plain["check"] == "unquantized" and parity.get("reference"):  # what the fp8 cache alone changes
        unq = build(unquantized_config(plain))  # the same weights and dtype: its LM head is the candidate's
        model = unq.container.model()
        unq_res = unq.engine.run(forced=res.outputs)
        parity["quantization"] = quantization_effect(
            res, unq_res, lambda h: model.logits(h.to(model.device, model.spec.dtype)))
        release(unq)
    if not lead:
        return 0 if parity is None or parity["ok"] is not False else 1
    report["parallel"], report["parity"], report["speculative"] = parallel, parity or report["parity"], speculative
    print_report(report, console)
    path = write_report(report, output_dir)
    console.print(f"report: {path}")
    plot = write_step_plot(res, output_dir)
    console.print(f"step plot: {plot}" if plot is not None else
                  "step plot: skipped (matplotlib is not installed; pip install -e '.\\[plot]')")  # \[: not markup
    if parity is not None and parity["ok"] is False:
        print("parity check FAILED: the backend's output differs from the torch reference (see report)",
              file=sys.stderr)
        return 1
    return 0
