"""DeepSeek-V4's release checkpoint format (as on the Hub for V4-Flash), written here by the test itself from a tiny
random transformers ``DeepseekV4ForCausalLM``: release names (``layers.N.attn.wq_a.weight``, ``embed.weight``,
``hc_head_fn``), fp8 e4m3 attention / indexer / shared-expert matrices with power-of-two (ue8m0) 128 x 128 block
scales named ``<module>.scale`` (one as ``weight_scale_inv``; stored as F8_E8M0, U8 bytes or F32), routed experts
fp4 e2m1 packed two per byte (I8; one expert as safetensors F4) with ue8m0 scales per 32 inputs, the compressors'
``wkv`` / ``wgate``, the indexer's ``weights_proj``, embed and head in bf16, an MTP layer that must be ignored, and
config.json's ``quantization_config`` + ``expert_dtype: fp4``.

The oracle: transformers' own ``Fp8Dequantize._dequantize_one`` (an independent implementation) dequantizes the
same stored tensors; a transformers model loaded with those values generates the reference tokens. The quantized
dims are <= 128 (one partial block) or multiples of 128: transformers derives the block from the scale grid, so for
other dims it reads DeepSeek's ceil-div grid differently (those are checked against a loop below). The writer:
tests/dsv4_release.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from dsv4_harness import greedy_reference
from hf_models import prompt_overrides
from safetensors.torch import load_file, save_file

from containers import build
from runtime.app.report import memory_plan
from runtime.core.errors import ConfigError
from runtime.model.deepseek.hf_config import read_hf_config, resolve_model_config
from runtime.model.dsv4.checkpoint import load_dsv4_checkpoint
from runtime.model.dsv4.hf_config import dsv4_config
from runtime.model.dsv4.stored import StoredFormat
from runtime.model.dsv4.weights import ModelWeights
from runtime.model.quantized import dequantize_fp4, dequantize_fp8, unpack_fp4

pytest.importorskip("transformers")
from dsv4_release import FP4, FP8, QUANT, TF_DEQUANT, fp4_rows, fp8_blocks, stored_scale, write_release  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS, NEW = [[5, 17, 3, 60, 8], [41, 2, 2, 90, 33, 7, 12, 71, 19]], 6


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4_release")
    stored, ref = write_release(folder)
    return folder, stored, ref


def _model_config(folder: Path) -> dict:
    model, problems = resolve_model_config({"name": "hf", "path": str(folder), "dtype": "float32"})
    assert not problems, problems
    return model


def test_config_reads_the_quantization_config(release):
    folder, _, _ = release
    model = _model_config(folder)
    assert model["v4"]["fp8_block"] == [128, 128] and model["v4"]["expert_dtype"] == "fp4"
    assert StoredFormat.of(model) == StoredFormat((128, 128), "fp4")


def test_dequantized_weights_equal_transformers_fp8dequantize(release):
    """Every tensor we load (fp8, fp4, bf16, float32, int) equals the transformers model's, whose quantized ones
    are transformers' Fp8Dequantize of the stored tensors; the per-expert layout is stacked as transformers fuses."""
    folder, stored, ref = release
    model = _model_config(folder)
    cfg = dsv4_config(model)
    ours = load_dsv4_checkpoint(cfg, folder, StoredFormat.of(model), torch.float32, torch.device("cpu"))
    want = ModelWeights.load(dict(ref.state_dict()), cfg=cfg)
    assert len(ours.tensors) == len(want.tensors)
    for got, exp in zip(ours.tensors, want.tensors):
        assert got.dtype == exp.dtype and torch.equal(got, exp)
    assert ours.stored_dtypes["F8_E4M3"] == sum(1 for n in stored if FP8.search(n))
    assert ours.stored_dtypes["I8"] + ours.stored_dtypes["F4"] == sum(1 for n in stored if FP4.search(n))
    assert ours.stored_dtypes["BF16"] > 0 and ours.stored_dtypes["I32"] == 2  # the two hash layers' tid2eid
    q, s = stored["layers.1.attn.wq_b.weight"]  # 256 x 24: two block rows
    assert s.shape == (2, 1) and torch.equal(ours.layers[1].attn.q_b_proj, TF_DEQUANT(q, s, torch.float32))
    bf16 = load_dsv4_checkpoint(cfg, folder, StoredFormat.of(model), torch.bfloat16, torch.device("cpu"))
    assert torch.equal(bf16.layers[1].attn.q_b_proj, TF_DEQUANT(q, s, torch.bfloat16))  # exact in bf16 too


@pytest.mark.usefixtures("no_indexer_ties")
def test_greedy_tokens_from_the_release_folder_match_generate(release):
    folder, _, ref = release
    ref = ref.double()
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    want = greedy_reference(ref, PROMPTS, NEW, 1e-6)
    rt = build(compose_config("model=hf", f"model.path={folder}", "backend=dsv4", "model.dtype=float64",
                              "backend.compute_dtype=float64", "device=cpu", "check=off", "progress=false",
                              *prompt_overrides(folder, PROMPTS, NEW)))
    res = rt.engine.run()
    assert [res.outputs[i] for i in range(len(PROMPTS))] == want
    w = rt.container.model().weights
    assert {"F8_E4M3", "I8", "F4", "BF16"} <= set(w.stored_dtypes)
    # model.weights=auto: stored (fp8 / fp4 as shipped, tests/test_dsv4_stored.py); float tensors in the loaded dtype
    assert all(v.dtype == torch.float64 for _, v in w.named() if isinstance(v, torch.Tensor) and v.is_floating_point())
    assert memory_plan(rt.container)["weights_bytes"] == w.nbytes == sum(
        t.numel() * t.element_size() for t in w.tensors)


