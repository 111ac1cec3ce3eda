"""V4 MoE: a router (hash table or bias-corrected top-k over sqrtsoftplus / softmax / sigmoid scores: the routing
every DeepSeek model shares, :mod:`runtime.model.deepseek.routing`), routed SwiGLU experts and one shared SwiGLU
expert, both with ``swiglu_limit`` clamps (gate <= limit, |up| <= limit): the clamps are V4's own.

Routing weights are the selected experts' scores, normalized to sum 1 (the reference always normalizes,
whatever ``norm_topk_prob`` says), times ``routed_scaling_factor``. A hash row may name an expert twice; both
picks count.

The routed experts run as V3's do: the (token, slot) pairs sorted by expert without a host sync, then, where
``torch._grouped_mm`` serves (CUDA bf16, SM90+: ``grouped_mm``), two grouped GEMMs for all experts; packed fp4
experts (the release's) on a CUDA device in bf16 / fp16 the fp4 expert kernels (:mod:`backends.kernels.gemm.fp4_moe`,
the clamped SwiGLU fused, no host sync); elsewhere one GEMM pair per active expert (one host sync; BlockFP8 experts,
and the CPU's reference for PackedFP4: each expert dequantized as it runs, see
:func:`runtime.model.deepseek.moe.routed_expert_sum`). The k outputs of a token are weighted and summed in float32
(float64 for a float64 model).

The shared expert's three products go through the injected decoder ops' ``linear`` (block-fp8 kernels on CUDA, the
torch product elsewhere: :mod:`runtime.model.deepseek.ops`), the routing and the shared expert's clamped SwiGLU
through their ``v4_route`` / ``v4_swiglu`` (one kernel each on CUDA; :mod:`runtime.model.dsv4.routing` holds the
torch reference that ``TorchOps`` runs).

Tensor parallelism (the caller all-reduces the output): with moe=tp every expert and the shared expert hold a
slice of their intermediate dim (the clamps and SwiGLU are per channel, so each rank's down projection gives a
partial sum); with moe=ep a rank holds experts ``first_expert ..`` whole and the (token, expert) pairs of other
ranks' experts add 0 here. The router runs whole on every rank (same inputs, same choice).
"""

from __future__ import annotations

import torch

from runtime.model.deepseek.moe import GatedAct, routed_expert_sum
from runtime.model.deepseek.ops import FusedOps, TorchOps
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.routing import route, swiglu, v4_router  # noqa: F401  (the torch reference, re-exported)
from runtime.model.dsv4.weights import MoEWeights


def moe_forward(w: MoEWeights, x: torch.Tensor, input_ids: torch.Tensor | None, cfg: DSV4Config,
                ops: TorchOps | FusedOps, grouped_mm: bool = False) -> torch.Tensor:
    """x [T, hidden] -> routed + shared expert output [T, hidden] in x's dtype (a rank's partial sum under tensor
    parallelism, see the module docstring). ``grouped_mm`` only for float expert stacks (the caller decides from
    their dtype); the ops route (``v4_route``: :func:`route`), multiply the shared expert (``linear``) and apply
    its clamped SwiGLU (``v4_swiglu``: :func:`runtime.model.dsv4.routing.swiglu`)."""
    ids, weights = ops.v4_route(w, x, input_ids, cfg)
    limit = cfg.swiglu_limit
    acc = torch.promote_types(x.dtype, torch.float32)
    routed = routed_expert_sum(x, weights, ids, w.gate_up_proj, w.down_proj, w.first_expert, cfg.n_routed_experts,
                               GatedAct(limit), grouped_mm, acc)
    shared = ops.v4_swiglu(ops.linear(x, w.shared_gate_proj), ops.linear(x, w.shared_up_proj), limit)
    # routed [T, hidden] in acc + the shared output promoted to acc, rounded once to x's dtype: one launch (the
    # bits of (routed + shared.to(acc)).to(x.dtype))
    return torch.add(routed, ops.linear(shared, w.shared_down_proj), out=torch.empty(x.shape, dtype=x.dtype,
                                                                                       device=x.device))
