"""Real DeepSeek checkpoints: tiny random models built and saved by transformers (the oracle), loaded here through
the normal config path (``model=hf model.path=DIR``) and served as one batch of 8 prompts (1..40 tokens).

Greedy tokens must equal transformers' ``generate(do_sample=False)`` and float32 last-prompt-token logits must
match within 1e-4 (relative), on the CPU backends (torch_mla; dsa with its torch impl). The Triton backends
(triton_mla, dsa impl=triton) and flashinfer_mla run the same cases on the GPU (tests/test_hf_parity_gpu.py):
whole-engine runs in the Triton CPU interpreter take minutes. Each model's weights are scaled so that no
generated position is a near-tie (the test checks the reference's top-2 gap).

bfloat16 on the CPU (torch_mla): the comparison the GPU tests make in bf16 (``hf_models.bf16_parity``), and
that it fails on a 10% softmax-scale error.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import compose_config
from hf_models import (
    BF16_ERROR_RATIO,
    BF16_INIT_STD,
    CASES,
    V32_CASE,
    Case,
    Reference,
    assert_bf16_parity,
    bf16_parity,
    make_case,
    prompt_overrides,
)

from containers import build
from runtime.app.parity import routing_flip_budget
from runtime.core.model_spec import ModelSpec

pytestmark = pytest.mark.usefixtures("one_thread")

pytest.importorskip("transformers")
MIN_GAP = 1e-3  # top-1 minus top-2 logit of the reference at every generated position
LOGIT_RTOL = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache: dict[str, Reference] = {}

    def get(case: Case) -> Reference:
        key = (case.name, case.init_std)
        if key not in cache:
            cache[key] = make_case(case, tmp_path_factory.mktemp(case.name))
        return cache[key]

    return get


def serve(ref: Reference, new_tokens: int, *overrides: str, dtype: str = "float32"):
    """Our greedy tokens and last-prompt-token logits [P, vocab] float32 for the reference's prompts."""
    cfg = compose_config("model=hf", f"model.path={ref.folder}", f"model.dtype={dtype}", "device=cpu", "check=off",
                         "progress=false", *prompt_overrides(ref.folder, ref.prompts, new_tokens), *overrides)
    rt = build(cfg)
    res = rt.engine.run()
    first = torch.stack([res.hidden[i][0] for i in range(len(ref.prompts))])
    return [res.outputs[i] for i in range(len(ref.prompts))], rt.container.model().logits(first), rt


def check(ref: Reference, tokens, logits) -> None:
    assert ref.min_gap > MIN_GAP, f"reference near-tie (gap {ref.min_gap:.2e}): reseed the case"
    assert torch.isfinite(logits).all()
    for i, (ours, theirs) in enumerate(zip(tokens, ref.tokens)):
        assert ours == theirs, f"prompt {i} (len {len(ref.prompts[i])}): ours {ours} vs transformers {theirs}"
    rel = (torch.linalg.vector_norm(logits - ref.last_logits, dim=-1)
           / torch.linalg.vector_norm(ref.last_logits, dim=-1)).max().item()
    assert rel < LOGIT_RTOL, f"last-token logits rel err {rel:.2e}"


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_torch_mla_matches_transformers(case, reference):
    ref = reference(case)
    tokens, logits, _ = serve(ref, case.new_tokens, "backend=torch_mla")
    check(ref, tokens, logits)


def test_dsa_v32_matches_transformers(reference, impl="torch"):
    """The indexer from the checkpoint's weights drives sparse decode: contexts grow past index_topk (12)."""
    ref = reference(V32_CASE)
    tokens, logits, rt = serve(ref, V32_CASE.new_tokens, "backend=dsa", f"backend.impl={impl}")
    spec = rt.container.model_spec()
    assert spec.sparse_layers == list(range(spec.num_layers)) and spec.index_topk == 12
    assert max(len(p) for p in ref.prompts) + V32_CASE.new_tokens > spec.index_topk + 1
    check(ref, tokens, logits)


BF16_CPU = [replace(c, init_std=BF16_INIT_STD) for c in (CASES[0], CASES[2])]  # MoE with grouped routing; dense


def bf16_run(case: Case, ref: Reference):
    cfg = compose_config("model=hf", f"model.path={ref.folder}", "model.dtype=bfloat16", "device=cpu", "check=off",
                         "progress=false", "backend=torch_mla", *prompt_overrides(ref.folder, ref.prompts, case.new_tokens))
    rt = build(cfg)
    res = rt.engine.run()
    model, spec = rt.container.model(), rt.container.model_spec()
    tokens = [res.outputs[i] for i in range(len(ref.prompts))]
    p = bf16_parity(case, ref, tokens, [model.logits(res.hidden[i]) for i in range(len(ref.prompts))], "cpu")
    return p, routing_flip_budget(p.positions, "bfloat16", spec.has_moe)


@pytest.mark.parametrize("case", BF16_CPU, ids=[c.name for c in BF16_CPU])
def test_bf16_within_bf16_resolution_of_transformers(case, reference):
    p, budget = bf16_run(case, reference(case))
    print(f"\n{case.name} on torch_mla bf16: {p.summary()}")
    assert p.positions == len(case.prompt_lens) * case.new_tokens
    assert_bf16_parity(p, budget)


def test_bf16_check_fails_on_a_wrong_softmax_scale(reference, monkeypatch):
    """The bf16 comparison is strict: 0.9 x the softmax scale multiplies the median logit error by ~6 against
    transformers' own bf16 error (measured on the CPU and on an H100), far past BF16_ERROR_RATIO."""
    case = BF16_CPU[1]
    ref = reference(case)
    right = ModelSpec.sm_scale
    monkeypatch.setattr(ModelSpec, "sm_scale", property(lambda s: 0.9 * right.fget(s)))
    p, budget = bf16_run(case, ref)
    print(f"\n{case.name} on torch_mla bf16, 0.9 x softmax scale: {p.summary()}")
    assert p.median_err > 2 * BF16_ERROR_RATIO * p.median_err_bf16, p.summary()
    with pytest.raises(AssertionError):
        assert_bf16_parity(p, budget)
