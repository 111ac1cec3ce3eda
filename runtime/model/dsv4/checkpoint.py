"""DeepSeek-V4 weights: the tensors a :class:`DSV4Config` implies (names and shapes of transformers'
``DeepseekV4ForCausalLM``), checked against a folder's safetensors headers, loaded shard by shard, or drawn at
random for a preset. One table (:func:`expected_tensors`) drives all three.

Tensor names: DeepSeek's release spelling (``layers.3.attn.wq_a.weight``, ``ffn.experts.7.w1.weight``,
``attn_sink``, ``compressor.ape``, ``hc_attn_fn``, ``head.weight``; what transformers' ``save_pretrained`` writes)
or transformers' own (``self_attn.q_a_proj``, fused ``experts.gate_up_proj``), mapped by :func:`hf_name`. Weights
in bf16/fp16/fp32/fp64 (``tid2eid`` int32/int64), or DeepSeek's release format: fp8 e4m3 matrices with ue8m0 block
scales (``<module>.scale``) and fp4 e2m1 routed experts, as config.json's ``quantization_config`` declares
(:mod:`runtime.model.dsv4.stored` checks them from the headers). ``model.weights=dequantize`` expands them to the
model dtype as each tensor is read (:mod:`runtime.model.quantized`: the loaded model holds ~2x the fp8 bytes in
bf16 and ~4x the fp4 bytes); ``model.weights=stored`` (the default for a quantized checkpoint) keeps fp8 matrices
as :class:`~runtime.model.quantized.BlockFP8` and fp4 experts as :class:`~runtime.model.quantized.PackedFP4` (on
the CPU every product dequantizes per weight, then multiplies; on CUDA the decoder ops' fp8 kernels and the fp4
expert kernels, see :mod:`runtime.model.dsv4.layer` and :mod:`runtime.model.deepseek.moe`). A
preset with ``model.weights=fp8`` generates the same formats (:func:`runtime.model.dsv4.stored.release_kind`).
Layers past ``num_layers`` and the MTP layers are not read.

Tensor parallelism: each rank reads only its slice of each tensor (:mod:`runtime.model.dsv4.sharding`), block-scaled
ones with the scale blocks that cover the slice; the seeded weights draw every full tensor and keep the slice.
"""

from __future__ import annotations

import re
import resource
import time
from collections import Counter
from pathlib import Path

import torch

from runtime.core.dsv4_spec import DSV4LayerType
from runtime.core.errors import CheckpointError, Problem
from runtime.core.parallel import ONE_RANK, Sharding
from runtime.model.deepseek.checkpoint import TensorInfo, _Reader, checkpoint_index, tensor_problems
from runtime.model.deepseek.sharding import experts_of
from runtime.model.dsv4.config import DSV4Config, MlpType
from runtime.model.dsv4.sharding import dsv4_tensor_cut
from runtime.model.dsv4.stored import StoredFormat, check_tensor, release_kind, scale_names, stored_layout_problems
from runtime.model.dsv4.weights import ModelWeights
from runtime.model.quantized import (
    FP4_GROUP,
    FP8_BLOCK,
    BlockFP8,
    PackedFP4,
    ScaledTensor,
    StoredKind,
    cat_rows,
    stack_weights,
)

INT_TENSORS = ("tid2eid",)
ROUTED = re.compile(r"\.mlp\.experts\.\d+\.")  # a routed expert's tensor (transformers' per-expert names)