def _corrupt(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    state = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    edit(state, cfg)
    save_file(state, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _refused(folder: Path) -> str:
    with pytest.raises(ConfigError) as e:
        build(compose_config("model=hf", f"model.path={folder}", "backend=dsv4", "device=cpu"))
    return str(e.value)


def test_broken_tensors_are_all_listed_with_a_fix(release, tmp_path):
    def edit(state, cfg):
        del state["layers.0.attn.wq_a.scale"]  # an fp8 tensor without its scale
        state["layers.2.attn.wo_a.scale"] = state["layers.2.attn.wo_a.scale"][:, :0]  # wrong scale shape
        state["layers.1.ffn.experts.3.w2.weight"] = state["layers.1.ffn.experts.3.w2.weight"][:, :-2].clone()  # cut
        state["layers.3.ffn.shared_experts.w1.weight"] = state["layers.3.ffn.shared_experts.w1.weight"].view(
            torch.int8)  # an int8 shared expert: only routed experts may be fp4

    msg = _refused(_corrupt(release[0], tmp_path / "broken", edit))
    assert "4 problems" in msg, msg
    assert ("tensor layers.0.attn.wq_a.weight (transformers: model.layers.0.self_attn.q_a_proj.weight) in "
            "model.safetensors: got fp8 without its scale (no layers.0.attn.wq_a.scale or "
            "layers.0.attn.wq_a.weight_scale_inv); expected layers.0.attn.wq_a.scale of shape [1, 1]") in msg
    assert "re-download the shard that holds the scale" in msg
    assert ("layers.2.attn.wo_a.weight (transformers: model.layers.2.self_attn.o_a_proj.weight) in model.safetensors: "
            "its scale layers.2.attn.wo_a.scale: got shape [1, 0]; expected shape [1, 1] (fp8 scales, one per "
            "128 x 128 block, for the weight's [16, 128])") in msg
    assert ("tensor layers.1.ffn.experts.3.w2.weight (transformers: model.layers.1.mlp.experts.3.down_proj.weight) "
            "in model.safetensors: got shape [64, 14]; expected shape [64, 16] (fp4 e2m1 of the config's [64, 32], "
            "two per byte)") in msg
    assert ("layers.3.ffn.shared_experts.w1.weight (transformers: model.layers.3.mlp.shared_experts.gate_proj."
            "weight) in model.safetensors: got dtype I8; expected one of ['F64', 'F32', 'BF16', 'F16', "
            "'F8_E4M3']") in msg


def test_unknown_formats_are_config_problems(release, tmp_path):
    def edit(state, cfg):
        cfg["quantization_config"] = {**QUANT, "fmt": "e5m2", "quant_method": "awq", "expert_dtype": "fp6"}
        cfg.pop("expert_dtype")

    folder = _corrupt(release[0], tmp_path / "fmt", edit)
    msg = _refused(folder)
    assert "3 problems" in msg, msg
    assert "config.json: quantization_config.quant_method: got 'awq'; expected one of ['fp8']" in msg
    assert "quantization_config.fmt: got 'e5m2'; expected one of ['e4m3']" in msg
    assert "config.json: expert_dtype: got 'fp6'; expected one of ['fp8', 'fp4']" in msg
    _, problems = read_hf_config(_corrupt(release[0], tmp_path / "both", lambda s, c: c.update(
        quantization_config={**QUANT, "expert_dtype": "fp8"})))  # top level says fp4
    assert [p.what.split(": ")[-1] for p in problems] == ["expert_dtype"]


def test_fp8_without_a_quantization_config_is_refused(release, tmp_path):
    msg = _refused(_corrupt(release[0], tmp_path / "noq", lambda s, c: c.pop("quantization_config")))
    assert "tensor layers.0.attn.wq_a.weight" in msg and "got dtype F8_E4M3" in msg
    assert "(config.json has no quantization_config)" in msg and "declare the release's quantization_config" in msg


def test_block_grids_that_do_not_divide_and_fp4_nibbles_against_loops():
    """DeepSeek's grid is ceil(dim / 128) with a partial last block (300 x 200 -> 3 x 2); uint8 exponent bytes,
    ue8m0 and float32 scales give the same weights; e2m1 nibbles decode low first."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    q, e = fp8_blocks(w)
    loop = torch.empty(300, 200)
    for r in range(300):
        for c in range(0, 200, 50):
            loop[r, c:c + 50] = q[r, c:c + 50].float() * 2.0 ** float(e[r // 128, c // 128])
    for as_ in ("e8m0", "u8", "f32"):
        assert torch.equal(dequantize_fp8(q, stored_scale(e, as_), torch.float32), loop), as_
    assert (dequantize_fp8(q, stored_scale(e, "u8"), torch.float32) - w).abs().max() < 0.07 * w.abs().max()
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8).view(torch.int8)  # 1 -> 0.5, 2 -> 1.0, 8 -> -0, F -> -6
    assert unpack_fp4(packed).tolist() == [[0.5, 1.0, -0.0, -6.0]]
    x, e4 = fp4_rows(torch.randn(3, 64, generator=g))
    got = dequantize_fp4(x, stored_scale(e4, "u8"), torch.float32)
    assert torch.equal(got, TF_DEQUANT(x, stored_scale(e4, "e8m0"), torch.float32))
    assert torch.equal(got[:, 32:], unpack_fp4(x)[:, 32:] * e4[:, 1:].exp2())
