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
other dims it reads DeepSeek's ceil-div grid differently (those are checked against a loop below)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from dsv4_harness import greedy_reference, randomize_, tiny_hf_config
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
from transformers import DeepseekV4ForCausalLM  # noqa: E402
from transformers.integrations.finegrained_fp8 import Fp8Dequantize  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TF_DEQUANT = Fp8Dequantize(None)._dequantize_one
FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.indexer\.wq_b\.weight$|\.shared_experts\.w\d\.weight$")
FP4 = re.compile(r"\.experts\.\d+\.w\d\.weight$")
BF16 = re.compile(r"^(embed|head)\.weight$|\.compressor\.(wkv|wgate)\.weight$|\.weights_proj\.weight$")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
         "activation_scheme": "dynamic"}
PROMPTS, NEW = [[5, 17, 3, 60, 8], [41, 2, 2, 90, 33, 7, 12, 71, 19]], 6


def _pow2(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The ue8m0 scale exponent: the smallest power of two with amax / 2**e <= top."""
    return torch.ceil(torch.log2(amax.clamp_min(2.0**-60) / top))


def fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e4m3 [out, in], exponents [ceil(out/128), ceil(in/128)]) (partial edge blocks)."""
    out, inp = w.shape
    rb, cb = -(-out // 128), -(-inp // 128)
    pad = torch.zeros(rb * 128, cb * 128)
    pad[:out, :inp] = w
    e = _pow2(pad.view(rb, 128, cb, 128).abs().amax((1, 3)), 448.0)
    q = (pad.view(rb, 128, cb, 128) / e.exp2()[:, None, :, None]).view(rb * 128, cb * 128)[:out, :inp]
    return q.to(torch.float8_e4m3fn), e


def fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e2m1 packed int8 [out, in/2], low nibble first; exponents [out, in/32])."""
    out, inp = w.shape
    e = _pow2(w.view(out, inp // 32, 32).abs().amax(-1), 6.0)
    x = (w.view(out, inp // 32, 32) / e.exp2()[..., None]).reshape(out, inp)
    nib = (x[..., None] - E2M1).abs().argmin(-1)  # nearest e2m1 value
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8).view(torch.int8), e


def _scale(e: torch.Tensor, as_: str) -> torch.Tensor:
    return {"e8m0": e.exp2().to(torch.float8_e8m0fnu), "u8": (e + 127).to(torch.uint8), "f32": e.exp2()}[as_]


def write_release(folder: Path, seed: int = 0) -> tuple[dict, DeepseekV4ForCausalLM]:
    """The release folder (see the module docstring) -> (stored quantized tensors by release name as (weight,
    scale), a transformers model holding transformers' dequantization of them)."""
    model = DeepseekV4ForCausalLM(tiny_hf_config(hidden_size=64, moe_intermediate_size=32, head_dim=64, index_head_dim=16,
                                                 max_position_embeddings=64)).eval()
    randomize_(model, seed)
    plain = folder / "transformers"
    model.save_pretrained(plain)  # transformers writes DeepSeek's names (model.-prefixed, embed_tokens, hc_head.)
    release, oracle, stored = {}, {}, {}
    for i, (name, t) in enumerate(sorted(load_file(plain / "model.safetensors").items())):
        rel = re.sub(r"^hc_head\.hc_", "hc_head_", name.removeprefix("model.")).replace("embed_tokens.", "embed.")
        module = rel.removesuffix(".weight")
        if FP8.search(rel):
            q, e = fp8_blocks(t)
            s = _scale(e, ("e8m0", "u8", "f32")[i % 3])
            release[rel], release[module + (".weight_scale_inv" if "wo_b" in rel else ".scale")] = q, s
        elif FP4.search(rel):
            q, e = fp4_rows(t)
            s = _scale(e, "e8m0")
            release[rel], release[module + ".scale"] = (q.view(torch.float4_e2m1fn_x2) if ".experts.1.w2" in rel
                                                        else q), s
        else:
            t = t.int() if rel.endswith("tid2eid") else t.bfloat16() if BF16.search(rel) else t
            release[rel] = oracle[name] = t
            continue
        stored[rel] = (release[rel], s)
        oracle[name] = TF_DEQUANT(release[rel], s, output_dtype=torch.float32)
    release["mtp.0.ffn.experts.0.w1.weight"] = torch.zeros(3, 5, dtype=torch.int8)  # MTP: never read
    save_file(release, folder / "model.safetensors")
    cfg = json.loads((plain / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANT, "expert_dtype": "fp4"}))
    save_file(oracle, plain / "model.safetensors")
    ref = DeepseekV4ForCausalLM.from_pretrained(plain, attn_implementation="eager",
                                                experts_implementation="eager").eval()
    return stored, ref


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
    assert all(t.dtype == torch.float64 for t in w.tensors if t.is_floating_point())  # the loaded dtype
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
        assert torch.equal(dequantize_fp8(q, _scale(e, as_), torch.float32), loop), as_
    assert (dequantize_fp8(q, _scale(e, "u8"), torch.float32) - w).abs().max() < 0.07 * w.abs().max()
    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8).view(torch.int8)  # 1 -> 0.5, 2 -> 1.0, 8 -> -0, F -> -6
    assert unpack_fp4(packed).tolist() == [[0.5, 1.0, -0.0, -6.0]]
    x, e4 = fp4_rows(torch.randn(3, 64, generator=g))
    got = dequantize_fp4(x, _scale(e4, "u8"), torch.float32)
    assert torch.equal(got, TF_DEQUANT(x, _scale(e4, "e8m0"), torch.float32))
    assert torch.equal(got[:, 32:], unpack_fp4(x)[:, 32:] * e4[:, 1:].exp2())
