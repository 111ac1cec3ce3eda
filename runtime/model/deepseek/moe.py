"""DeepSeek MoE: routing (V2 softmax greedy / group-limited, V3 sigmoid noaux_tc), grouped expert compute, shared
experts.

Routing (float32, as the reference) is the one every DeepSeek model shares, :mod:`runtime.model.deepseek.routing`:
V2 softmax scores (greedy or group-limited greedy), V3 sigmoid scores with the bias-corrected ``noaux_tc`` choice.

Expert compute: the T*k (token, expert) pairs are sorted by expert, each active expert runs one GEMM over its
contiguous rows (``torch._grouped_mm`` does all of them in one launch with device-side offsets on CUDA bf16,
no host sync, so decode can be graphed; elsewhere a loop over the active experts only), the outputs are
weighted and summed back per token in float32 in a fixed order (graph replays equal eager runs bit for bit).
Experts held as packed fp4 (:class:`runtime.model.quantized.PackedFP4`, DeepSeek-V4's release) on a CUDA device,
with 16-bit activations and a :class:`GatedAct`, take the fp4 expert kernels (:mod:`backends.kernels.gemm.fp4_moe`:
packed bytes widened in registers; few tokens: two kernels, no sort; more: two grouped GEMMs), no host sync; on
the CPU they stay the torch loop (each active expert dequantized), the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.core.model_spec import ModelSpec
from runtime.model.deepseek import routing
from runtime.model.deepseek.mlp import dense_mlp
from runtime.model.deepseek.routing import spec_router
from runtime.model.deepseek.weights import MoEWeights
from runtime.model.quantized import PackedFP4, Weight, linear


@dataclass(frozen=True)
class GatedAct:
    """The experts' gate/up -> hidden op, callable ([n, 2 I] -> [n, I], torch ops, in h's dtype) and as data for
    the kernels that fuse it: ``limit`` None is silu(gate) * up (V2 / V3, :func:`runtime.model.deepseek.mlp.swiglu`),
    a float V4's clamped SwiGLU silu(min(gate, limit)) * clamp(up, -limit, limit)
    (:func:`runtime.model.dsv4.moe.swiglu`); the same ops as those, so the same bits."""

    limit: float | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        if self.limit is None:
            return F.silu(gate) * up
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


#: devices whose packed fp4 experts take the fp4 kernels (the CPU keeps the torch loop: the reference; the tests add
#: "cpu" to run the kernels in Triton's interpreter through this module)
FP4_KERNEL_DEVICES = ("cuda",)


def fp4_kernels_serve(x: torch.Tensor, gate_up: Weight, down: Weight, act) -> bool:
    """Whether :func:`routed_expert_sum` computes these experts with the fp4 kernels: both stacks packed fp4 in
    32-input groups, x bfloat16 / float16 on a device of :data:`FP4_KERNEL_DEVICES`, ``act`` a :class:`GatedAct`
    (a positive limit, or none). The sum is then float32 (``acc``; a float64 model keeps the torch loop)."""
    return (isinstance(gate_up, PackedFP4) and isinstance(down, PackedFP4) and isinstance(act, GatedAct)
            and (act.limit is None or act.limit > 0) and gate_up.group == down.group == 32
            and x.device.type in FP4_KERNEL_DEVICES
            and x.dtype in (torch.bfloat16, torch.float16))


def route(spec: ModelSpec, w: MoEWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] -> (weights [T, k] float32, expert ids [T, k] int64): the shared routing
    (:func:`runtime.model.deepseek.routing.route`) over float32 router logits."""
    return routing.route(spec_router(spec), F.linear(x.float(), w.gate.float()), w.bias)


@dataclass(frozen=True)
class GroupedMMSupport:
    """Where ``torch._grouped_mm`` serves the expert GEMMs, as data: device type, dtype, least compute
    capability, and the multiple every GEMM dim must be (16-byte rows in bf16)."""

    device_type: str
    dtype: torch.dtype
    min_capability: tuple[int, int]
    dim_multiple: int

    def odd_dims(self, dims: dict[str, int]) -> dict[str, int]:
        """The named dims that are not multiples of ``dim_multiple`` (empty: every one serves)."""
        return {k: v for k, v in dims.items() if v % self.dim_multiple}

    def usable(self, device: torch.device, dtype: torch.dtype, dims: tuple[int, ...]) -> bool:
        device = torch.device(device)
        if device.type != self.device_type or dtype != self.dtype:
            return False
        return (torch.cuda.get_device_capability(device) >= self.min_capability
                and not self.odd_dims(dict(enumerate(dims))))


#: the grouped expert GEMM (V3 and V4 MoE): CUDA, bf16, SM90+, dims multiples of 8
GROUPED_MM = GroupedMMSupport("cuda", torch.bfloat16, (9, 0), 8)


