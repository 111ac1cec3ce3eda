"""Write a random Hugging Face checkpoint folder for any preset: the same seeded weights the preset serves, in the
layout of the official DeepSeek releases (per-expert tensors), readable by our loader and by transformers.

    python -m runtime.app.make_checkpoint model=deepseek_v3 model.num_layers=4 out=DIR [device=cuda] [fp8=true]

``out=DIR`` (required) and ``fp8=true`` (linear weights as fp8 e4m3 with 128 x 128 block scales, as the official
V3/V3.2 release; ``model.weights=fp8`` writes the preset's fp8 blocks as generated) are this command's own; every
other argument is a Hydra override of the runtime's config. The model type follows the preset: sparse layers -> deepseek_v32, a softmax router ->
deepseek_v2, else deepseek_v3. Shards of at most 4 GiB with ``model.safetensors.index.json`` when there are several.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file

from runtime.core.config import LayerKind
from runtime.core.device import probe_device
from runtime.core.errors import ConfigError, Problem
from runtime.core.model_spec import MLPLayer, ModelSpec
from runtime.model.deepseek.checkpoint import INDEX_FILE, SINGLE_FILE
from runtime.model.deepseek.hf_config import resolve_model_config
from runtime.model.deepseek.stored import release_fp8
from runtime.model.deepseek.weights import ModelWeights, random_weights
from runtime.model.quantized import BlockFP8, quantize_fp8

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
SHARD_BYTES = 4 << 30
ARCH = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
        "deepseek_v32": "DeepseekV32ForCausalLM"}


def model_type_of(spec: ModelSpec) -> tuple[str, list[Problem]]:
    """The Hugging Face model_type that has ``spec``'s semantics, and why there is none."""
    problems = []
    if spec.is_dsv4:
        return "deepseek_v4", [Problem(f"model '{spec.name}'", "a DeepSeek-V4 preset", "an MLA preset (this writer "
                                       "knows the V2/V3/V3.2 layout only)", "build a V4 folder with transformers' "
                                       "DeepseekV4ForCausalLM.save_pretrained")]
    if spec.linear_layers or MLPLayer.none in spec.mlp_kinds:
        problems.append(Problem(f"model '{spec.name}'", "linear-attention or attention-only (mlp=none) layers",
                                "DeepSeek decoder layers (model.mlp=deepseek, MLA layers)",
                                "pick a DeepSeek preset (deepseek_v3, deepseek_v3_tp8, deepseek_v32) or set model.mlp=deepseek"))
    mtype = ("deepseek_v32" if spec.sparse_layers else "deepseek_v2" if spec.scoring_func == "softmax"
             else "deepseek_v3")
    if spec.sparse_layers and set(spec.layer_kinds) != {LayerKind.sparse}:
        problems.append(Problem(f"model '{spec.name}'", "sparse and dense attention layers",
                                "every layer sparse (deepseek_v32)", "set model.layer_pattern=[sparse]"))
    if mtype != "deepseek_v3" and not spec.rope_interleave:
        problems.append(Problem(f"model '{spec.name}'", "rope_interleave=false", f"interleaved RoPE for {mtype}",
                                "set model.rope_interleave=true"))
    return mtype, problems


