"""V4 MoE: a router (hash table or bias-corrected top-k over sqrtsoftplus / softmax / sigmoid scores), routed
SwiGLU experts and one shared SwiGLU expert, both with ``swiglu_limit`` clamps (gate <= limit, |up| <= limit).

Routing weights are the selected experts' scores, normalized to sum 1 (the reference always normalizes,
whatever ``norm_topk_prob`` says), times ``routed_scaling_factor``. A hash row may name an expert twice; both
picks count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.dsv4.config import DSV4Config, ScoringFunc
from runtime.model.dsv4.weights import MoEWeights


def router_scores(logits: torch.Tensor, fn: ScoringFunc) -> torch.Tensor:
    if fn == ScoringFunc.sqrtsoftplus:
        return F.softplus(logits).sqrt()
    if fn == ScoringFunc.softmax:
        return torch.softmax(logits, dim=-1)
    return torch.sigmoid(logits)


def route(w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor | None, cfg: DSV4Config
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> (expert ids [T, k] int64, weights [T, k] in x's dtype)."""
    scores = router_scores(F.linear(x, w.gate), cfg.scoring_func)
    if w.tid2eid is not None:
        if input_ids is None:
            raise ValueError("hash MoE layer: got input_ids=None; expected the token ids [T]. Fix: pass the "
                             "step's token ids to the model forward.")
        ids = w.tid2eid[input_ids].long()
    else:
        biased = scores + w.e_score_correction_bias.to(scores.dtype)
        ids = torch.topk(biased, cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe_forward(w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor | None, cfg: DSV4Config) -> torch.Tensor:
    """x [T, hidden] -> routed + shared expert output [T, hidden]."""
    ids, weights = route(w, x, input_ids, cfg)
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        gate_up = F.linear(x[tok], w.gate_up_proj[e])
        g, u = gate_up.chunk(2, dim=-1)
        y = F.linear(swiglu(g, u, cfg.swiglu_limit), w.down_proj[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    shared = swiglu(F.linear(x, w.shared_gate_proj), F.linear(x, w.shared_up_proj), cfg.swiglu_limit)
    return out + F.linear(shared, w.shared_down_proj)
