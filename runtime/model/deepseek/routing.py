"""MoE routing of every DeepSeek model (V2, V3, V3.2, V4): router scores -> the k experts of each token and their
weights.

* scores: ``softmax`` (V2), ``sigmoid`` (V3), ``sqrtsoftplus`` (V4's default: sqrt(softplus(logits))) of the
  router logits;
* the choice: a hash table's row per token id (V4's first layers: ``tid2eid``; a row may name an expert twice,
  both picks count), or top-k of the choice scores: the scores plus ``e_score_correction_bias`` where the layer has
  one (V3, V4), limited to the ``topk_group`` best of ``n_group`` expert groups (:class:`GroupLimit`):
  ``best_expert`` (V2 ``group_limited_greedy``: groups ranked by their best score, the others' scores zeroed) or
  ``top2_sum`` (V3 ``noaux_tc``: groups ranked by the sum of their top-2 choice scores, the others excluded);
* the weights: the unbiased scores of the chosen experts, renormalised to sum 1 when ``normalize`` (+ ``norm_eps``
  in the denominator: 1e-20 for V3 / V4, none for V2), times ``routed_scaling_factor``.

The math runs in the logits' dtype (V2 / V3 pass float32 logits, as their reference; V4 the model dtype's).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.core.model_spec import ModelSpec


class ScoringFunc(str, enum.Enum):
    """Router logits -> scores."""

    softmax = "softmax"  # V2
    sigmoid = "sigmoid"  # V3
    sqrtsoftplus = "sqrtsoftplus"  # V4


class GroupLimit(str, enum.Enum):
    """Which expert groups the top-k may pick from."""

    none = "none"  # every expert (V2 greedy, V4)
    best_expert = "best_expert"  # V2 group_limited_greedy: groups by their best score, the others zeroed
    top2_sum = "top2_sum"  # V3 noaux_tc: groups by the sum of their top-2 choice scores, the others excluded


@dataclass(frozen=True)
class Router:
    """One model's routing rule, as data.

    Attributes
    ----------
    scoring : ScoringFunc
    top_k : int
        Experts per token.
    routed_scaling_factor : float
    normalize : bool
        Renormalise the k weights to sum 1.
    norm_eps : float
        Added to the weights' sum before dividing (0.0: none).
    group_limit : GroupLimit
    n_group, topk_group : int
        Expert groups and how many survive (``group_limit`` other than none, ``n_group > 1``).
    sorted : bool
        Whether the top-k ids come in score order (V2 / V3) or torch's unsorted order (V4's reference); the k
        outputs of a token are summed in this order.
    """

    scoring: ScoringFunc
    top_k: int
    routed_scaling_factor: float
    normalize: bool
    norm_eps: float = 1e-20
    group_limit: GroupLimit = GroupLimit.none
    n_group: int = 1
    topk_group: int = 1
    sorted: bool = True


def spec_router(spec: ModelSpec) -> Router:
    """V2 / V3 / V3.2's router from the :class:`ModelSpec`: softmax (greedy or group-limited greedy; renormalised
    only when ``norm_topk_prob`` and k > 1, no eps) or sigmoid (``noaux_tc`` groups; renormalised + 1e-20 when
    ``norm_topk_prob``)."""
    k = spec.num_experts_per_tok
    if spec.scoring_func == "softmax":
        limit = GroupLimit.best_expert if spec.topk_method == "group_limited_greedy" else GroupLimit.none
        return Router(ScoringFunc.softmax, k, spec.routed_scaling_factor, spec.norm_topk_prob and k > 1, 0.0,
                      limit, spec.n_group, spec.topk_group)
    return Router(ScoringFunc.sigmoid, k, spec.routed_scaling_factor, spec.norm_topk_prob, 1e-20,
                  GroupLimit.top2_sum, spec.n_group, spec.topk_group)


def router_scores(logits: torch.Tensor, fn: ScoringFunc) -> torch.Tensor:
    """logits [T, E] -> scores [T, E] in the logits' dtype."""
    if fn == ScoringFunc.sqrtsoftplus:
        return F.softplus(logits).sqrt()
    if fn == ScoringFunc.softmax:
        return torch.softmax(logits, dim=-1)
    return torch.sigmoid(logits)


def group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """[T, G] group scores -> [T, E] bool: experts of the ``topk_group`` best groups."""
    t, g = group_scores.shape
    best = torch.topk(group_scores, topk_group, dim=-1).indices
    mask = torch.zeros(t, g, dtype=torch.bool, device=group_scores.device).scatter_(1, best, True)
    return mask[:, :, None].expand(t, g, num_experts // g).reshape(t, num_experts)


def route(r: Router, logits: torch.Tensor, bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
          input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64). ``bias`` [E]: the
    choice's correction; ``tid2eid`` [vocab, k]: a hash layer's table, read at ``input_ids`` [T]."""
    scores = router_scores(logits, r.scoring)
    if tid2eid is not None:
        if input_ids is None:
            raise ValueError("hash MoE layer: got input_ids=None; expected the token ids [T]. Fix: pass the "
                             "step's token ids to the model forward.")
        ids = tid2eid[input_ids].long()
    else:
        t, e = scores.shape
        grouped = r.group_limit != GroupLimit.none and r.n_group > 1
        if r.group_limit == GroupLimit.best_expert and grouped:
            keep = group_mask(scores.view(t, r.n_group, e // r.n_group).amax(dim=-1), r.topk_group, e)
            scores = scores.masked_fill(~keep, 0.0)
        choice = scores + bias.to(scores.dtype) if bias is not None else scores
        if r.group_limit == GroupLimit.top2_sum and grouped:
            per = e // r.n_group
            group = choice.view(t, r.n_group, per).topk(min(2, per), dim=-1).values.sum(dim=-1)
            choice = choice.masked_fill(~group_mask(group, r.topk_group, e), float("-inf"))
        ids = torch.topk(choice, r.top_k, dim=-1, sorted=r.sorted).indices
    weights = scores.gather(1, ids)
    if r.normalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + r.norm_eps if r.norm_eps else total)
    return weights * r.routed_scaling_factor, ids