def hf_config(spec: ModelSpec, mtype: str, fp8: bool) -> dict:
    """config.json as transformers writes it (``rope_parameters`` spelling)."""
    rope = {"rope_type": spec.rope_type, "rope_theta": spec.rope_theta}
    if spec.rope_type == "yarn":
        rope.update(factor=spec.rope_factor, original_max_position_embeddings=spec.rope_original_max_position,
                    beta_fast=spec.rope_beta_fast, beta_slow=spec.rope_beta_slow, mscale=spec.rope_mscale,
                    mscale_all_dim=spec.rope_mscale_all_dim, truncate=spec.rope_truncate)
        if spec.rope_attention_factor_cfg is not None:
            rope["attention_factor"] = spec.rope_attention_factor_cfg
    cfg = {
        "architectures": [ARCH[mtype]], "model_type": mtype, "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "moe_intermediate_size": spec.moe_intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_heads,
        "n_shared_experts": spec.n_shared_experts, "n_routed_experts": spec.n_routed_experts,
        "routed_scaling_factor": spec.routed_scaling_factor, "kv_lora_rank": spec.kv_lora_rank,
        "q_lora_rank": spec.q_lora_rank, "qk_rope_head_dim": spec.qk_rope_head_dim,
        "qk_nope_head_dim": spec.qk_nope_head_dim, "v_head_dim": spec.v_head_dim, "n_group": spec.n_group,
        "topk_group": spec.topk_group, "num_experts_per_tok": spec.num_experts_per_tok,
        "first_k_dense_replace": _first_dense(spec), "norm_topk_prob": spec.norm_topk_prob, "hidden_act": "silu",
        "max_position_embeddings": spec.max_context, "rms_norm_eps": spec.rms_norm_eps, "rope_parameters": rope,
        "tie_word_embeddings": spec.tie_word_embeddings, "bos_token_id": 0,
        "eos_token_id": list(spec.eos_token_id) or 1, "attention_bias": False, "dtype": str(spec.dtype).removeprefix("torch."),
    }
    if mtype == "deepseek_v3":
        cfg["rope_interleave"] = spec.rope_interleave
    if mtype == "deepseek_v2":
        cfg["topk_method"] = spec.topk_method
    if mtype == "deepseek_v32":
        cfg.update(index_n_heads=spec.index_n_heads, index_head_dim=spec.index_head_dim, index_topk=spec.index_topk)
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return cfg


def _first_dense(spec: ModelSpec) -> int:
    return next((i for i, k in enumerate(spec.mlp_kinds) if k == MLPLayer.moe), spec.num_layers)