def local_expert_ids(w: MoEWeights, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert parallelism: ids [T, k] global expert ids -> (the same pairs' ids among this rank's experts
    ``w.first_expert ...``, with ``n_local`` for other ranks' experts: one extra group, sorted last and dropped;
    the [T, k] mask of this rank's pairs). A rank that holds every expert (no EP) gets ``(ids, None)``."""
    return local_ids(ids, w.first_expert, w.gate_up.shape[0], w.gate.shape[0])


def local_ids(ids: torch.Tensor, first_expert: int, n_local: int, n_experts: int
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`local_expert_ids` from the numbers (V3 and V4): this rank holds experts ``first_expert ..
    first_expert + n_local - 1`` of ``n_experts``."""
    if n_local == n_experts:
        return ids, None
    local = ids - first_expert
    mine = (local >= 0) & (local < n_local)
    return torch.where(mine, local, n_local), mine


def grouped_expert_mlp(xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offsets: torch.Tensor,
                       act) -> torch.Tensor:
    """Every expert's gated MLP over its rows of ``xs`` (grouped by expert; ``offsets`` int32, the inclusive
    cumulative row counts) in two ``torch._grouped_mm`` launches: gate_up [E, 2 * I, D], down [E, D, I];
    ``act``: the gate/up -> hidden op. V3 and V4 experts both run through here."""
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offsets)
    return torch._grouped_mm(act(h), down.transpose(1, 2), offs=offsets)


def sort_by_expert(flat_ids: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flat_ids [T * k] expert ids in ``0 .. num_groups - 1`` -> (order [T * k]: the (token, slot) pairs grouped
    by expert, stable; counts [num_groups] int64), with no host sync (bincount would read the max id back):
    graph-capturable."""
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(num_groups, dtype=torch.int64, device=flat_ids.device).scatter_add_(
        0, flat_ids, torch.ones_like(flat_ids))
    return order, counts


def routed_experts(w: MoEWeights, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                   grouped_mm: bool) -> torch.Tensor:
    """Sum over each token's k experts of weight * expert(x), for the experts this rank holds (``w.gate_up``:
    all experts, possibly cut to a slice of their intermediate dim, or with expert parallelism experts
    ``w.first_expert ...`` whole; the other pairs contribute 0 here and are summed in by the caller's all-reduce).
    x [T, D]; weights [T, k] float32; ids [T, k] global expert ids -> [T, D] float32."""
    return routed_expert_sum(x, weights, ids, w.gate_up, w.down, w.first_expert, w.gate.shape[0], GatedAct(),
                             grouped_mm, torch.float32)


def routed_expert_sum(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: Weight,
                      down: Weight, first_expert: int, n_experts: int, act, grouped_mm: bool,
                      acc: torch.dtype) -> torch.Tensor:
    """The routed experts of V3 and V4 from the numbers: the (token, slot) pairs sorted by expert with no host
    sync, two grouped GEMMs for every expert (``grouped_mm``) or a GEMM pair per active expert (one host sync),
    then back to (token, slot) order and summed with the routing ``weights`` in ``acc`` (a fixed-order sum,
    deterministic: no atomics). gate_up [E_local, 2 I, D], down [E_local, D, I] hold experts ``first_expert ..``
    of ``n_experts`` (other ranks' pairs add 0 here; block-fp8 stacks take the per-expert loop, each expert
    dequantized as it runs; packed fp4 stacks the fp4 kernels where :func:`fp4_kernels_serve`, no host sync: few
    tokens the decode kernels without a sort, more the grouped GEMMs); ``act``: [n, 2 I] -> [n, I]. -> [T, D] in
    ``acc``."""
    t, k = ids.shape
    n_local = gate_up.shape[0]
    local, mine = local_ids(ids, first_expert, n_local, n_experts)
    fp4 = fp4_kernels_serve(x, gate_up, down, act) and acc == torch.float32
    if fp4:
        from backends.kernels.gemm import fp4_moe  # imports triton: only where the kernels run

        if t <= fp4_moe.few_tokens_max(x.shape[1], gate_up.weight.shape[1] // 2):  # every (token, slot) pair
            # streams its expert; other ranks' (id n_local) add 0
            return fp4_moe.fp4_moe_experts(x.contiguous(), local.contiguous(), weights.float().contiguous(),
                                           gate_up.weight, gate_up.scale, down.weight, down.scale, act.limit,
                                           out_dtype=acc)
    order, counts = sort_by_expert(local.reshape(-1), n_local + 1)  # other ranks' pairs: one last group, dropped
    counts = counts[:n_local]
    xs = x[order // k]  # [T * k, D], grouped by expert
    if fp4:  # rows past the last offset (other ranks' pairs) are left unwritten: masked below
        y = fp4_moe.fp4_grouped_expert_mlp(xs, gate_up.weight, gate_up.scale, down.weight, down.scale,
                                           counts.cumsum(0).to(torch.int32), limit=act.limit)
    elif grouped_mm:
        y = grouped_expert_mlp(xs, gate_up, down, counts.cumsum(0).to(torch.int32), act)
    else:
        y = torch.zeros_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):  # one host sync; a GEMM pair per active expert only
            if n:
                y[start : start + n] = linear(act(linear(xs[start : start + n], gate_up[e])), down[e])
                start += n
    unsorted = torch.empty(t * k, x.shape[1], dtype=acc, device=x.device)
    unsorted[order] = y.to(acc)
    if mine is not None:  # other ranks' pairs: rows past the last group, not computed here
        unsorted = torch.where(mine.view(-1, 1), unsorted, 0.0)
    return (unsorted.view(t, k, -1) * weights.to(acc)[:, :, None]).sum(dim=1)


def moe(spec: ModelSpec, w: MoEWeights, x: torch.Tensor, grouped_mm: bool) -> torch.Tensor:
    """x [T, D] -> routed experts + shared experts [T, D] in x's dtype. With tensor parallelism this rank's
    partial sum (routed and shared together: one all-reduce per MoE layer, by the caller)."""
    weights, ids = route(spec, w, x)
    out = routed_experts(w, x, weights, ids, grouped_mm).to(x.dtype)
    if w.shared is not None:
        out = out + dense_mlp(w.shared, x)
    return out
