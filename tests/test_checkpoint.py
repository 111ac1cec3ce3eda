"""Checkpoint folders: bad input refused before serving (naming file and tensor, expected vs found), fp8 block
dequantisation, sharded loading, make_checkpoint round trips (our loader and transformers read the same folder)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import compose_config
from hf_models import prompt_overrides
from safetensors import safe_open
from safetensors.torch import save_file

import containers
from containers import build
from runtime.app.make_checkpoint import main as make_checkpoint
from runtime.app.make_checkpoint import write_checkpoint
from runtime.core.errors import ConfigError
from runtime.core.model_spec import ModelSpec
from runtime.model.deepseek.checkpoint import load_checkpoint
from runtime.model.deepseek.hf_config import resolve_model_config
from runtime.model.deepseek.weights import random_weights
from runtime.model.quantized import dequantize_fp8, quantize_fp8

pytestmark = pytest.mark.usefixtures("one_thread")

# deepseek_v3_tp8's decoder (dense layers, then MoE with grouped sigmoid routing, YaRN) at CPU size
SMALL = ("model=deepseek_v3_tp8", "model.hidden_size=64", "model.num_heads=3", "model.intermediate_size=96",
         "model.moe_intermediate_size=32", "model.n_routed_experts=16", "model.n_group=4", "model.topk_group=2",
         "model.num_experts_per_tok=4", "model.q_lora_rank=32", "model.vocab_size=128", "model.dtype=float32",
         "model.max_context=256", "device=cpu")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A random SMALL checkpoint written by make_checkpoint (its CLI), and the preset's spec."""
    out = tmp_path_factory.mktemp("small")
    assert make_checkpoint([*SMALL, f"out={out}"]) == 0
    return out


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _refusal(folder, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        build(compose_config("model=hf", f"model.path={folder}", "model.dtype=float32", "device=cpu", *overrides))
    return str(e.value)


def _rewrite(folder, fn) -> None:
    """Rewrite model.safetensors through ``fn(dict of tensors)``."""
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fn(tensors)
    save_file(tensors, str(path))


def test_make_checkpoint_serves_the_presets_weights(small, tmp_path):
    """Served from the folder, the model's tokens equal the preset's (same seeded weights)."""
    feed = prompt_overrides(tmp_path, [[5, 6, 7], list(range(2, 19))], 4)
    rt = build(compose_config(*SMALL, "check=off", *feed))
    preset = rt.engine.run().outputs
    rt2 = build(compose_config("model=hf", f"model.path={small}", "model.dtype=float32", "device=cpu",
                               "model.max_context=256", "check=off", *feed))
    loaded = rt2.engine.run().outputs
    assert loaded == preset
    spec = rt2.container.model_spec()
    assert spec.model_type == "deepseek_v3" and spec.has_moe and spec.rope_type == "yarn"
    w = rt2.container.model().weights
    assert w.source == str(small) and w.load_seconds > 0 and w.peak_host_bytes > 0


def test_make_checkpoint_is_read_by_transformers(small, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32).eval()
    prompt = list(range(3, 14))
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    rt = build(compose_config("model=hf", f"model.path={small}", "model.dtype=float32", "device=cpu",
                              "model.max_context=256", "check=off", *prompt_overrides(tmp_path, [prompt], 4)))
    assert rt.engine.run().outputs[0] == ref


def test_sharded_checkpoint_loads_shard_by_shard(small, tmp_path):
    spec = ModelSpec.from_config(resolve_model_config(containers.to_plain(compose_config(*SMALL))["model"])[0])
    weights = random_weights(spec, torch.device("cpu"))
    files = write_checkpoint(spec, weights, tmp_path / "sharded", shard_bytes=1 << 20)
    assert len(files) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    hf_spec = ModelSpec.from_config(resolve_model_config(
        {"name": "hf", "path": str(tmp_path / "sharded"), "dtype": "float32", "max_context": 256})[0])
    loaded = load_checkpoint(hf_spec, torch.device("cpu"))
    assert torch.equal(loaded.layers[3].mlp.gate_up, weights.layers[3].mlp.gate_up)
    assert torch.equal(loaded.layers[0].attn.w_uv, weights.layers[0].attn.w_uv)


def test_fp8_block_dequantisation_formula():
    """weight = fp8 * scale per 128 x 128 block, odd edges included."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g) * torch.linspace(0.1, 3, 200)
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    rows, cols = torch.arange(300) // 128, torch.arange(200) // 128
    manual = q.float() * s[rows[:, None], cols[None, :]]
    assert torch.equal(dequantize_fp8(q, s, torch.float32), manual)
    err = (dequantize_fp8(q, s, torch.float32) - w).abs()
    assert (err <= w.abs() * 0.0625 + s[rows[:, None], cols[None, :]] * 2**-9).all()  # e4m3: 3 mantissa bits


def test_fp8_checkpoint_serves_like_its_dequantised_weights(small, tmp_path):
    """An fp8 release (linear weights e4m3 + weight_scale_inv) is dequantised at load to the compute dtype."""
    out = tmp_path / "fp8"
    assert make_checkpoint([*SMALL, f"out={out}", "fp8=true"]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        q = f.get_tensor("model.layers.3.mlp.experts.5.down_proj.weight")
        s = f.get_tensor("model.layers.3.mlp.experts.5.down_proj.weight_scale_inv")
    assert q.dtype == torch.float8_e4m3fn
    spec = ModelSpec.from_config(resolve_model_config(
        {"name": "hf", "path": str(out), "dtype": "float32", "max_context": 256, "weights": "dequantize"})[0])
    w = load_checkpoint(spec, torch.device("cpu"))
    assert torch.equal(w.layers[3].mlp.down[5], dequantize_fp8(q, s, torch.float32))
    ref = load_checkpoint(ModelSpec.from_config(resolve_model_config(
        {"name": "hf", "path": str(small), "dtype": "float32", "max_context": 256})[0]), torch.device("cpu"))
    rel = (w.layers[3].mlp.down - ref.layers[3].mlp.down).norm() / ref.layers[3].mlp.down.norm()
    assert 0 < rel < 0.05  # fp8 rounding, nothing more


# ------------------------------------------------------------------------------------------- bad input
def test_missing_tensor_is_named(small, tmp_path):
    folder = _copy(small, tmp_path)
    _rewrite(folder, lambda t: t.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    text = _refusal(folder)
    assert "checkpoint refused" in text or "configuration refused" in text
    assert "model.layers.1.self_attn.kv_b_proj.weight: got missing" in text and "[387, 512]" not in text


def test_wrong_shape_names_file_tensor_expected_and_found(small, tmp_path):
    folder = _copy(small, tmp_path)
    _rewrite(folder, lambda t: t.update({"model.layers.2.mlp.down_proj.weight": torch.zeros(64, 95)}))
    text = _refusal(folder)
    assert "model.layers.2.mlp.down_proj.weight in model.safetensors: got shape [64, 95]" in text
    assert "expected shape [64, 96]" in text


def test_unsupported_dtype_is_refused(small, tmp_path):
    folder = _copy(small, tmp_path)
    _rewrite(folder, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    text = _refusal(folder)
    assert "model.norm.weight in model.safetensors: got dtype I32" in text and "BF16" in text


def test_truncated_shard_is_refused(small, tmp_path):
    folder = _copy(small, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    text = _refusal(folder)
    assert f"shard {path}: got {len(data) - 1000} bytes (truncated)" in text and f"{len(data)} bytes" in text


def test_missing_shard_is_refused(small, tmp_path):
    spec = ModelSpec.from_config(resolve_model_config(containers.to_plain(compose_config(*SMALL))["model"])[0])
    folder = tmp_path / "sharded"
    files = write_checkpoint(spec, random_weights(spec, torch.device("cpu")), folder, shard_bytes=1 << 20)
    files[1].unlink()
    text = _refusal(folder)
    assert f"shard {files[1]}: got missing" in text


def test_unsupported_model_type_names_the_supported_ones(small, tmp_path):
    folder = _copy(small, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    text = _refusal(folder)
    assert "model_type: got 'llama'" in text and "deepseek_v2" in text and "deepseek_v32" in text


def test_missing_folder_and_conflicting_dims(small, tmp_path):
    assert "config.json" in _refusal(tmp_path / "nowhere")
    text = _refusal(small, "model.hidden_size=128", "model.num_layers=9")
    assert "model.hidden_size: got 128; expected 64" in text and "model.num_layers: got 9; expected 1..4" in text


def test_cut_model_serves_its_first_layers(small):
    rt = build(compose_config("model=hf", f"model.path={small}", "model.dtype=float32", "device=cpu",
                              "model.num_layers=2", "model.max_context=256", "check=off"))
    assert len(rt.container.model().layers) == 2 and rt.container.model_spec().num_layers == 2
