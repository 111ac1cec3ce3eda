"""V4 MoE: a router (hash table or bias-corrected top-k over sqrtsoftplus / softmax / sigmoid scores), routed
SwiGLU experts and one shared SwiGLU expert, both with ``swiglu_limit`` clamps (gate <= limit, |up| <= limit).

Routing weights are the selected experts' scores, normalized to sum 1 (the reference always normalizes,
whatever ``norm_topk_prob`` says), times ``routed_scaling_factor``. A hash row may name an expert twice; both
picks count.

The routed experts run as V3's do: the (token, slot) pairs sorted by expert without a host sync, then, where
``torch._grouped_mm`` serves (CUDA bf16, SM90+: ``grouped_mm``), two grouped GEMMs for all experts; elsewhere one
GEMM pair per active expert (one host sync; the only path for experts held as stored, BlockFP8 / PackedFP4:
each expert dequantized as it runs, see :func:`runtime.model.deepseek.moe.routed_expert_sum`). The k outputs of a token are weighted and summed in float32 (float64
for a float64 model).

Tensor parallelism (the caller all-reduces the output): with moe=tp every expert and the shared expert hold a
slice of their intermediate dim (the clamps and SwiGLU are per channel, so each rank's down projection gives a
partial sum); with moe=ep a rank holds experts ``first_expert ..`` whole and the (token, expert) pairs of other
ranks' experts add 0 here. The router runs whole on every rank (same inputs, same choice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.deepseek.moe import routed_expert_sum
from runtime.model.dsv4.config import DSV4Config, ScoringFunc
from runtime.model.dsv4.weights import MoEWeights
from runtime.model.quantized import linear


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


def moe_forward(w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor | None, cfg: DSV4Config,
                grouped_mm: bool = False) -> torch.Tensor:
    """x [T, hidden] -> routed + shared expert output [T, hidden] in x's dtype (a rank's partial sum under tensor
    parallelism, see the module docstring). ``grouped_mm`` only for float expert stacks (the caller decides from
    their dtype)."""
    ids, weights = route(w, x, input_ids, cfg)
    limit = cfg.swiglu_limit
    acc = torch.promote_types(x.dtype, torch.float32)
    routed = routed_expert_sum(x, weights, ids, w.gate_up_proj, w.down_proj, w.first_expert, cfg.n_routed_experts,
                               lambda h: swiglu(*h.chunk(2, dim=-1), limit), grouped_mm, acc)
    shared = swiglu(linear(x, w.shared_gate_proj), linear(x, w.shared_up_proj), limit)
    return (routed + linear(shared, w.shared_down_proj).to(acc)).to(x.dtype)
