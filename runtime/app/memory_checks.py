"""The memory plan of a config, and every reason it cannot fit, before anything large is allocated.

:func:`plan_memory` is the container's ``memory_budget`` provider: it reads the device through the injected
reader, fills the plan's lines (:mod:`runtime.app.memory_estimate`), sizes ``kv.num_pages=auto`` (the smallest
count over the tensor-parallel ranks), and plans the parity reference, which runs after this run's model is freed.
:func:`memory_problems` lists every over-budget line with its fix; ``containers.build`` raises them.
"""

from __future__ import annotations

import gc

import torch

from backends.base import CudaGraphLevel
from backends.kernels.comm.peer_allreduce import planned_bytes as allreduce_bytes
from runtime.app.memory_estimate import (
    activation_bytes,
    graph_bytes,
    hisparse_bytes,
    min_pages,
    pool_bytes,
    weight_bytes,
    workspace_bytes,
)
from runtime.app.parity import reference_config
from runtime.core.batch import ForwardMode
from runtime.core.device import DeviceInfo
from runtime.core.errors import Problem
from runtime.core.memory_plan import CPU_NUM_PAGES, GiB, MemoryPlan, MemoryReader, PlanLine, agree_pages
from runtime.core.model_spec import ModelSpec
from runtime.model.deepseek.ops import GEMM_COUNTERS, FusedOps, select_ops

SHOWN_SHARE = 0.01  # an over-budget refusal lists every line with a fix that holds at least this share of the peak


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def _weight_fix(plain: dict, weights: int, budget: int, rest: int) -> str:
    model, tp = plain["model"], plain["parallel"]["tp"]
    layers = int(model["num_layers"])
    fit = max(0, int(layers * (budget - rest) / weights)) if weights else layers
    fixes = [f"fewer layers (model.num_layers={fit})" if 0 < fit < layers else "fewer layers (model.num_layers)",
             f"parallel.tp={tp * 2} (each rank holds its share)"]
    if model.get("weights") in ("auto", "bf16") and not model.get("path"):
        fixes.append("model.weights=fp8 (the release's block-fp8)")
    return ", or ".join(fixes)


def plan_memory(plain: dict, backends: dict[str, type], info: DeviceInfo, reader: MemoryReader, group,
                reference: bool = True) -> MemoryPlan:
    """The memory plan of ``plain`` (resolved config; ``kv.num_pages`` may be ``auto``) on this rank; ``backends``:
    name -> backend class (its ``workspace_specs`` size the workspace lines)."""
    tp, moe = plain["parallel"]["tp"], plain["parallel"]["moe"]
    spec = ModelSpec.from_config(plain["model"]).for_rank(tp)
    kv, mem, work = plain["kv"], plain["memory"], plain["workload"]
    on_cpu = info.kind != "cuda"
    dev, host = reader.device(info.torch_device), reader.host()
    plan = MemoryPlan(info.name, dev.total, dev.free, host.total, host.free, on_cpu, float(mem["fraction"]),
                      int(kv["page_size"]), min_pages=min_pages(plain, spec))
    weights = weight_bytes(plain["model"], tp, moe, group.rank)
    for dtype, n in sorted(weights.items(), key=lambda kv_: -kv_[1]):
        plan.fixed.append(PlanLine(f"weights: {dtype}", n, "weights"))  # the fix is filled below (needs the rest)
    for name, n in workspace_bytes(plain, backends, spec, info).items():
        plan.fixed.append(PlanLine(f"workspace: {name}", n, "a smaller workspace (backend / workspace keys)"))
    if select_ops(plain["model"]["fused"], info, spec.dtype) == FusedOps.name:  # the fused ops' split-K counters
        plan.fixed.append(PlanLine(f"workspace: {GEMM_COUNTERS.name}", GEMM_COUNTERS.nbytes, "model.fused=off"))
    if ipc := allreduce_bytes(plain["parallel"], info.kind):  # the all-reduce's symmetric buffer (one-shot / fused)
        plan.fixed.append(PlanLine("workspace: allreduce_ipc", ipc, "parallel.ipc_buffer_bytes or parallel.allreduce=nccl"))
    prefill = backends[plain["backend"]["name"]].capabilities.graph_level(ForwardMode.EXTEND) >= CudaGraphLevel.ALWAYS
    plan.fixed.append(PlanLine("cuda graphs (pool of the largest captured batches)",
                               graph_bytes(plain, spec, not on_cpu, prefill),
                               "graph=off, or smaller graph.batch_sizes / graph.prefill_tokens"))
    given = mem.get("activation_bytes")
    plan.activation = "given (memory.activation_bytes)" if given is not None else "estimated"
    plan.fixed.append(PlanLine(f"activation peak of the largest step ({plan.activation})",
                               int(given) if given is not None else activation_bytes(plain, spec),
                               f"lower workload.max_tokens_per_batch (now {work['max_tokens_per_batch']}) or "
                               f"workload.max_running_requests (now {work['max_running_requests']})"))
    two, three = pool_bytes(plain, spec, 2), pool_bytes(plain, spec, 3)
    for name in two:
        per_page = three[name] - two[name]  # (HiSparse's host slots round up: a few pages' bytes counted over)
        if two[name] - 2 * per_page > 0:
            plan.fixed.append(PlanLine(name, two[name] - 2 * per_page, "lower kv.max_requests"))
        if per_page:
            plan.paged.append(PlanLine(name, per_page, "kv.num_pages"))
    (d2, h2), (_, h3) = hisparse_bytes(plain, spec, 2), hisparse_bytes(plain, spec, 3)
    if d2:
        plan.fixed.append(PlanLine("hisparse device buffers", d2, "lower hisparse.device_buffer_size or kv.max_requests"))
        plan.paged.append(PlanLine("hisparse host pool", h3 - h2, "lower hisparse.host_to_device_ratio or kv.num_pages",
                                   host=True))
    plan.auto = kv["num_pages"] == "auto"
    if not plan.auto:
        plan.num_pages = int(kv["num_pages"])
    elif on_cpu:
        plan.num_pages = CPU_NUM_PAGES
    else:  # the device's pages; with HiSparse also what its pinned host pool leaves of the host's memory
        host_fit = int(plan.fraction * (host.free - plan.fixed_bytes(True))) // max(1, plan.page_bytes(True))
        plan.num_pages = agree_pages(min(plan.pages_that_fit(plan.fraction), max(0, host_fit)), group)
    fixed, per_page = plan.on_device()  # what the weights must leave room for: the other lines, the smallest pool
    rest = fixed - sum(weights.values()) + plan.min_pages * per_page
    plan.fixed = [PlanLine(x.name, x.nbytes, _weight_fix(plain, sum(weights.values()), plan.budget, rest))
                  if x.fix == "weights" else x for x in plan.fixed]
    if reference and plain["check"] != "off":
        ref_cfg = reference_config({**plain, "kv": {**kv}})
        plan.reference = plan_memory(ref_cfg, backends, info, reader, group, reference=False)
        skip = memory_problems(plan.reference, ref_cfg)
        if skip:
            plan.reference_skip = ("the float32 reference does not fit this device even after this run's model is "
                                   f"freed: {skip[0]} ({len(skip)} line(s) over). Fix: check=off, fewer layers "
                                   "(model.num_layers), or parallel.tp")
    return plan


