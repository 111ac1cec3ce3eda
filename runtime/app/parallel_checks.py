"""Startup validation of tensor parallelism (``parallel.*``): every problem, before anything is allocated or any
process group is started.

* the launch: ``WORLD_SIZE`` (torchrun) equal to ``parallel.tp``; on CUDA a GPU for every local rank;
* the model: heads, vocabulary, the dense MLP's and every expert's intermediate sizes (moe=tp) or the number of
  routed experts (moe=ep), and the shared experts' intermediate size, divisible by tp;
* what is not supported with tp > 1, each with its fix: DeepSeek-V4 and hybrid models (their attention is not
  sharded) and attention dumps.

The other checks (:func:`runtime.app.validation.validate`) see :func:`rank_view` of the config: the model with
this rank's share of the heads, which is what the attention backend runs with (its head-count rules apply to it).
"""

from __future__ import annotations

from collections.abc import Mapping

from runtime.core.config import LayerKind
from runtime.core.device import DeviceInfo
from runtime.core.errors import Problem
from runtime.core.model_spec import DSV4_MODEL_TYPE, ModelSpec
from runtime.core.parallel import LaunchEnv, torchrun_command


def _divisible(out: list[Problem], what: str, n: int, tp: int, fix: str) -> None:
    if n % tp:
        out.append(Problem(what, f"{n}, not divisible by parallel.tp={tp}",
                           f"a multiple of {tp} (each rank holds an equal share)", fix))


def _tp_choices(n: int, tp: int) -> str:
    """The tp values (<= 8 and <= n) that divide ``n``, for a fix."""
    ok = [t for t in range(1, min(n, max(tp, 8)) + 1) if n % t == 0]
    return f"parallel.tp in {ok}"


def rank_view(cfg: Mapping) -> dict:
    """``cfg`` as one rank runs it: ``model.num_heads / parallel.tp`` heads (unchanged when tp does not divide
    them: :func:`parallel_problems` reports that)."""
    tp, heads = cfg["parallel"]["tp"], cfg["model"]["num_heads"]
    if tp <= 1 or heads % tp:
        return dict(cfg)
    return {**cfg, "model": {**cfg["model"], "num_heads": heads // tp}}


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
    if tp == 1:
        return out
    if model.get("model_type") == DSV4_MODEL_TYPE:  # its own attention and pools, not sharded
        out.append(Problem(f"parallel.tp={tp} with model '{model['name']}'", "a DeepSeek-V4 model",
                           "an MLA model (DeepSeek-V2/V3/V3.2: the V4 attention, pools and weights are not sharded)",
                           "use parallel.tp=1 for DeepSeek-V4"))
        return out
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
