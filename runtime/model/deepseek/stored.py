"""Which DeepSeek weights stay block-fp8 under ``model.weights=stored`` / ``fp8``, and the block rule that tensor
parallelism and the load-time fusions must respect.

The V3 / V3.2 releases store every linear layer of attention, the dense MLP and the experts (and the V3.2
indexer's ``wq_b`` / ``wk``) as e4m3 with a float32 scale per 128 x 128 block; the embedding, ``lm_head``, the
norms, the router and the indexer's ``weights_proj`` are bf16 / float32 (:func:`release_fp8`).

Held in 16 bits even when stored (:data:`DEQUANTIZED`): ``kv_b_proj``, which the absorbed MLA splits into the
per-head ``w_uk`` / ``w_uv`` products of ``q_nope`` and the latent output (as SGLang and vLLM hold it); it is
dequantized once at load and counted in the report's 16-bit bytes.

Block rule: a stored weight is cut (tensor parallelism) or fused (``q_a`` with ``kv_a``, ``gate`` with ``up``) only
on whole scale blocks; :func:`block_layout_problems` lists every cut or fusion that would split one, before
anything is read or allocated, with the valid ``parallel.tp`` values as the fix.
"""

from __future__ import annotations

from runtime.core.errors import Problem
from runtime.core.model_spec import ModelSpec
from runtime.core.parallel import Sharding
from runtime.model.deepseek.sharding import local_shape, tensor_cut
from runtime.model.quantized import FP8_BLOCK

#: name fragments of the tensors the V3 release keeps in bf16 / float32 (``make_checkpoint`` writes the same)
NOT_FP8 = ("norm", "embed_tokens", "lm_head", "mlp.gate.", "e_score_correction_bias", "weights_proj")
#: fp8 in the release, held in the model dtype here (the absorbed path's per-head products)
DEQUANTIZED = ("self_attn.kv_b_proj.weight",)


def release_fp8(name: str, shape: tuple[int, ...]) -> bool:
    """Whether DeepSeek's fp8 release stores the tensor ``name`` (of ``shape``) as block-fp8."""
    return len(shape) == 2 and name.endswith(".weight") and not any(k in name for k in NOT_FP8)


def kept_fp8(name: str) -> bool:
    """Whether an fp8 tensor of the checkpoint stays fp8 on the device (``model.weights=stored``)."""
    return not name.endswith(DEQUANTIZED)


def _fused_first(name: str) -> bool:
    """The tensors fused with the one after them along their rows at load: ``q_a_proj`` (then
    ``kv_a_proj_with_mqa``) and every ``gate_proj`` (then ``up_proj``)."""
    return name.endswith(("self_attn.q_a_proj.weight", "gate_proj.weight"))


def _splits(spec: ModelSpec, size: int, moe: str, fp8: dict[str, tuple[int, ...]],
            block: tuple[int, int]) -> dict[str, tuple[str, list[str]]]:
    """Kind of tensor -> (an example name, what splits a block) under ``size`` ranks (rank 1 stands for every
    rank but the first: its cut starts where any rank's cut may)."""
    shard = Sharding(min(1, size - 1), size, moe)
    out: dict[str, tuple[str, list[str]]] = {}
    for name, shape in fp8.items():
        cut = tensor_cut(name, shape, spec, shard) if kept_fp8(name) else None
        if cut is None:
            continue
        bad = []
        for piece in cut.pieces:
            for d, s in enumerate(piece[:2] if len(shape) == 2 else ()):
                r = range(shape[d])[s]
                if r.start % block[d] or (r.stop % block[d] and r.stop != shape[d]):
                    bad.append(f"dim {d} cut at [{r.start}, {r.stop}) of {shape[d]}")
        rows = local_shape(shape, cut)[0]
        if _fused_first(name) and rows % block[0]:
            bad.append(f"{rows} rows fused with the next tensor's (not a whole number of {block[0]}-row blocks)")
        if bad:
            out.setdefault(".".join(p for p in name.split(".") if not p.isdigit()), (name, bad))
    return out


def block_layout_problems(spec: ModelSpec, shard: Sharding, fp8: dict[str, tuple[int, ...]],
                          block: tuple[int, int] = FP8_BLOCK) -> list[Problem]:
    """Every stored fp8 tensor (``fp8``: name -> full shape) whose tensor-parallel cut or load-time fusion would
    split a ``block``: one problem per kind of tensor, with the tensor-parallel sizes that work as a fix."""
    bad = _splits(spec, shard.size, shard.moe, fp8, block)
    if not bad:
        return []
    ok = [tp for tp in (1, 2, 4, 8, 16) if tp != shard.size and not spec.num_heads % tp
          and not (spec.n_routed_experts and spec.n_routed_experts % tp)
          and not _splits(spec, tp, shard.moe, fp8, block)]
    other = f"parallel.tp in {ok}" if ok else "no parallel.tp keeps every block whole"
    fix = f"model.weights={'dequantize' if spec.path else 'bf16'} ({other})"
    return [Problem(f"fp8 weight {name} (and its kind in every layer)", "; ".join(why),
                    f"cuts and fusions on whole {block[0]} x {block[1]} scale blocks (parallel.tp={shard.size})", fix)
            for name, why in bad.values()]