def memory_problems(plan: MemoryPlan, plain: dict) -> list[Problem]:
    """Every reason ``plan`` cannot run: too few pages for one request, and when the peak exceeds what the device
    (or, for a GPU run's pinned pools, the host) has, every line of the budget that a user can shrink, with its fix
    and the numbers."""
    out: list[Problem] = []
    fixed, per_page = plan.on_device()
    where = f"{plan.device} ({'host memory' if plan.on_cpu else 'device memory'})"
    if plan.num_pages < plan.min_pages:
        fit = plan.pages_that_fit(plan.fraction if plan.auto else 1.0)
        got = (f"kv.num_pages=auto left {plan.num_pages} pages ({_gib(plan.budget - fixed)} of {_gib(plan.budget)} "
               f"free after the fixed lines, x memory.fraction {plan.fraction:g})" if plan.auto
               else f"{plan.num_pages} pages")
        if plan.auto or fit < plan.min_pages:
            out.append(Problem("kv pool (memory plan)", got,
                               f">= {plan.min_pages} pages of {plan.page_size} tokens (one longest request)",
                               "shrink the lines listed below, or raise memory.fraction" if plan.auto else
                               "free device memory, or shrink the other lines"))
    peak = fixed + plan.num_pages * per_page
    over = peak > plan.budget
    if over:
        out.append(Problem(f"memory plan on {where}", f"a predicted peak of {_gib(peak)}",
                           f"<= {_gib(plan.budget)} free ({_gib(plan.total)} total)",
                           "any of the fixes of the lines below"))
    if not plan.on_cpu and plan.peak_bytes(True) > plan.host_free:
        out.append(Problem("memory plan on the host (pinned pools)", _gib(plan.peak_bytes(True)),
                           f"<= {_gib(plan.host_free)} available host memory",
                           "lower hisparse.host_to_device_ratio or kv.num_pages"))
    if not (over or plan.num_pages < plan.min_pages and plan.auto):
        return out
    lines = [(x, x.nbytes) for x in plan.fixed if not x.host or plan.on_cpu]
    lines += [(x, x.nbytes * plan.num_pages) for x in plan.paged if not x.host or plan.on_cpu]
    fit = plan.pages_that_fit()
    for line, n in sorted(lines, key=lambda ln: -ln[1]):
        if n < SHOWN_SHARE * max(peak, 1) or not line.fix:
            continue
        fix = line.fix
        if line in plan.paged:
            fix = (f"kv.num_pages={fit} (what fits beside the rest; {fit * plan.page_size} tokens), or "
                   "kv.num_pages=auto" if fit >= plan.min_pages else
                   f"kv.num_pages={plan.min_pages} (one request) after shrinking the other lines")
        out.append(Problem(f"memory plan line '{line.name}'", f"{_gib(n)} of the {_gib(peak)} peak",
                           f"the peak within {_gib(plan.budget)}", fix))
    return out


def agree_problems(problems: list[Problem], group) -> list[Problem]:
    """Under tensor parallelism a rank that refuses makes every rank refuse (each rank measures its own device;
    a rank that went on alone would wait forever in its first collective)."""
    if group.size <= 1:
        return problems
    every = group.gather_objects([str(p) for p in problems])
    others = [Problem(f"rank {r}", f"{len(ps)} memory problem(s): {ps[0]}", "every rank fits", "see that rank")
              for r, ps in enumerate(every) if ps and r != group.rank]
    return problems + others


def release(runtime) -> None:
    """Drop every object ``runtime``'s container built (model, pools, graphs, workspaces) and hand the allocator's
    cached blocks back to the device: the next model is built in the memory this one held."""
    runtime.container.reset_singletons()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_released(runtime, run):
    """``run(runtime.engine)``, then :func:`release` the runtime (also when the run raises)."""
    try:
        return run(runtime.engine)
    finally:
        release(runtime)
