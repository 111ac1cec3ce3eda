"""Startup validation of tensor parallelism (``parallel.*``): every problem, before anything is allocated or any
process group is started.

* the launch: ``WORLD_SIZE`` (torchrun) equal to ``parallel.tp``; on CUDA a GPU for every local rank;
* the model: heads, vocabulary, the dense MLP's and every expert's intermediate sizes (moe=tp) or the number of
  routed experts (moe=ep), and the shared experts' intermediate size, divisible by tp; DeepSeek-V4
  (:func:`dsv4_parallel_problems`): heads, ``o_groups`` (a multiple or a divisor of tp: the grouped output
  projection is cut by groups, or each group by heads), vocabulary, the experts' intermediate size (moe=tp) or their number (moe=ep), and the shared expert's width;
* what is not supported with tp > 1, each with its fix: hybrid models (linear-attention layers are not sharded)
  and attention dumps;
* the all-reduce (:func:`allreduce_problems`): ``oneshot`` / ``fused`` only where the ranks are one node of GPUs
  with peer access (CUDA IPC), a power of two up to 8; the sizes positive.

The other checks (:func:`runtime.app.validation.validate`) see :func:`rank_view` of the config: the model with
this rank's share of the heads (and, DeepSeek-V4, of the output groups), which is what the attention backend runs
with (its head-count rules apply to it).
"""

from __future__ import annotations

from collections.abc import Mapping

from backends.kernels.comm.peer_allreduce import peer_access_problem
from runtime.core.config import LayerKind, ParallelConfig
from runtime.core.device import DeviceInfo
from runtime.core.errors import Problem
from runtime.core.model_spec import DSV4_MODEL_TYPE, ModelSpec
from runtime.core.parallel import LaunchEnv, torchrun_command
from runtime.model.dsv4.sharding import rank_o_groups


def _divisible(out: list[Problem], what: str, n: int, tp: int, fix: str) -> None:
    if n % tp:
        out.append(Problem(what, f"{n}, not divisible by parallel.tp={tp}",
                           f"a multiple of {tp} (each rank holds an equal share)", fix))


def _tp_choices(n: int, tp: int) -> str:
    """The tp values (<= 8 and <= n) that divide ``n``, for a fix."""
    ok = [t for t in range(1, min(n, max(tp, 8)) + 1) if n % t == 0]
    return f"parallel.tp in {ok}"


