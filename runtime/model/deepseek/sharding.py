"""Which slice of each DeepSeek tensor a tensor-parallel rank holds (Megatron style), by Hugging Face name.

* attention: ``q_b_proj`` (``q_proj`` without q LoRA) and ``kv_b_proj`` column-parallel over heads (rows of the
  ``[out, in]`` weight), ``o_proj`` row-parallel (its input columns of this rank's heads; the partial outputs
  are summed by an all-reduce); ``q_a_proj``, ``kv_a_proj_with_mqa``, the norms and the indexer replicated (every
  rank computes the whole latent, so each rank's KV cache holds the full latent for its heads);
* dense MLP and shared experts: ``gate_proj`` / ``up_proj`` column-parallel (rows), ``down_proj`` row-parallel
  (columns);
* routed experts: ``parallel.moe=tp`` cuts every expert like the dense MLP; ``parallel.moe=ep`` keeps whole
  experts ``[rank * E / tp, (rank + 1) * E / tp)`` and skips the others (they are never read); the router
  (``mlp.gate``) and its bias are replicated;
* ``embed_tokens`` and ``lm_head``: rows of this rank's vocabulary slice.

The checkpoint reader reads exactly these slices from the safetensors files; the seeded random weights generate
each full tensor and keep the same slice, so tp=1 and tp=N serve the same model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from runtime.core.model_spec import ModelSpec
from runtime.core.parallel import Sharding
from runtime.model.quantized import Weight, cat_rows

ALL = slice(None)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class Cut:
    """This rank's part of a tensor: ``pieces`` (index tuples, one slice per leading dim) concatenated along
    ``dim`` (one piece but for transformers' fused ``gate_up_proj`` under moe=tp: its gate and up halves)."""

    pieces: tuple[tuple[slice, ...], ...]
    dim: int = 0

    def apply(self, t: Weight) -> Weight:
        """This rank's part of a tensor, or of a block-fp8 weight (cut on whole scale blocks)."""
        parts = [t[p] for p in self.pieces]
        return parts[0] if len(parts) == 1 else cat_rows(parts, dim=self.dim)

    @property
    def replicated(self) -> bool:
        return all(s == ALL for p in self.pieces for s in p)


FULL = Cut(((ALL,),))


#: the vocabulary-parallel tensors of every DeepSeek model: each rank holds the rows of its vocabulary slice
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def rows(s: slice) -> Cut:
    """The rows ``s`` of a weight (column-parallel: output features), every column."""
    return Cut(((s,),))


def cols(s: slice) -> Cut:
    """The input columns ``s`` of a weight (row-parallel), every row."""
    return Cut(((ALL, s),))


def tensor_cut(name: str, shape: tuple[int, ...], spec: ModelSpec, shard: Sharding) -> Cut | None:
    """This rank's cut of the checkpoint tensor ``name`` of full ``shape``; None: another rank's expert (EP),
    not read here. ``spec`` is the full model's."""
    if shard.size == 1:
        return FULL
    s, part = spec, shard.part
    if name in VOCAB_PARALLEL:
        return rows(part(s.vocab_size))
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        return rows(part(s.num_heads, s.qk_head_dim))
    if name.endswith("self_attn.kv_b_proj.weight"):
        return rows(part(s.num_heads, s.qk_nope_head_dim + s.v_head_dim))
    if name.endswith("self_attn.o_proj.weight"):
        return cols(part(s.num_heads, s.v_head_dim))
    return mlp_cut(name, shape, s.n_routed_experts, shard)


def mlp_cut(name: str, shape: tuple[int, ...], n_experts: int, shard: Sharding) -> Cut | None:
    """The cut of an MLP tensor (routed experts, per expert or transformers' fused ones; a dense MLP's or the
    shared experts' ``gate_proj`` / ``up_proj`` / ``down_proj``), shared by DeepSeek-V3 and V4; any other name is
    replicated. None: another rank's expert (moe=ep)."""
    part = shard.part
    expert = _EXPERT.search(name)
    if expert is not None and shard.expert_parallel:
        return FULL if int(expert.group(1)) in experts_of(n_experts, shard) else None
    if name.endswith("mlp.experts.gate_up_proj"):  # transformers' fused [E, 2I, D]
        if shard.expert_parallel:
            return rows(part(n_experts))
        i = shape[1] // 2
        own = part(i)
        return Cut(((ALL, own), (ALL, slice(i + own.start, i + own.stop))), dim=1)
    if name.endswith("mlp.experts.down_proj"):  # fused [E, D, I]
        return rows(part(n_experts)) if shard.expert_parallel else Cut(((ALL, ALL, part(shape[2])),))
    if name.endswith(("gate_proj.weight", "up_proj.weight")):  # dense MLP, shared experts, routed experts (tp)
        return rows(part(shape[0]))
    if name.endswith("down_proj.weight"):
        return cols(part(shape[1]))
    return FULL


def experts_of(n_experts: int, shard: Sharding) -> range:
    """The routed experts a rank computes: all ``n_experts`` (moe=tp, every one cut), or its own (moe=ep)."""
    experts = range(n_experts)
    return experts[shard.part(n_experts)] if shard.expert_parallel else experts


def local_shape(shape: tuple[int, ...], cut: Cut) -> tuple[int, ...]:
    """The shape ``cut`` leaves of a tensor of ``shape`` (without materialising it)."""
    out = list(shape)
    for d in range(len(shape)):
        sizes = [len(range(shape[d])[p[d]]) if d < len(p) else shape[d] for p in cut.pieces]
        out[d] = sum(sizes) if d == cut.dim and len(cut.pieces) > 1 else sizes[0]
    return tuple(out)
