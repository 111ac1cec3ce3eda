"""DeepSeek-V4's router and the clamped SwiGLU of its experts, in torch: the reference that the decoder ops'
``TorchOps.v4_route`` / ``v4_swiglu`` run and their fused kernels are checked against (the MoE block that calls them
through the ops: :mod:`runtime.model.dsv4.moe`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.deepseek import routing
from runtime.model.deepseek.routing import Router
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.weights import MoEWeights


def v4_router(cfg: DSV4Config) -> Router:
    """V4's routing rule: its scores, top-k of the bias-corrected scores in torch's unsorted order (as the
    reference), no expert groups, weights always renormalised (+1e-20) and scaled."""
    return Router(cfg.scoring_func, cfg.num_experts_per_tok, cfg.routed_scaling_factor, normalize=True,
                  norm_eps=1e-20, sorted=False)


def route(w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor | None, cfg: DSV4Config
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> (expert ids [T, k] int64, weights [T, k] in x's dtype): the shared routing
    (:func:`runtime.model.deepseek.routing.route`) over logits in x's dtype, by the hash table on hash layers."""
    weights, ids = routing.route(v4_router(cfg), F.linear(x, w.gate), w.e_score_correction_bias, w.tid2eid,
                                 input_ids)
    return ids, weights


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """V4's clamped SwiGLU: silu(min(gate, limit)) * clamp(up, -limit, limit), in the inputs' dtype."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