def rank_view(cfg: Mapping) -> dict:
    """``cfg`` as one rank runs it: ``model.num_heads / parallel.tp`` heads, and for DeepSeek-V4 also
    ``model.v4.o_groups / parallel.tp`` output groups (one when tp is a multiple of them); unchanged when tp does
    not split them (:func:`parallel_problems` reports that)."""
    tp, model = cfg["parallel"]["tp"], cfg["model"]
    heads, v4 = model["num_heads"], model.get("v4")
    if model.get("model_type") == DSV4_MODEL_TYPE and v4:
        groups = v4.get("o_groups") or 0
        if tp <= 1 or groups < 1 or not dsv4_output_tp(heads, groups, tp):
            return dict(cfg)
        local = {**v4, "o_groups": rank_o_groups(groups, tp)}
        return {**cfg, "model": {**model, "num_heads": heads // tp, "v4": local}}
    if tp <= 1 or heads % tp:
        return dict(cfg)
    return {**cfg, "model": {**model, "num_heads": heads // tp}}


def parallel_problems(cfg: Mapping, launch: LaunchEnv, device: DeviceInfo) -> list[Problem]:
    """Every problem of ``cfg['parallel']`` with this launch, model and backend (see the module docstring).
    ``cfg['model']`` is resolved (its optional fields filled)."""
    out: list[Problem] = []
    add = out.append
    par, model = cfg["parallel"], cfg["model"]
    tp, moe = par["tp"], str(par["moe"])
    if tp < 1:
        return [Problem("parallel.tp", str(tp), ">= 1", "set parallel.tp=1 (one process) or the number of GPUs")]
    if launch.world_size != tp:
        how = (f"WORLD_SIZE={launch.world_size} (torchrun)" if launch.launched
               else "one process (started without torchrun)")
        add(Problem("parallel.tp", f"{tp} with {how}", f"WORLD_SIZE equal to parallel.tp ({tp}): one process per rank",
                    f"launch with `{torchrun_command(tp)}`" if tp > 1 else
                    f"set parallel.tp={launch.world_size}, or run without torchrun"))
    if device.kind == "cuda" and tp > 1 and device.cuda_available:
        import torch

        n = torch.cuda.device_count()
        if launch.local_rank >= n:
            add(Problem("parallel.tp", f"LOCAL_RANK {launch.local_rank} with {n} GPU(s) visible on this node",
                        "one GPU per process on each node", f"use --nproc-per-node {n} or fewer per node "
                        "(several nodes: --nnodes), or make more GPUs visible (CUDA_VISIBLE_DEVICES)"))
    out += allreduce_problems(par, launch, device)
    if tp == 1:
        return out
    if model.get("model_type") == DSV4_MODEL_TYPE:  # its own attention, pools and weights (+dump_dir: its checks)
        return out + dsv4_parallel_problems(model, tp, moe)
    spec = ModelSpec.from_config(model)
    fix_tp = _tp_choices(spec.num_heads, tp)
    _divisible(out, "model.num_heads", spec.num_heads, tp, f"use {fix_tp} (attention heads are split over the ranks)")
    _divisible(out, "model.vocab_size", spec.vocab_size, tp,
               f"use {_tp_choices(spec.vocab_size, tp)} (the embedding and LM head are split by vocabulary)")
    kinds = set(spec.mlp_kinds)
    if "dense" in {k.value for k in kinds}:
        _divisible(out, "model.intermediate_size", spec.intermediate_size, tp,
                   f"use {_tp_choices(spec.intermediate_size, tp)} (the dense MLP is split)")
    if spec.has_moe:
        if moe == "ep":
            _divisible(out, "model.n_routed_experts (parallel.moe=ep)", spec.n_routed_experts, tp,
                       f"use {_tp_choices(spec.n_routed_experts, tp)}, or parallel.moe=tp")
        else:
            _divisible(out, "model.moe_intermediate_size (parallel.moe=tp)", spec.moe_intermediate_size, tp,
                       f"use {_tp_choices(spec.moe_intermediate_size, tp)}, or parallel.moe=ep")
        if spec.n_shared_experts:
            _divisible(out, "shared experts' intermediate size (moe_intermediate_size x n_shared_experts)",
                       spec.moe_intermediate_size * spec.n_shared_experts, tp,
                       f"use {_tp_choices(spec.moe_intermediate_size * spec.n_shared_experts, tp)}")
    if LayerKind.linear in spec.layer_kinds:
        add(Problem(f"parallel.tp={tp} with model '{spec.name}'", "linear-attention layers (a hybrid model)",
                    "MLA layers only (linear-attention layers and their state pool are not sharded)",
                    "use parallel.tp=1 for hybrid models"))
    if cfg.get("dump_dir"):
        add(Problem(f"parallel.tp={tp} with +dump_dir", "attention dumps of one rank's heads",
                    "dumps with one rank (they hold every head of layer 0)", "drop +dump_dir, or use parallel.tp=1"))
    return out


def dsv4_output_tp(heads: int, groups: int, tp: int) -> bool:
    """Whether tp ranks can split DeepSeek-V4's heads and its grouped output projection: heads divisible by tp,
    and each rank whole groups (``groups % tp == 0``) or one group's share (``tp % groups == 0``)."""
    return heads % tp == 0 and (groups % tp == 0 or tp % groups == 0)


def dsv4_parallel_problems(model: Mapping, tp: int, moe: str) -> list[Problem]:
    """A DeepSeek-V4 model under tp > 1 (:mod:`runtime.model.dsv4.sharding`): query heads split over the ranks,
    each rank holding whole output groups or a share of one (``o_groups`` a multiple or a divisor of tp), the
    vocabulary, and the routed experts' width (moe=tp) or number (moe=ep) and the shared expert's width, each
    divisible by tp. ``model.v4`` has passed its own checks when this runs, or is reported there."""
    v4, out = model.get("v4") or {}, []
    heads, groups = model["num_heads"], v4.get("o_groups") or 0
    if groups < 1:
        return out  # reported by runtime.app.dsv4_validation
    fits = [t for t in range(1, heads + 1) if dsv4_output_tp(heads, groups, t)]
    _divisible(out, "model.num_heads", heads, tp, f"use parallel.tp in {fits} (query heads are split over the ranks)")
    if groups % tp and tp % groups:
        out.append(Problem("model.v4.o_groups", f"{groups} with parallel.tp={tp}",
                           "o_groups a multiple of tp (each rank whole output groups) or a divisor of it (each group "
                           "split over tp / o_groups ranks)", f"use parallel.tp in {fits}"))
    _divisible(out, "model.vocab_size", model["vocab_size"], tp,
               f"use {_tp_choices(model['vocab_size'], tp)} (the embedding and LM head are split by vocabulary)")
    width, experts = model["moe_intermediate_size"], model["n_routed_experts"]
    if moe == "ep":
        _divisible(out, "model.n_routed_experts (parallel.moe=ep)", experts, tp,
                   f"use {_tp_choices(experts, tp)}, or parallel.moe=tp")
        _divisible(out, "the shared expert's intermediate size (model.moe_intermediate_size)", width, tp,
                   f"use {_tp_choices(width, tp)} (the shared expert is split by its width)")
    else:
        _divisible(out, "model.moe_intermediate_size (parallel.moe=tp: routed and shared experts)", width, tp,
                   f"use {_tp_choices(width, tp)}, or parallel.moe=ep")
    return out


def allreduce_problems(par: Mapping, launch: LaunchEnv, device: DeviceInfo) -> list[Problem]:
    """``parallel.allreduce`` and its sizes: ``oneshot`` / ``fused`` need ranks that can read each other's GPU
    memory (:func:`backends.kernels.comm.peer_allreduce.peer_access_problem`); ``auto`` falls back to NCCL there
    and is never refused. One rank: nothing is reduced, every mode is accepted."""
    out, mode, tp = [], str(par.get("allreduce", "auto")), par["tp"]
    defaults = vars(ParallelConfig())
    for key, least in (("oneshot_max_bytes", 0), ("fused_max_bytes", 0), ("ipc_buffer_bytes", 1)):
        if int(par.get(key, least)) < least:
            out.append(Problem(f"parallel.{key}", str(par[key]), f"a number of bytes >= {least}",
                               f"drop the override (default {defaults[key]})"))
    if mode in ("oneshot", "fused") and tp > 1:
        why = peer_access_problem(tp, device.kind, launch.local_world_size)
        if why:
            out.append(Problem(f"parallel.allreduce={mode}", why,
                               "one node of 2, 4 or 8 GPUs that can read each other's memory (CUDA IPC / NVLink)",
                               "parallel.allreduce=nccl (or auto, which picks NCCL where the kernels cannot run)"))
    return out
