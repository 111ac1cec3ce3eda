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
from runtime.app.parallel_report import disagreements, parallel_section
from runtime.app.parity import compare, quantization_effect, reference_config, unquantized_config
from runtime.app.plot import write_step_plot
from runtime.app.report import (
    make_report,
    memory_plan,
    print_report,
    shared_kv_indices_section,
    speculative_section,
    write_report,
)
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
    speculative = None
    spec = plain["speculative"]
    if spec["enabled"]:  # the same workload on the same backend without speculation, for tokens/s
        baseline = None
        if spec["baseline"]:
            base_cfg = copy.deepcopy(plain)
            base_cfg["speculative"]["enabled"] = False
            baseline = build(base_cfg).engine.run(record_hidden=False)
        speculative = speculative_section(res, runtime.container.speculative().stats, baseline)
        speculative["shared_kv_indices"] = shared_kv_indices_section(runtime.container, spec["shared_kv_indices"])
    parity = None
    if plain["check"] != "off":
        ref_cfg = reference_config(plain)
        ref_res = build(ref_cfg).engine.run(forced=res.outputs)
        ref_name = f"{ref_cfg['backend']['name']}/{ref_cfg['model']['dtype']}"
        model_spec = runtime.container.model_spec()
        routing = model_spec.has_moe or bool(model_spec.sparse_layers)
        parity = compare(res, ref_res, plain["model"]["dtype"], ref_name, discrete_routing=routing).as_dict()
    if plain["check"] == "unquantized":  # what the fp8 cache alone changes: same run, cache in the model dtype
        unq = build(unquantized_config(plain)).engine.run(forced=res.outputs)
        model = runtime.container.model()
        parity["quantization"] = quantization_effect(
            res, unq, lambda h: model.logits(h.to(model.device, model.spec.dtype)))
    differ = disagreements(runtime, res)
    if differ:
        print(f"rank {launch.rank}: tensor-parallel ranks DISAGREE (each rank schedules on its own and must produce "
              "the same tokens):\n  " + "\n  ".join(differ), file=sys.stderr)
        return 3
    parallel = parallel_section(runtime, res)
    if not lead:
        return 0 if parity is None or parity["ok"] else 1
    dumps = {m: str(p) for m, p in runtime.container.dumper().saved.items()}
    report = make_report(runtime, res, parity, dumps, speculative)
    report["parallel"] = parallel
    print_report(report, console)
    path = write_report(report, output_dir)
    console.print(f"report: {path}")
    plot = write_step_plot(res, output_dir)
    console.print(f"step plot: {plot}" if plot is not None else
                  "step plot: skipped (matplotlib is not installed; pip install -e '.\\[plot]')")  # \[: not markup
    if parity is not None and not parity["ok"]:
        print("parity check FAILED: the backend's output differs from the torch reference (see report)",
              file=sys.stderr)
        return 1
    return 0
