"""Which slice of each DeepSeek-V4 tensor a tensor-parallel rank holds, by transformers name (the checkpoint
reader reads exactly these slices; the seeded weights generate each full tensor and keep the same slice, so tp=1
and tp=N serve the same model).

* attention: query heads split over the ranks: ``q_b_proj`` rows of this rank's heads, ``sinks`` of its heads.
  The grouped output projection is block-diagonal over ``o_groups`` groups of consecutive heads
  (``o_a_proj`` [G * R, H * D / G]: rows ``g * R .. (g + 1) * R`` map group g's flattened head outputs to its
  R-wide slot of the [G * R] vector ``o_b_proj`` [hidden, G * R] mixes). With ``G % tp == 0`` a rank's heads are
  exactly groups ``rank * G / tp ..``: it holds those groups' ``o_a_proj`` rows (each group's input width is
  unchanged) and ``o_b_proj``'s columns of those groups (row-parallel). With ``tp % G == 0`` each group's heads
  are split over ``tp / G`` ranks: a rank holds its group's ``o_a_proj`` rows, only the input columns of its own
  heads (so its R-wide group output is a partial sum), and ``o_b_proj``'s columns of its group; ``o_b_proj`` being
  linear, the partial outputs still add up. Either way one all-reduce sums them. The KV row is shared by every head
  (MQA), so ``q_a_proj``, ``kv_proj``, the norms, the compressors and the indexer are replicated: every rank
  computes the whole KV, the entries and the top-k, and keeps full pools.
* MoE (as V3, :func:`runtime.model.deepseek.sharding.mlp_cut`): routed experts cut along their intermediate dim
  (``parallel.moe=tp``) or whole experts ``[rank * E / tp, (rank + 1) * E / tp)`` (``ep``, the others never read);
  the shared expert column-parallel (``gate_proj`` / ``up_proj`` rows) and row-parallel (``down_proj`` columns);
  the router (``gate.weight``, ``e_score_correction_bias``) and the hash table (``tid2eid``) replicated.
* ``embed_tokens`` and ``lm_head``: rows of this rank's vocabulary slice (vocabulary-parallel, as V3).
* mHC (``attn_hc``, ``ffn_hc``, ``hc_head``), the layer norms and the final norm: replicated.
"""

from __future__ import annotations

from dataclasses import replace

from runtime.core.parallel import Sharding
from runtime.model.deepseek.sharding import ALL, FULL, VOCAB_PARALLEL, Cut, mlp_cut, rows
from runtime.model.dsv4.config import DSV4Config


def dsv4_tensor_cut(name: str, shape: tuple[int, ...], cfg: DSV4Config, shard: Sharding) -> Cut | None:
    """This rank's cut of the V4 tensor ``name`` (transformers' spelling) of full ``shape``; None: another rank's
    expert (moe=ep), not read here. ``cfg`` is the full model's."""
    if shard.size == 1:
        return FULL
    part, a = shard.part, cfg.attention
    if name in VOCAB_PARALLEL:
        return rows(part(cfg.vocab_size))
    if name.endswith("self_attn.q_b_proj.weight"):
        return rows(part(a.num_heads, a.head_dim))
    if name.endswith("self_attn.sinks"):
        return rows(part(a.num_heads))
    if name.endswith("self_attn.o_a_proj.weight"):
        out_rows, in_cols = output_slices(cfg, shard)
        return Cut(((out_rows, in_cols),))
    if name.endswith("self_attn.o_b_proj.weight"):
        return Cut(((ALL, output_slices(cfg, shard)[0]),))
    if ".mlp." in name:  # the compressors' gate_proj is attention's (replicated), not an MLP's
        return mlp_cut(name, shape, cfg.n_routed_experts, shard)
    return FULL


def output_slices(cfg: DSV4Config, shard: Sharding) -> tuple[slice, slice]:
    """This rank's ``o_a_proj`` rows (its groups' R-wide blocks, which are also its ``o_b_proj`` columns) and
    ``o_a_proj`` input columns (all of them when it holds whole groups; its heads' share of its group's when
    ``tp`` is a multiple of ``o_groups``)."""
    groups, r = cfg.o_groups, cfg.o_lora_rank
    if groups % shard.size == 0:
        return shard.part(groups, r), ALL
    per_group = shard.size // groups  # ranks sharing one group (validation: tp % o_groups == 0)
    group, j = divmod(shard.rank, per_group)
    width = cfg.attention.num_heads * cfg.attention.head_dim // groups // per_group
    return slice(group * r, (group + 1) * r), slice(j * width, (j + 1) * width)


def rank_config(cfg: DSV4Config, tp: int) -> DSV4Config:
    """The config one of ``tp`` ranks computes with: ``num_heads / tp`` query heads and ``o_groups / tp`` output
    groups, or one (partial) group when tp is a multiple of ``o_groups`` (its weights' shapes); the pools,
    compressors and indexer are the full model's. Validation has checked the divisibility
    (:mod:`runtime.app.parallel_checks`)."""
    if tp == 1:
        return cfg
    return replace(cfg, attention=replace(cfg.attention, num_heads=cfg.attention.num_heads // tp),
                   o_groups=rank_o_groups(cfg.o_groups, tp))


def rank_o_groups(o_groups: int, tp: int) -> int:
    """Output groups one of ``tp`` ranks holds: ``o_groups / tp`` whole ones, or one (a share of it) when tp is a
    multiple of ``o_groups``."""
    return max(o_groups // tp, 1)
