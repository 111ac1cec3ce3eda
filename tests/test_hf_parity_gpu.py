"""Real DeepSeek checkpoints on the GPU (marked gpu; skipped without CUDA).

1. The tiny transformers-built models of tests/hf_models.py (DeepSeek head dims 128/64/128 here, the shapes
   FlashInfer's MLA and ragged-prefill kernels are built for) served as one batch of 8 prompts on flashinfer_mla,
   triton_mla and dsa (triton): in bfloat16 (weights at ``BF16_INIT_STD``), teacher forced on our own tokens, our
   logit error is no worse than transformers' own bf16 run and every greedy flip against transformers' float32
   tokens is below bf16 resolution, except a bounded number in models with discrete routing (MoE, top-k
   indexer); flips are counted and printed (``hf_models.bf16_parity``). Triton backends in float32 match
   exactly, logits within 1e-4.
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
from hf_models import (
    BF16_INIT_STD,
    CASES,
    V32_CASE,
    Case,
    assert_bf16_parity,
    bf16_parity,
    make_case,
    prompt_overrides,
)

from containers import build
from runtime.app.parity import routing_flip_budget

ROOT = Path(__file__).resolve().parents[1]
GPU_CASES = [replace(c, config={**c.config, "qk_nope_head_dim": 128, "v_head_dim": 128}) for c in CASES]
GPU_V32 = replace(V32_CASE, config={**V32_CASE.config, "qk_nope_head_dim": 128, "v_head_dim": 128})
BF16_CASES = [replace(c, init_std=BF16_INIT_STD) for c in GPU_CASES]
BF16_V32 = replace(GPU_V32, init_std=BF16_INIT_STD)


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
        key = (case.name, case.init_std)
        if key not in cache:
            cache[key] = make_case(case, tmp_path_factory.mktemp(case.name))
        return cache[key]

    return get


def serve(ref, case: Case, backend: str, dtype: str, *extra: str):
    """Our tokens per prompt, float32 logits [prompts, vocab] at each prompt's last token, logits [new_tokens, vocab]
    at every generated position of each prompt, whether the model routes discretely (MoE or sparse layers), and the
    runtime that served them."""
    cfg = compose_config("model=hf", f"model.path={ref.folder}", f"model.dtype={dtype}", "device=cuda",
                         f"backend={backend}", "check=off", "progress=false", "model.max_context=1024", *prompt_overrides(ref.folder, ref.prompts, case.new_tokens), *extra)
    rt = build(cfg)
    res = rt.engine.run()
    model, spec = rt.container.model(), rt.container.model_spec()
    every = [model.logits(res.hidden[i].to(rt.device.torch_device)) for i in range(len(ref.prompts))]
    first = torch.stack([e[0] for e in every]).cpu()
    discrete = spec.has_moe or bool(spec.sparse_layers)
    return [res.outputs[i] for i in range(len(ref.prompts))], first, every, discrete, rt


def check_bf16(case: Case, ref, backend: str, *extra: str) -> None:
    tokens, first, every, discrete, _ = serve(ref, case, backend, "bfloat16", *extra)
    assert torch.isfinite(first).all()
    p = bf16_parity(case, ref, tokens, every, "cuda")
    print(f"\n{case.name} on {backend} bf16: {p.summary()}")
    assert_bf16_parity(p, routing_flip_budget(p.positions, "bfloat16", discrete))


BACKENDS_BF16 = [pytest.param("flashinfer_mla", marks=_needs("flashinfer")), pytest.param("triton_mla")]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS_BF16)
@pytest.mark.parametrize("case", BF16_CASES, ids=[c.name for c in BF16_CASES])
def test_bf16_tokens_match_transformers_up_to_bf16_resolution(case, backend, reference):
    check_bf16(case, reference(case), backend)


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES[:2] + GPU_CASES[3:4], ids=[c.name for c in GPU_CASES[:2] + GPU_CASES[3:4]])
def test_triton_mla_float32_matches_transformers_exactly(case, reference):
    ref = reference(case)
    tokens, logits, _, _, _ = serve(ref, case, "triton_mla", "float32")
    assert tokens == ref.tokens
    rel = ((logits - ref.last_logits).norm(dim=-1) / ref.last_logits.norm(dim=-1)).max().item()
    assert rel < 1e-4, rel


@pytest.mark.gpu
def test_dsa_triton_v32_matches_transformers_float32(reference):
    ref = reference(GPU_V32)
    tokens, logits, _, _, _ = serve(ref, GPU_V32, "dsa", "float32", "backend.impl=triton")
    assert tokens == ref.tokens
    rel = ((logits - ref.last_logits).norm(dim=-1) / ref.last_logits.norm(dim=-1)).max().item()
    assert rel < 1e-4, rel


@pytest.mark.gpu
def test_dsa_triton_v32_bf16_up_to_bf16_resolution(reference):
    check_bf16(BF16_V32, reference(BF16_V32), "dsa", "backend.impl=triton")


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


GRAPHED = ("graph=decode", "graph.batch_sizes=[1,2,4,8]", "graph.prefill_requests=16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_mla_graphed_prefill_and_decode_match_transformers(dtype, reference):
    """The 8 prompts (1..40 tokens) prefilled in one step replayed from the prefill graph of 256 tokens (116 rows of
    padding), then decode replayed from its graphs: float32 gives transformers' tokens and logits (the dense-only case:
    graphed float32 MoE is refused), bfloat16 its tokens up to bf16 resolution (the MoE, q LoRA, YaRN case)."""
    case = GPU_CASES[2] if dtype == "float32" else BF16_CASES[0]
    ref = reference(case)
    tokens, first, every, discrete, rt = serve(ref, case, "triton_mla", dtype, *GRAPHED)
    modes = rt.container.graph_runner().modes
    assert modes["prefill"].replays == 1 and sorted(modes["prefill"].graphs)[0] == 256 and modes["decode"].replays > 0
    if dtype == "float32":
        assert tokens == ref.tokens
        rel = ((first - ref.last_logits).norm(dim=-1) / ref.last_logits.norm(dim=-1)).max().item()
        assert rel < 1e-4, rel
    else:
        p = bf16_parity(case, ref, tokens, every, "cuda")
        assert_bf16_parity(p, routing_flip_budget(p.positions, "bfloat16", discrete))
