"""DeepSeek-V4's release checkpoint format written from a tiny random transformers ``DeepseekV4ForCausalLM`` (see
tests/test_dsv4_release.py for what it holds and why): :func:`write_release` and the quantizers it uses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from dsv4_harness import randomize_, tiny_hf_config
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

TF_DEQUANT = Fp8Dequantize(None)._dequantize_one
FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.indexer\.wq_b\.weight$|\.shared_experts\.w\d\.weight$")
FP4 = re.compile(r"\.experts\.\d+\.w\d\.weight$")
BF16 = re.compile(r"^(embed|head)\.weight$|\.compressor\.(wkv|wgate)\.weight$|\.weights_proj\.weight$")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
         "activation_scheme": "dynamic"}


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


def stored_scale(e: torch.Tensor, as_: str) -> torch.Tensor:
    return {"e8m0": e.exp2().to(torch.float8_e8m0fnu), "u8": (e + 127).to(torch.uint8), "f32": e.exp2()}[as_]


def write_release(folder: Path, seed: int = 0, **over) -> tuple[dict, DeepseekV4ForCausalLM]:
    """The release folder (see tests/test_dsv4_release.py) -> (stored quantized tensors by release name as (weight,
    scale), a transformers model holding transformers' dequantization of them). ``over``: more
    :func:`tiny_hf_config` fields."""
    model = DeepseekV4ForCausalLM(tiny_hf_config(**{"hidden_size": 64, "moe_intermediate_size": 32, "head_dim": 64,
                                                    "index_head_dim": 16, "max_position_embeddings": 64, **over})).eval()
    randomize_(model, seed)
    plain = folder / "transformers"
    model.save_pretrained(plain)  # transformers writes DeepSeek's names (model.-prefixed, embed_tokens, hc_head.)
    release, oracle, stored = {}, {}, {}
    for i, (name, t) in enumerate(sorted(load_file(plain / "model.safetensors").items())):
        rel = re.sub(r"^hc_head\.hc_", "hc_head_", name.removeprefix("model.")).replace("embed_tokens.", "embed.")
        module = rel.removesuffix(".weight")
        if FP8.search(rel):
            q, e = fp8_blocks(t)
            s = stored_scale(e, ("e8m0", "u8", "f32")[i % 3])
            release[rel], release[module + (".weight_scale_inv" if "wo_b" in rel else ".scale")] = q, s
        elif FP4.search(rel):
            q, e = fp4_rows(t)
            s = stored_scale(e, "e8m0")
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
