"""``model.weights``: block-fp8 weights kept as stored (issue 46), on the CPU's torch path.

The stored model must serve the tokens of the same checkpoint dequantized at load (on the torch path the product
is dequantize-then-matmul, so the hidden states are bit-identical); tensor parallelism cuts the fp8 values with
their scales; a cut or fusion through a 128-block, a value that does not fit the model's source, and a GPU
without fp8 are refused at startup with the fix.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import compose_config
from test_tp_sharding import assert_reassembles

from containers import build, to_plain
from runtime.app.make_checkpoint import main as make_checkpoint
from runtime.app.make_checkpoint import write_checkpoint
from runtime.app.memory_estimate import weight_bytes
from runtime.app.weights_checks import weights_problems
from runtime.core.device import DeviceInfo
from runtime.core.errors import CheckpointError, ConfigError
from runtime.core.model_spec import ModelSpec
from runtime.core.parallel import Sharding
from runtime.model.deepseek.checkpoint import load_checkpoint
from runtime.model.deepseek.weights import ModelWeights, random_weights
from runtime.model.quantized import BlockFP8, BlockLayoutError, cat_rows, linear

CPU = torch.device("cpu")
# a tiny DeepSeek-V3 whose fp8 tensors cut and fuse on whole 128-blocks at tp 1 and 2 (q LoRA 128 rows fused
# with kv_a; gate / up intermediates 256 and 256, 128 per rank)
ALIGNED = ("model=deepseek_v3", "model.num_layers=2", "model.first_k_dense_replace=1", "model.hidden_size=64",
           "model.num_heads=4", "model.q_lora_rank=128", "model.intermediate_size=256",
           "model.moe_intermediate_size=256", "model.n_routed_experts=8", "model.n_group=4", "model.topk_group=2",
           "model.num_experts_per_tok=2", "model.vocab_size=128", "model.max_context=256", "model.dtype=float32",
           "device=cpu")
FEED = ("workload=smoke", "workload.num_requests=4", "check=off")


def spec_of(*overrides: str) -> ModelSpec:
    return ModelSpec.from_config(to_plain(compose_config(*ALIGNED, *overrides))["model"])


def dequantized(w, dtype=torch.float32):
    """A weights dataclass (nested ones, lists included) with every BlockFP8 dequantized."""
    if isinstance(w, BlockFP8):
        return w.dequantize(dtype)
    if isinstance(w, list):
        return [dequantized(x, dtype) for x in w]
    if dataclasses.is_dataclass(w):
        return dataclasses.replace(w, **{f.name: dequantized(getattr(w, f.name), dtype)
                                         for f in dataclasses.fields(w) if f.init})
    return w


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    """A checkpoint written from the fp8 preset: the blocks as generated, with ``_scale_inv`` scales."""
    out = tmp_path_factory.mktemp("fp8")
    assert make_checkpoint([*ALIGNED, "model.weights=fp8", f"out={out}"]) == 0
    return out


# ------------------------------------------------------------------------------------------------ the type
def test_block_fp8_indexing_keeps_whole_blocks_and_refuses_the_rest():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g)
    b = BlockFP8.quantize(w)
    assert b.scale.shape == (3, 3) and b.dtype == torch.float8_e4m3fn
    assert torch.equal(b[128:256].dequantize(torch.float32), b.dequantize(torch.float32)[128:256])
    assert torch.equal(b[:, 256:].dequantize(torch.float32), b.dequantize(torch.float32)[:, 256:])
    assert torch.equal(cat_rows([b[:128], b[128:]]).weight.float(), b.weight.float())
    with pytest.raises(BlockLayoutError, match="multiple of the fp8 scale block"):
        b[100:200]
    with pytest.raises(BlockLayoutError, match="model.weights=dequantize"):
        cat_rows([b[256:], b[:128]])  # a 44-row part that is not the last
    stack = BlockFP8.empty((2, 300, 260), CPU)
    stack[1] = b
    assert torch.equal(stack[1].dequantize(torch.float32), b.dequantize(torch.float32))


def test_linear_of_a_stored_weight_is_the_dequantized_product():
    w = BlockFP8.quantize(torch.randn(200, 320) / 16)
    x = torch.randn(7, 320, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w.dequantize(torch.bfloat16)))


# ------------------------------------------------------------------------------- presets and checkpoints
def test_fp8_preset_holds_the_release_layout_and_counts_bytes_as_stored():
    spec = spec_of("model.weights=fp8")
    w = random_weights(spec, CPU)
    a, dense, moe = w.layers[0].attn, w.layers[0].mlp, w.layers[1].mlp
    for t in (a.qkv_a, a.q_b, a.o, dense.gate_up, dense.down, moe.gate_up, moe.down, moe.shared.gate_up):
        assert isinstance(t, BlockFP8)
    for t in (w.embed, w.lm_head, a.w_uk, a.w_uv, moe.gate, a.attn_norm):  # 16 / 32 bits as the release
        assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    by = w.bytes_by_dtype()
    fp8_bytes = sum(x.weight.numel() for _, x in w.named() if isinstance(x, BlockFP8))
    assert by["float8_e4m3fn"] == fp8_bytes and by["float32 scales"] > 0
    assert w.nbytes == sum(by.values())
    assert set(w.unquantized_bytes()) >= {"embed", "lm_head", "attn.w_uk", "attn.w_uv", "mlp.gate"}
    # the same seed in bf16 is the same model up to fp8 rounding
    ref = random_weights(spec_of("model.weights=bf16"), CPU)
    rel = (dense.down.dequantize(torch.float32) - ref.layers[0].mlp.down).norm() / ref.layers[0].mlp.down.norm()
    assert 0 < rel < 0.05


def test_stored_checkpoint_holds_the_preset_blocks(fp8_folder):
    preset = random_weights(spec_of("model.weights=fp8"), CPU)
    spec = ModelSpec.from_config(to_plain(compose_config("model=hf", f"model.path={fp8_folder}",
                                                         "model.dtype=float32", "device=cpu"))["model"])
    assert spec.weights == "stored"  # auto: a checkpoint as stored
    loaded = load_checkpoint(spec, CPU)
    for got, want in ((loaded.layers[1].mlp.down, preset.layers[1].mlp.down),
                      (loaded.layers[0].attn.qkv_a, preset.layers[0].attn.qkv_a)):
        assert isinstance(got, BlockFP8)
        assert torch.equal(got.weight.float(), want.weight.float()) and torch.equal(got.scale, want.scale)
    assert torch.equal(loaded.layers[0].attn.w_uk, preset.layers[0].attn.w_uk)  # kv_b: fp8, then float


def test_the_router_is_held_as_the_release_stores_it(tmp_path):
    """The V3 release stores the router in bf16: a bf16 model holds it so (its float32 logits are exact from those
    bits), a float32 model in float32 with the same values; the presets generate bf16 values in every dtype, and
    the memory estimate counts the router in the dtype held."""
    from runtime.model.deepseek.stored import router_dtype

    assert router_dtype("BF16", torch.bfloat16) == torch.bfloat16
    assert router_dtype("F16", torch.float16) == torch.float16
    assert router_dtype("BF16", torch.float32) == torch.float32 and router_dtype("F32", torch.bfloat16) == torch.float32
    assert router_dtype("BF16", torch.float16) == torch.float32  # another 16-bit dtype: float32, values exact
    bf16 = random_weights(spec_of("model.dtype=bfloat16"), CPU)
    f32 = random_weights(spec_of(), CPU)
    assert bf16.layers[1].mlp.gate.dtype == torch.bfloat16 and f32.layers[1].mlp.gate.dtype == torch.float32
    assert torch.equal(bf16.layers[1].mlp.gate.float(), f32.layers[1].mlp.gate)  # the same (bf16) values
    assert make_checkpoint([*ALIGNED, "model.dtype=bfloat16", f"out={tmp_path}"]) == 0
    for dtype, want in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        cfg = to_plain(compose_config("model=hf", f"model.path={tmp_path}", f"model.dtype={dtype}", "device=cpu"))
        loaded = load_checkpoint(ModelSpec.from_config(cfg["model"]), CPU)
        assert loaded.layers[1].mlp.gate.dtype == want
        assert torch.equal(loaded.layers[1].mlp.gate.float(), f32.layers[1].mlp.gate)
        assert weight_bytes(cfg["model"], 1, "tp") == loaded.bytes_by_dtype()


def test_stored_serves_the_dequantized_tokens(fp8_folder):
    """Same checkpoint, same compute dtype: stored (fp8 on the device) and dequantize (float at load) give the
    same tokens, and the stored one holds fewer bytes."""
    runs = {}
    for mode in ("stored", "dequantize"):
        rt = build(compose_config("model=hf", f"model.path={fp8_folder}", "model.dtype=float32", "device=cpu",
                                  f"model.weights={mode}", *FEED))
        runs[mode] = (rt.engine.run().outputs, rt.container.model().weights.nbytes)
    assert runs["stored"][0] == runs["dequantize"][0]
    assert runs["stored"][1] < 0.75 * runs["dequantize"][1]  # w_uk / w_uv stay float32 in both


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_tensor_parallel_cuts_fp8_values_with_their_scales(fp8_folder, moe):
    spec = ModelSpec.from_config(to_plain(compose_config("model=hf", f"model.path={fp8_folder}",
                                                         "model.dtype=float32", "device=cpu"))["model"])
    full = load_checkpoint(spec, CPU)
    ranks = [load_checkpoint(spec, CPU, Sharding(r, 2, moe)) for r in range(2)]
    assert isinstance(ranks[0].layers[0].attn.o, BlockFP8)
    assert_reassembles(dequantized(full), [dequantized(r) for r in ranks], spec, moe)
    preset = [random_weights(spec_of("model.weights=fp8"), CPU, Sharding(r, 2, moe)) for r in range(2)]
    assert torch.equal(preset[1].layers[1].mlp.down.weight.float(), ranks[1].layers[1].mlp.down.weight.float())


# ------------------------------------------------------------------------------------------- bad input
def _problems(*overrides: str, device: DeviceInfo | None = None) -> list:
    plain = to_plain(compose_config(*overrides))
    return weights_problems(plain, device or DeviceInfo("cpu", "cpu", 0, False, None, "cpu"))


def test_a_cut_through_a_block_is_refused_with_the_valid_tp_values():
    probs = _problems(*ALIGNED, "model.weights=fp8", "parallel.tp=4")  # 256 / 4 = 64-row slices
    assert probs and all("parallel.tp in [1, 2]" in p.fix for p in probs)
    assert any("up_proj" in p.what for p in probs)
    assert not _problems(*ALIGNED, "model.weights=fp8", "parallel.tp=2")


def test_a_checkpoint_cut_through_a_block_is_refused_before_reading(fp8_folder):
    spec = ModelSpec.from_config(to_plain(compose_config("model=hf", f"model.path={fp8_folder}",
                                                         "model.dtype=float32", "device=cpu"))["model"])
    with pytest.raises(CheckpointError, match="whole 128 x 128 fp8 scale blocks"):
        load_checkpoint(spec, CPU, Sharding(0, 4, "tp"))


def test_values_that_do_not_fit_the_source_are_refused(fp8_folder):
    (p,) = _problems(*ALIGNED, "model.weights=stored")
    assert "preset" in p.got and "model.weights=fp8" in p.fix
    (p,) = _problems("model=hf", f"model.path={fp8_folder}", "device=cpu", "model.weights=fp8")
    assert "checkpoint" in p.got and "model.weights=stored" in p.fix
    with pytest.raises(ConfigError, match="model.weights=stored"):
        build(compose_config("model=hf", f"model.path={fp8_folder}", "device=cpu", "model.weights=bf16", *FEED))


def test_fp8_on_a_gpu_without_fp8_is_refused_with_dequantize_as_the_fix(fp8_folder):
    a100 = DeviceInfo("cuda", "cuda", 0, True, (8, 0), "NVIDIA A100")
    (p,) = _problems("model=hf", f"model.path={fp8_folder}", "model.weights=stored", device=a100)
    assert "8.0" in p.got and p.fix == "model.weights=dequantize"
    assert not _problems("model=hf", f"model.path={fp8_folder}", "model.weights=dequantize", device=a100)
    h100 = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "NVIDIA H100")
    assert not _problems("model=hf", f"model.path={fp8_folder}", device=h100)


def test_write_checkpoint_of_stored_weights_round_trips(tmp_path):
    spec = spec_of("model.weights=fp8")
    w = random_weights(spec, CPU)
    write_checkpoint(spec, w, tmp_path / "c")
    back = load_checkpoint(ModelSpec.from_config(to_plain(compose_config(
        "model=hf", f"model.path={tmp_path / 'c'}", "model.dtype=float32", "device=cpu"))["model"]), CPU)
    assert isinstance(back, ModelWeights)
    assert torch.equal(back.layers[0].attn.q_b.weight.float(), w.layers[0].attn.q_b.weight.float())