def expected_tensors(cfg: DSV4Config) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor the model reads."""
    a, d, v = cfg.attention, cfg.hidden_size, cfg.vocab_size
    h, hd, n = a.num_heads, a.head_dim, cfg.hc_mult
    e, im, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d),
        "model.hc_head.hc_fn": (n, n * d), "model.hc_head.hc_base": (n,), "model.hc_head.hc_scale": (1,)}
    for i, kind in enumerate(a.layer_types):
        p = f"model.layers.{i}."
        s = p + "self_attn."
        out.update({
            s + "sinks": (h,), s + "q_a_proj.weight": (cfg.q_lora_rank, d), s + "q_a_norm.weight": (cfg.q_lora_rank,),
            s + "q_b_proj.weight": (h * hd, cfg.q_lora_rank), s + "kv_proj.weight": (hd, d),
            s + "kv_norm.weight": (hd,), s + "o_a_proj.weight": (cfg.o_groups * cfg.o_lora_rank, h * hd // cfg.o_groups),
            s + "o_b_proj.weight": (d, cfg.o_groups * cfg.o_lora_rank)})
        if kind != DSV4LayerType.sliding:
            rate = a.rate_of(i)
            width = 2 * hd if kind == DSV4LayerType.csa else hd
            out.update(_compressor(s + "compressor.", rate, width, hd, d))
        if kind == DSV4LayerType.csa:
            x = s + "compressor.indexer."
            di, hi = a.index_head_dim, a.index_n_heads
            out.update(_compressor(x, a.csa_rate, 2 * di, di, d))
            out.update({x + "q_b_proj.weight": (hi * di, cfg.q_lora_rank), x + "scorer.weights_proj.weight": (hi, d)})
        m = p + "mlp."
        out[m + "gate.weight"] = (e, d)
        if cfg.mlp_types[i] == MlpType.hash_moe:
            out[m + "gate.tid2eid"] = (v, k)
        else:
            out[m + "gate.e_score_correction_bias"] = (e,)
        out.update({m + "experts.gate_up_proj": (e, 2 * im, d), m + "experts.down_proj": (e, d, im),
                    m + "shared_experts.gate_proj.weight": (im, d), m + "shared_experts.up_proj.weight": (im, d),
                    m + "shared_experts.down_proj.weight": (d, im)})
        out.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)})
        for hc in ("attn_hc.", "ffn_hc."):
            out.update({p + hc + "fn": ((2 + n) * n, n * d), p + hc + "base": ((2 + n) * n,), p + hc + "scale": (3,)})
    return out


def _compressor(prefix: str, rate: int, width: int, dim: int, d: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "position_bias": (rate, width), prefix + "kv_proj.weight": (width, d),
            prefix + "gate_proj.weight": (width, d), prefix + "kv_norm.weight": (dim,)}


def _is_int(name: str) -> bool:
    return name.endswith(INT_TENSORS)


# DeepSeek's release names (what transformers' save_pretrained writes back) -> transformers' names, applied in
# order to a name without its "model." prefix. transformers' own names pass through unchanged.
RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"), (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.wq_b\.", ".q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."), (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."), (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
)]


def hf_name(name: str) -> str:
    """A checkpoint tensor name (release or transformers spelling) -> transformers' name."""
    n = name.removeprefix("model.")
    for pattern, repl in RENAMES:
        n = pattern.sub(repl, n)
    return n if n == "lm_head.weight" else "model." + n