def hf_tensors(spec: ModelSpec, w: ModelWeights):
    """(name, tensor) in the official layout, one at a time (views of the model's weights)."""
    yield "model.embed_tokens.weight", w.embed
    for i, lw in enumerate(w.layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        at = lw.attn
        yield f"{p}.input_layernorm.weight", at.attn_norm
        if at.q_a is not None:
            yield f"{a}.q_a_proj.weight", at.q_a
            yield f"{a}.q_a_layernorm.weight", at.q_a_norm
            yield f"{a}.q_b_proj.weight", at.q_b
        else:
            yield f"{a}.q_proj.weight", at.q_b
        yield f"{a}.kv_a_proj_with_mqa.weight", at.kv_a
        yield f"{a}.kv_a_layernorm.weight", at.kv_a_norm
        kv_b = torch.cat([at.w_uk, at.w_uv.transpose(1, 2)], dim=1)  # [H, nope + v, kv_lora]
        yield f"{a}.kv_b_proj.weight", kv_b.reshape(-1, spec.kv_lora_rank)
        yield f"{a}.o_proj.weight", at.o
        if at.indexer is not None:
            x = f"{a}.indexer"
            yield from ((f"{x}.wq_b.weight", at.indexer.wq_b), (f"{x}.wk.weight", at.indexer.wk),
                        (f"{x}.k_norm.weight", at.indexer.k_norm_weight), (f"{x}.k_norm.bias", at.indexer.k_norm_bias),
                        (f"{x}.weights_proj.weight", at.indexer.weights_proj))
        if lw.mlp is None:
            continue
        yield f"{p}.post_attention_layernorm.weight", lw.mlp_norm
        if spec.mlp_kinds[i] == MLPLayer.dense:
            yield from _mlp_tensors(f"{p}.mlp", lw.mlp)
            continue
        m = lw.mlp
        yield f"{p}.mlp.gate.weight", m.gate
        if m.bias is not None:
            yield f"{p}.mlp.gate.e_score_correction_bias", m.bias
        for e in range(m.gate_up.shape[0]):
            inter = m.down.shape[2]
            yield f"{p}.mlp.experts.{e}.gate_proj.weight", m.gate_up[e, :inter]
            yield f"{p}.mlp.experts.{e}.up_proj.weight", m.gate_up[e, inter:]
            yield f"{p}.mlp.experts.{e}.down_proj.weight", m.down[e]
        if m.shared is not None:
            yield from _mlp_tensors(f"{p}.mlp.shared_experts", m.shared)
    yield "model.norm.weight", w.final_norm
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", w.lm_head


def _mlp_tensors(prefix: str, m):
    inter = m.down.shape[1]
    yield f"{prefix}.gate_proj.weight", m.gate_up[:inter]
    yield f"{prefix}.up_proj.weight", m.gate_up[inter:]
    yield f"{prefix}.down_proj.weight", m.down


def write_checkpoint(spec: ModelSpec, weights: ModelWeights, out: Path, fp8: bool = False,
                     shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Write config.json and the safetensors shards of ``weights`` to ``out``; returns the shard paths."""
    mtype, problems = model_type_of(spec)
    if problems:
        raise ConfigError(problems)
    out.mkdir(parents=True, exist_ok=True)
    fp8 = fp8 or spec.weights == "fp8"
    (out / "config.json").write_text(json.dumps(hf_config(spec, mtype, fp8), indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    files: list[Path] = []

    def flush() -> None:
        path = out / f"part-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(path), metadata={"format": "pt"})
        files.append(path)
        shards[-1] = {}

    for name, t in hf_tensors(spec, weights):
        parts = {name: t}
        if isinstance(t, BlockFP8):  # model.weights=fp8: the blocks as generated
            parts = {name: t.weight, name + "_scale_inv": t.scale}
        elif fp8 and release_fp8(name, tuple(t.shape)):
            q, s = quantize_fp8(t)
            parts = {name: q, name + "_scale_inv": s}
        for n, x in parts.items():
            x = x.detach().to("cpu").contiguous().clone()
            if size and size + x.numel() * x.element_size() > shard_bytes:
                flush()
                size = 0
            shards[-1][n] = x
            size += x.numel() * x.element_size()
    flush()
    if len(files) == 1:
        files[0] = files[0].rename(out / SINGLE_FILE)
    else:  # standard names: model-00001-of-0000N.safetensors, and the index
        n = len(files)
        weight_map = {}
        renamed = []
        for i, f in enumerate(files, 1):
            target = out / f"model-{i:05d}-of-{n:05d}.safetensors"
            f.rename(target)
            renamed.append(target)
            with safe_open(str(target), framework="pt") as h:
                weight_map.update({k: target.name for k in h.keys()})
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        files = renamed
    return files


def main(argv: list[str]) -> int:
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("out=")), None)
    fp8 = any(a in ("fp8=true", "fp8=True") for a in argv)
    overrides = [a for a in argv if not a.startswith(("out=", "fp8="))]
    if out is None:
        print("usage: python -m runtime.app.make_checkpoint model=PRESET [overrides...] out=DIR [fp8=true]",
              file=sys.stderr)
        return 2
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)
    model, problems = resolve_model_config(plain["model"])
    spec = ModelSpec.from_config(model)
    problems += model_type_of(spec)[1] if not problems else []
    if problems:
        print(str(ConfigError(problems)), file=sys.stderr)
        return 2
    device = probe_device(plain["device"]["kind"], plain["device"]["index"]).torch_device
    start = time.perf_counter()
    weights = random_weights(spec, device)
    files = write_checkpoint(spec, weights, Path(out), fp8=fp8)
    total = sum(f.stat().st_size for f in files)
    print(f"wrote {out}: {model_type_of(spec)[0]}, {spec.num_layers} layers, {len(files)} shard(s), "
          f"{total / (1 << 30):.2f} GiB in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
