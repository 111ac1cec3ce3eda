"""Real DeepSeek checkpoints on the GPU (marked gpu; skipped without CUDA).

1. The tiny transformers-built models of tests/hf_models.py (DeepSeek head dims 128/64/128 here, the shapes
   FlashInfer's MLA and ragged-prefill kernels are built for) served as one batch of 8 prompts on flashinfer_mla,
   triton_mla and dsa (triton): in bfloat16 the greedy tokens equal transformers' float32 greedy tokens except
   where the reference's top-2 logit gap is below bf16 resolution (counted and printed); triton backends in
   float32 match exactly, logits within 1e-4.
2. A random DeepSeek-V3-shaped checkpoint (4 layers: 3 dense + 1 MoE, real widths, 32 experts) written by
   ``python -m runtime.app.make_checkpoint`` on the GPU, loaded and served; its tokens equal the preset's
   (same seeded weights), and the report's load time and peak host memory are filled.

Run: ``python3 -m pytest -q -p no:cacheprovider tests/test_hf_parity_gpu.py -s``
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from hf_models import CASES, V32_CASE, Case, make_case, prompt_overrides

from containers import build

ROOT = Path(__file__).resolve().parents[1]
GPU_CASES = [replace(c, config={**c.config, "qk_nope_head_dim": 128, "v_head_dim": 128}) for c in CASES]
GPU_V32 = replace(V32_CASE, config={**V32_CASE.config, "qk_nope_head_dim": 128, "v_head_dim": 128})
NEAR_TIE = 0.02  # a flip is a near-tie when the reference's top-2 gap is below this fraction of its max |logit|


def _needs(pkg: str):
    return pytest.mark.skipif(importlib.util.find_spec(pkg) is None, reason=f"{pkg} not installed")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    pytest.importorskip("transformers")
    cache = {}

    def get(case: Case):
        import transformers

        if case.kind == "deepseek_v32" and not hasattr(transformers, "DeepseekV32ForCausalLM"):
            pytest.skip("this transformers has no DeepseekV32ForCausalLM")
        if case.name not in cache:
            cache[case.name] = make_case(case, tmp_path_factory.mktemp(case.name))
        return cache[case.name]

    return get


def serve(ref, case: Case, backend: str, dtype: str, *extra: str):
    cfg = compose_config("model=hf", f"model.path={ref.folder}", f"model.dtype={dtype}", "device=cuda",
                         f"backend={backend}", "check=off", "progress=false", "model.max_context=1024", *prompt_overrides(ref.folder, ref.prompts, case.new_tokens), *extra)
    rt = build(cfg)
    res = rt.engine.run()
    first = torch.stack([res.hidden[i][0] for i in range(len(ref.prompts))]).to(rt.device.torch_device)
    return [res.outputs[i] for i in range(len(ref.prompts))], rt.container.model().logits(first).cpu()


def compare_bf16(ref, tokens) -> int:
    """Number of prompts whose tokens flip at a near-tie (asserts every flip is one)."""
    ties = 0
    scale = ref.last_logits.abs().max().item()
    for i, (ours, theirs) in enumerate(zip(tokens, ref.tokens)):
        pos = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if pos is None:
            continue
        gap = ref.gaps[i][pos]
        assert gap < NEAR_TIE * scale, f"prompt {i}: flip at {pos} with reference gap {gap:.3f} (not a near-tie)"
        ties += 1
    return ties


BACKENDS_BF16 = [pytest.param("flashinfer_mla", marks=_needs("flashinfer")), pytest.param("triton_mla")]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS_BF16)
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
def test_bf16_tokens_match_transformers_up_to_near_ties(case, backend, reference):
    ref = reference(case)
    tokens, logits = serve(ref, case, backend, "bfloat16")
    assert torch.isfinite(logits).all()
    ties = compare_bf16(ref, tokens)
    print(f"\n{case.name} on {backend} bf16: {ties}/{len(tokens)} prompts flipped at near-ties")
    assert ties <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[:2] + GPU_CASES[3:4], ids=[c.name for c in GPU_CASES[:2] + GPU_CASES[3:4]])
def test_triton_mla_float32_matches_transformers_exactly(case, reference):
    ref = reference(case)
    tokens, logits = serve(ref, case, "triton_mla", "float32")
    assert tokens == ref.tokens
    rel = ((logits - ref.last_logits).norm(dim=-1) / ref.last_logits.norm(dim=-1)).max().item()
    assert rel < 1e-4, rel


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dsa_triton_v32_matches_transformers(dtype, reference):
    ref = reference(GPU_V32)
    tokens, logits = serve(ref, GPU_V32, "dsa", dtype, "backend.impl=triton")
    if dtype == "float32":
        assert tokens == ref.tokens
        rel = ((logits - ref.last_logits).norm(dim=-1) / ref.last_logits.norm(dim=-1)).max().item()
        assert rel < 1e-4, rel
    else:
        print(f"\nv32 on dsa/triton bf16: {compare_bf16(ref, tokens)}/{len(tokens)} prompts flipped at near-ties")


V3_REAL = ["model=deepseek_v3", "model.num_layers=4", "model.n_routed_experts=32", "model.max_context=4096"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS_BF16)
def test_real_width_v3_checkpoint_from_make_checkpoint(backend, tmp_path):
    out = tmp_path / "dsv3"
    p = subprocess.run([sys.executable, "-m", "runtime.app.make_checkpoint", *V3_REAL, "device=cuda", f"out={out}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    print("\n" + p.stdout.strip())
    prompts = [[(7 * i + j) % 4000 + 2 for j in range(n)] for i, n in enumerate((1, 5, 17, 64, 130, 200, 257, 300))]
    common = ("device=cuda", f"backend={backend}", "check=off", "progress=false", "kv.page_size=64",
              "kv.num_pages=256")
    common += prompt_overrides(tmp_path, prompts, 8)
    loaded = build(compose_config("model=hf", f"model.path={out}", "model.max_context=4096", *common))
    res = loaded.engine.run()
    w = loaded.container.model().weights
    spec = loaded.container.model_spec()
    assert spec.model_type == "deepseek_v3" and spec.has_moe and spec.hidden_size == 7168
    assert w.load_seconds > 0 and w.peak_host_bytes > 0
    print(f"loaded {w.nbytes / 2**30:.2f} GiB in {w.load_seconds:.1f} s, peak host RSS {w.peak_host_bytes / 2**30:.2f} GiB")
    del loaded
    torch.cuda.empty_cache()
    preset = build(compose_config(*V3_REAL, *common)).engine.run()
    assert res.outputs == preset.outputs