def _per_expert(expected: dict, names: dict[str, str], cfg: DSV4Config) -> dict:
    """Layers whose checkpoint holds one tensor per expert (the release layout) expect those instead of the
    fused ``experts.gate_up_proj`` / ``experts.down_proj``."""
    out = dict(expected)
    e, im, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for i in range(cfg.attention.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        if p + "gate_up_proj" not in names and p + "0.gate_proj.weight" in names:
            del out[p + "gate_up_proj"], out[p + "down_proj"]
            for x in range(e):
                out.update({f"{p}{x}.gate_proj.weight": (im, d), f"{p}{x}.up_proj.weight": (im, d),
                            f"{p}{x}.down_proj.weight": (d, im)})
    return out


def scan_dsv4_checkpoint(cfg: DSV4Config, folder: str | Path, fmt: StoredFormat, shard: Sharding = ONE_RANK,
                         keep: bool = False) -> tuple[dict[str, TensorInfo], dict[str, str], dict,
                                                      dict[str, ScaledTensor], list[Problem]]:
    """Headers only: (index by checkpoint name, transformers name -> checkpoint name, expected transformers name
    -> shape, checkpoint name -> how to dequantize it (fp8 / fp4 tensors), every problem: missing or truncated
    shards, missing tensors, wrong shapes, dtypes we cannot serve, fp8 / fp4 tensors without their scale or with
    a scale or packed shape that does not match), each naming the tensor and its file, expected vs found. With
    ``keep`` (``model.weights=stored``) the fp8 / fp4 tensors' cuts under ``shard`` and the expert gate / up
    fusion must keep their scale blocks / groups whole (:func:`runtime.model.dsv4.stored.stored_layout_problems`)."""
    folder = Path(folder)
    index, problems = checkpoint_index(folder)
    if problems and not index:
        return index, {}, {}, {}, problems
    scales = scale_names(index)
    is_scale = set(scales.values())
    names: dict[str, str] = {}
    for orig in index:
        if orig not in is_scale:
            names.setdefault(hf_name(orig), orig)
    expected = _per_expert(expected_tensors(cfg), names, cfg)
    problems += tensor_problems(folder, {}, {n: s for n, s in expected.items() if n not in names})
    scaled: dict[str, ScaledTensor] = {}
    for name, shape in expected.items():
        orig = names.get(name)
        if orig is None:
            continue
        what = f"tensor {orig}" + (f" (transformers: {name})" if orig != name else "") + f" in {index[orig].file.name}"
        stored, found = check_tensor(what, orig, index, scales, shape, fmt, integer=_is_int(name),
                                     routed_expert=ROUTED.search(name) is not None)
        problems += found
        if stored is not None:
            scaled[orig] = stored
    if keep and not problems:
        layout = {n: (shape, scaled[names[n]].block) for n, shape in expected.items() if names.get(n) in scaled}
        problems += stored_layout_problems(cfg, shard, layout, checkpoint=True)
    return index, names, expected, scaled, problems


def load_dsv4_checkpoint(cfg: DSV4Config, folder: str | Path, fmt: StoredFormat, dtype: torch.dtype,
                         device: torch.device, shard: Sharding = ONE_RANK, weights: str = "dequantize"
                         ) -> ModelWeights:
    """Every tensor of :func:`expected_tensors` from ``folder``, in file order, one on the host at a time, cast to
    ``dtype`` (``tid2eid`` to int64; fp8 / fp4 tensors dequantized with their scales as they are read);
    per-expert tensors are stacked. Under tensor parallelism (``shard``) only this rank's slice of each tensor is
    read (:mod:`runtime.model.dsv4.sharding`; fp8 / fp4 slices with the scale blocks that cover them), and with
    moe=ep other ranks' experts not at all. ``cfg`` is the full model's. ``weights="stored"``: fp8 / fp4 tensors
    kept as stored (BlockFP8 / PackedFP4, cut on whole blocks / groups). Raises :class:`CheckpointError` listing
    every problem before reading."""
    start = time.perf_counter()
    keep = str(weights) == "stored"
    index, names, expected, scaled, problems = scan_dsv4_checkpoint(cfg, folder, fmt, shard, keep)
    if problems:
        raise CheckpointError(problems)
    cuts = {n: dsv4_tensor_cut(n, shape, cfg, shard) for n, shape in expected.items()}
    mine = [n for n in expected if cuts[n] is not None]
    reader = _Reader(index, torch.device(device), dtype, scaled, keep=lambda name: keep)
    state: dict[str, torch.Tensor] = {}
    try:
        for name in sorted(mine, key=lambda n: (str(index[names[n]].file), n)):
            state[name] = reader.get(names[name], torch.int64 if _is_int(name) else dtype, cut=cuts[name])
    finally:
        reader.close()
    experts = experts_of(cfg.n_routed_experts, shard)
    for i in range(cfg.attention.num_layers):  # the release layout: one tensor per expert
        p = f"model.layers.{i}.mlp.experts."
        if p + f"{experts.start}.gate_proj.weight" in state:
            state[p + "gate_up_proj"] = stack_weights([
                cat_rows([state.pop(f"{p}{x}.gate_proj.weight"), state.pop(f"{p}{x}.up_proj.weight")])
                for x in experts])
            state[p + "down_proj"] = stack_weights([state.pop(f"{p}{x}.down_proj.weight") for x in experts])
    weights = ModelWeights.load(state, cfg=cfg, first_expert=experts.start,
                                vocab_start=shard.part(cfg.vocab_size).start)
    weights.source = str(folder)
    weights.stored_dtypes = dict(Counter(index[names[n]].dtype for n in mine))
    weights.load_seconds = time.perf_counter() - start
    weights.peak_host_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return weights


def random_dsv4_weights(cfg: DSV4Config, seed: int, dtype: torch.dtype, device: torch.device,
                        shard: Sharding = ONE_RANK, weights: str = "bf16", fmt: StoredFormat | None = None
                        ) -> ModelWeights:
    """Seeded random weights of the shapes :func:`expected_tensors` lists, drawn on ``device``: matrices with
    std ``fan_in ** -0.5``, norms 1, sinks / position biases / mHC bases small, ``tid2eid`` uniform expert ids.
    Every value is drawn in float32 and then cast to ``dtype``, so a bf16 model and its float32 parity reference
    hold the same model (drawn in bf16, torch's normal sampler gives other values for small tensors: the mHC bases,
    sinks and biases of the two differed entirely, and the full-width preset failed parity with a relative error
    of 1.4). Under tensor parallelism (``shard``) every full tensor is drawn in the same order and this rank keeps its
    slice, so tp=1 and tp=N serve the same model (``cfg`` is the full model's). ``weights="fp8"``: the tensors
    the release stores quantized are quantized whole, then cut (fp8 e4m3 in ``fmt.fp8_block`` blocks, default
    128 x 128; routed experts as ``fmt.expert_dtype``, default fp4): the same draws as bf16, rounded."""
    quantized = str(weights) == "fp8"
    fmt = fmt or StoredFormat()
    block, experts = fmt.fp8_block or FP8_BLOCK, fmt.expert_dtype or StoredKind.fp4.value
    g = torch.Generator(device=device).manual_seed(int(seed))
    state: dict[str, torch.Tensor] = {}
    for name, shape in expected_tensors(cfg).items():
        if _is_int(name):
            t = torch.randint(0, cfg.n_routed_experts, shape, generator=g, device=device)
        elif name.endswith(("norm.weight", "layernorm.weight", "scale", "hc_scale")):
            t = torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(("sinks", "position_bias", "base", "hc_base", "e_score_correction_bias")):
            t = _normal(shape, 0.1, g, dtype, device)
        else:
            kind = release_kind(name, experts) if quantized else None
            t = (_normal(shape, shape[-1] ** -0.5, g, dtype, device) if kind is None
                 else _normal_quantized(shape, shape[-1] ** -0.5, g, dtype, device, kind, block))
        cut = dsv4_tensor_cut(name, shape, cfg, shard)  # never None: the experts are fused tensors here
        state[name] = t if cut.replicated else cut.apply(t).contiguous()
    return ModelWeights.load(state, cfg=cfg, first_expert=experts_of(cfg.n_routed_experts, shard).start,
                             vocab_start=shard.part(cfg.vocab_size).start)


DRAW_ROWS_ELEMENTS = 1 << 26  # float32 values drawn at once (256 MiB): the transient of a draw, whatever the tensor


def _normal(shape: tuple[int, ...], std: float, g: torch.Generator, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """Normal(0, std) values drawn in float32 and stored in ``dtype``, in slices of whole rows of at most
    ``DRAW_ROWS_ELEMENTS`` values: V4-Flash's stacked experts drawn whole in float32 took twice their bf16 bytes
    at once and ran an H200 out of memory. The slicing depends on the shape only, so every dtype gets one model."""
    out = torch.empty(shape, dtype=dtype, device=device)
    rows = out.view(-1, shape[-1]) if out.dim() else out.view(1, 1)
    step = max(1, DRAW_ROWS_ELEMENTS // max(1, rows.shape[1]))
    for i in range(0, rows.shape[0], step):
        part = rows[i:i + step]
        part.copy_(torch.randn(part.shape, generator=g, dtype=torch.float32, device=device).mul_(std))
    return out


def _normal_quantized(shape: tuple[int, ...], std: float, g: torch.Generator, dtype: torch.dtype,
                      device: torch.device, kind: StoredKind, block: tuple[int, int]) -> BlockFP8 | PackedFP4:
    """:func:`_normal`'s values (the same draws, in ``dtype``) in the release's ``kind``. A stack of experts [E, N,
    K] whose draw slices hold whole experts is quantized slice by slice into its stored form, never whole in
    ``dtype``: V4-Flash's gate_up stack is 16 GiB in float32 (the parity reference's dtype), a transient that ran
    an H200 out of memory beside the reference's cache. Other tensors (matrices, odd stacks) are drawn whole."""
    rows_per_draw = max(1, DRAW_ROWS_ELEMENTS // max(1, shape[-1]))
    if len(shape) != 3 or (rows_per_draw % shape[1] and rows_per_draw < shape[0] * shape[1]):
        return _quantized(_normal(shape, std, g, dtype, device), kind, block)
    e, n, k = shape
    out = None
    for first in range(0, e * n, rows_per_draw):  # _normal's slices: whole experts each (checked above)
        part = torch.randn((min(rows_per_draw, e * n - first), k), generator=g, dtype=torch.float32, device=device)
        part = part.mul_(std).to(dtype).view(-1, n, k)
        for i, w in enumerate(part):
            q = _quantized(w, kind, block)
            if out is None:  # the stack's storage, with the first expert's scale dtype
                out = (PackedFP4.empty(shape, device, q.group, q.scale.dtype) if kind == StoredKind.fp4
                       else BlockFP8.empty(shape, device, block))
            out[first // n + i] = q
    return out


def _quantized(t: torch.Tensor, kind: StoredKind, block: tuple[int, int]) -> BlockFP8 | PackedFP4:
    """A drawn tensor ([N, K], or a stack of experts [E, N, K]) in the release's ``kind``."""
    if kind == StoredKind.fp4:
        return PackedFP4.quantize(t, FP4_GROUP)
    if t.dim() > 2:
        return stack_weights([BlockFP8.quantize(x, block) for x in t])
    return BlockFP8.quantize(t, block)
