"""Sharded weights: every rank's slices put back together are the tp=1 tensors, for the seeded presets (generated
whole, then cut) and for checkpoints read slice by slice (bf16 and block-fp8, whose slices need not align with the
128 x 128 scale blocks), with moe=tp and moe=ep."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config

from containers import to_plain
from runtime.app.make_checkpoint import write_checkpoint
from runtime.core.model_spec import MLPLayer, ModelSpec
from runtime.core.parallel import Sharding
from runtime.model.deepseek.checkpoint import TensorInfo, _Reader, load_checkpoint, v3_scales
from runtime.model.deepseek.sharding import Cut, local_shape, tensor_cut
from runtime.model.deepseek.weights import ModelWeights, random_weights
from runtime.model.quantized import dequantize_fp8, quantize_fp8

CPU = torch.device("cpu")
SMALL_MOE = ("model.mlp=deepseek", "model.intermediate_size=96", "model.moe_intermediate_size=40",
             "model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.n_shared_experts=1",
             "model.first_k_dense_replace=1", "model.num_layers=2", "model.scoring_func=sigmoid",
             "model.topk_method=noaux_tc", "model.q_lora_rank=64", "model.rope_interleave=true")


def spec_of(*overrides: str) -> ModelSpec:
    return ModelSpec.from_config(to_plain(compose_config("device=cpu", *SMALL_MOE, *overrides))["model"])


def assert_reassembles(full: ModelWeights, ranks: list[ModelWeights], spec: ModelSpec, moe: str) -> None:
    """Rank slices, concatenated as the sharding cut them, equal the whole tensors."""
    assert torch.equal(torch.cat([r.embed for r in ranks]), full.embed)
    assert torch.equal(torch.cat([r.lm_head for r in ranks]), full.lm_head)
    assert [r.vocab_start for r in ranks] == [0, spec.vocab_size // 2]
    for i, (mkind, lw) in enumerate(zip(spec.mlp_kinds, full.layers)):
        a = [r.layers[i].attn for r in ranks]
        assert torch.equal(torch.cat([x.q_b for x in a]), lw.attn.q_b)
        assert torch.equal(torch.cat([x.w_uk for x in a]), lw.attn.w_uk)
        assert torch.equal(torch.cat([x.w_uv for x in a]), lw.attn.w_uv)
        assert torch.equal(torch.cat([x.o for x in a], dim=1), lw.attn.o)
        for x in a:  # replicated
            assert torch.equal(x.q_a, lw.attn.q_a) and torch.equal(x.kv_a, lw.attn.kv_a)
        m = [r.layers[i].mlp for r in ranks]
        if mkind == MLPLayer.dense:
            _check_dense(m, lw.mlp)
        else:
            assert torch.equal(m[0].gate, lw.mlp.gate) and torch.equal(m[1].gate, lw.mlp.gate)
            _check_dense([x.shared for x in m], lw.mlp.shared)
            if moe == "ep":
                assert torch.equal(torch.cat([x.gate_up for x in m]), lw.mlp.gate_up)
                assert torch.equal(torch.cat([x.down for x in m]), lw.mlp.down)
                assert [x.first_expert for x in m] == [0, spec.n_routed_experts // 2]
            else:
                im = spec.moe_intermediate_size // 2
                gate = torch.cat([x.gate_up[:, :im] for x in m], dim=1)
                up = torch.cat([x.gate_up[:, im:] for x in m], dim=1)
                assert torch.equal(torch.cat([gate, up], dim=1), lw.mlp.gate_up)
                assert torch.equal(torch.cat([x.down for x in m], dim=2), lw.mlp.down)


def _check_dense(parts, full) -> None:
    i = full.down.shape[1] // 2
    gate = torch.cat([p.gate_up[:i] for p in parts])
    up = torch.cat([p.gate_up[i:] for p in parts])
    assert torch.equal(torch.cat([gate, up]), full.gate_up)
    assert torch.equal(torch.cat([p.down for p in parts], dim=1), full.down)


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_seeded_weights_of_two_ranks_are_the_one_rank_weights(moe):
    spec = spec_of()
    full = random_weights(spec, CPU)
    ranks = [random_weights(spec, CPU, Sharding(r, 2, moe)) for r in range(2)]
    assert_reassembles(full, ranks, spec, moe)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_checkpoint_slices_are_the_full_loads_slices(fp8, moe, tmp_path):
    # float32 compute: bf16 round trips of the stored tensors are exact, fp8 dequantisation is elementwise
    spec = spec_of("model.dtype=float32")
    folder = tmp_path / "ckpt"
    write_checkpoint(spec, random_weights(spec, CPU), folder, fp8=fp8)
    spec = ModelSpec.from_config({**to_plain(compose_config(
        "model=hf", f"model.path={folder}", "model.dtype=float32", "model.weights=dequantize"))["model"]})
    full = load_checkpoint(spec, CPU)
    ranks = [load_checkpoint(spec, CPU, Sharding(r, 2, moe)) for r in range(2)]
    assert_reassembles(full, ranks, spec, moe)


def test_fp8_slice_reads_only_the_covering_blocks_and_equals_the_full_dequant(tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8(w)
    path = tmp_path / "w.safetensors"
    save_file({"w": q, "w_scale_inv": s}, str(path))
    index = {"w": TensorInfo(path, "F8_E4M3", (300, 260)), "w_scale_inv": TensorInfo(path, "F32", tuple(s.shape))}
    reader = _Reader(index, CPU, torch.float32, v3_scales(index))
    full = dequantize_fp8(q, s, torch.float32)
    for rows, cols in [(slice(37, 211), slice(5, 259)), (slice(128, 256), slice(None)), (slice(0, 1), slice(259, 260))]:
        got = reader.get("w", cut=Cut(((rows, cols),)))
        assert torch.equal(got, full[rows, cols]), (rows, cols)
    gate_up = reader.get("w", cut=Cut(((slice(0, 10),), (slice(150, 160),)), dim=0))  # two pieces, concatenated
    assert torch.equal(gate_up, torch.cat([full[0:10], full[150:160]]))
    reader.close()


def test_cuts_name_the_megatron_split():
    spec = spec_of()
    r1 = Sharding(1, 2, "tp")
    h, qk = spec.num_heads, spec.qk_head_dim
    assert tensor_cut("model.layers.0.self_attn.q_b_proj.weight", (h * qk, 64), spec, r1).pieces == \
        ((slice(h // 2 * qk, h * qk),),)
    o = tensor_cut("model.layers.0.self_attn.o_proj.weight", (spec.hidden_size, h * 128), spec, r1)
    assert local_shape((spec.hidden_size, h * 128), o) == (spec.hidden_size, h * 64)
    assert tensor_cut("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 256), spec, r1).replicated
    assert tensor_cut("model.layers.1.mlp.gate.weight", (4, 256), spec, r1).replicated
    ep = Sharding(1, 2, "ep")
    assert tensor_cut("model.layers.1.mlp.experts.1.up_proj.weight", (40, 256), spec, ep) is None
    assert tensor_cut("model.layers.1.mlp.experts.2.up_proj.weight", (40, 256), spec, ep).replicated
    assert tensor_cut("model.layers.1.mlp.shared_experts.down_proj.weight", (256, 40), spec, ep).pieces == \
        ((slice(None), slice(20, 40)),)
    fused = tensor_cut("model.layers.1.mlp.experts.gate_up_proj", (4, 80, 256), spec, r1)
    assert local_shape((4, 80, 256), fused) == (4, 40, 256)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_routed_experts_of_two_ranks_sum_to_one_ranks(moe, grouped):
    """Each rank's partial MoE output (its experts, or its slice of every expert), summed as the all-reduce does,
    is the whole layer's; also through torch._grouped_mm (the CUDA bf16 path; the CPU has it too), whose rows of
    other ranks' experts lie past the last group offset and must not leak in."""
    from runtime.model.deepseek.moe import route, routed_experts

    spec = spec_of("model.dtype=bfloat16", "model.moe_intermediate_size=64")
    full = random_weights(spec, CPU).layers[1].mlp
    ranks = [random_weights(spec, CPU, Sharding(r, 2, moe)).layers[1].mlp for r in range(2)]
    x = torch.randn(13, spec.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights, ids = route(spec, full, x)
    want = routed_experts(full, x, weights, ids, grouped)
    got = sum(routed_experts(w, x, weights, ids, grouped) for w in ranks)
    # ep: every (token, expert) pair is computed whole by one rank, only the float32 sum is reassociated;
    # tp: each rank's down projection sums half the intermediate dim in bf16
    tol = 1e-5 if moe == "ep" else 2e-2
    assert torch.isfinite(got).all() and (got - want).abs().max() <= tol * want.abs().max()
