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

import re
from collections.abc import Callable

import torch

from runtime.core.errors import Problem
from runtime.core.model_spec import ModelSpec
from runtime.core.parallel import Sharding
from runtime.model.deepseek.sharding import Cut, local_shape, tensor_cut
from runtime.model.quantized import FP8_BLOCK

#: name fragments of the tensors the V3 release keeps in bf16 / float32 (``make_checkpoint`` writes the same)
NOT_FP8 = ("norm", "embed_tokens", "lm_head", "mlp.gate.", "e_score_correction_bias", "weights_proj")
#: fp8 in the release, held in the model dtype here (the absorbed path's per-head products)
DEQUANTIZED = ("self_attn.kv_b_proj.weight",)
#: the MoE router and the safetensors dtype the V3 release stores it in (presets generate its values so)
ROUTER, RELEASE_ROUTER = "mlp.gate.weight", "BF16"
_SIXTEEN_BIT = {"BF16": torch.bfloat16, "F16": torch.float16}


def router_dtype(stored: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the MoE router is held in, from its stored safetensors dtype and the model's: the model's 16-bit
    dtype when stored in it (the V3 release's bf16), else float32. The logits are float32 either way: the float32
    product of 16-bit values is exact from those bits (tensor cores with float32 output, or the few-row kernel
    widening them), at half the bytes and without a float32 GEMM."""
    return dtype if _SIXTEEN_BIT.get(stored) == dtype else torch.float32


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


#: name -> (full unpacked shape, scale block: fp8 (rows, cols), fp4 (1, group)) of the tensors held as stored
Stored = dict[str, tuple[tuple[int, ...], tuple[int, int]]]
#: (name, full shape, sharding) -> this rank's cut of the tensor (None: another rank's expert)
CutOf = Callable[[str, tuple[int, ...], Sharding], "Cut | None"]


def cut_splits(stored: Stored, size: int, moe: str, cut_of: CutOf, fused_first: Callable[[str], bool]
               ) -> dict[str, tuple[str, tuple[int, int], list[str]]]:
    """Kind of stored tensor -> (an example name, its scale block, what splits a block) when ``size`` ranks cut
    the tensors (every rank; one tensor per kind and shape: the layers repeat them): a cut of the last two dims
    off a block boundary, or a load-time fusion along the rows (``fused_first``: the tensor fused with the next;
    transformers' fused gate_up stacks: their two pieces) whose first part is not a whole number of blocks."""
    kinds: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, int]]] = {}
    for name, (shape, block) in stored.items():
        kinds.setdefault((re.sub(r"\.\d+(?=\.)", "", name), shape), (name, block))
    out: dict[str, tuple[str, tuple[int, int], list[str]]] = {}
    for (kind, shape), (name, block) in kinds.items():
        last = len(shape) - 2  # the row dim; the column dim follows
        bad: list[str] = []
        for rank in range(size):
            cut = cut_of(name, shape, Sharding(rank, size, moe))
            if cut is None:
                continue
            for piece in cut.pieces:
                for d in (last, last + 1):
                    r = range(shape[d])[piece[d] if d < len(piece) else slice(None)]
                    b = block[d - last]
                    if r.start % b or (r.stop % b and r.stop != shape[d]):
                        bad.append(f"rank {rank}: dim {d} cut at [{r.start}, {r.stop}) of {shape[d]}")
            if len(cut.pieces) > 1 and cut.dim >= last:  # transformers' fused gate_up: gate rows, then up rows
                rows = len(range(shape[cut.dim])[cut.pieces[0][cut.dim]])
            elif fused_first(name):
                rows = local_shape(shape, cut)[last]
            else:
                continue
            if rows % block[0]:
                bad.append(f"rank {rank}: {rows} rows fused with the next tensor's")
        if bad:
            out.setdefault(kind, (name, block, bad))
    return out


def layout_problems(stored: Stored, shard: Sharding, cut_of: CutOf, fused_first: Callable[[str], bool],
                    tp_splits_model: Callable[[int], bool], fix_value: str) -> list[Problem]:
    """Every kind of stored tensor whose tensor-parallel cut or load-time fusion would split an fp8 scale block or
    an fp4 scale group (:func:`cut_splits`): one problem per kind, the fix ``model.weights=<fix_value>`` or the
    ``parallel.tp`` values (of 1, 2, 4, 8, 16 that ``tp_splits_model`` allows) that keep every block whole."""
    bad = cut_splits(stored, shard.size, shard.moe, cut_of, fused_first)
    if not bad:
        return []
    ok = [tp for tp in (1, 2, 4, 8, 16) if tp != shard.size and tp_splits_model(tp)
          and not cut_splits(stored, tp, shard.moe, cut_of, fused_first)]
    other = f"parallel.tp in {ok}" if ok else "no parallel.tp keeps every block whole"
    out = []
    for name, block, why in bad.values():
        fp4 = block[0] == 1
        unit = (f"whole {block[1]}-input fp4 scale groups ({block[1] // 2} bytes)" if fp4
                else f"whole {block[0]} x {block[1]} fp8 scale blocks")
        out.append(Problem(f"{'fp4' if fp4 else 'fp8'} weight {name} (and its kind in every layer)",
                           "; ".join(why[:4]) + (f"; {len(why) - 4} more" if len(why) > 4 else ""),
                           f"cuts and fusions on {unit} (parallel.tp={shard.size}, parallel.moe={shard.moe})",
                           f"model.weights={fix_value} ({other})"))
    return out


def block_layout_problems(spec: ModelSpec, shard: Sharding, fp8: dict[str, tuple[int, ...]],
                          block: tuple[int, int] = FP8_BLOCK) -> list[Problem]:
    """V2 / V3 / V3.2: every stored fp8 tensor (``fp8``: name -> full shape; ``kv_b_proj``, held dequantized, is
    left out) whose tensor-parallel cut or load-time fusion would split a ``block`` (:func:`layout_problems`)."""
    stored = {n: (shape, block) for n, shape in fp8.items() if kept_fp8(n)}
    return layout_problems(
        stored, shard, lambda n, shape, sh: tensor_cut(n, shape, spec, sh), _fused_first,
        lambda tp: not spec.num_heads % tp and not (spec.n_routed_experts and spec.n_routed_experts % tp),
        "dequantize" if spec.path else "bf16")
