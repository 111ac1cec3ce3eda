"""Tiny random DeepSeek models built with transformers' own classes (the oracle), saved as Hugging Face folders.

Each case names a model class, its config and the prompts; :func:`make_case` saves the model to a folder and
returns transformers' greedy tokens and last-prompt-token logits for every prompt, plus the smallest top-2 logit
gap over every position it generated (a test requires it well above the tolerance: no near-ties).

:func:`bf16_parity` judges a 16-bit run against the float32 reference (see there); the bf16 cases use
``BF16_INIT_STD`` weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Weight scale of the bf16 comparisons (``Case.init_std``). At the default 0.25 every linear has gain ~2 and the
# tiny models are chaotic: transformers' own bf16 run moves logits by 3-9% (median per position; up to 5 absolute
# on a max logit of 8) and flips greedy tokens at top-2 gaps up to 3.5, so a 10% softmax-scale error only raises
# that error 1.5-3x. At 0.125 (gain ~1) transformers' bf16 error is 1.5-3.5% and the same scale error multiplies
# it by 5-7 (H100 and CPU, every case): a sharp test.
BF16_INIT_STD = 0.125
# Our median per-position logit error may be at most this multiple of transformers' own bf16 error (measured
# 0.80-1.03 on an H100 with flashinfer_mla, triton_mla and dsa, 0.78-1.0 with torch_mla on the CPU; a 10%
# softmax-scale error gives 5.2-7.2 on the H100, 4.9 in the CPU test).
BF16_ERROR_RATIO = 2.0

# Lengths 1..40 (odd ones, a page boundary at 16/17), served together as one batch.
PROMPT_LENS = (1, 2, 7, 16, 17, 24, 33, 40)
NEW_TOKENS = 6
VOCAB = 96

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=512, qk_rope_head_dim=64,
            qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
            attention_bias=False, pad_token_id=None, bos_token_id=0, eos_token_id=1)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 128,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}


@dataclass
class Case:
    name: str
    kind: str  # deepseek_v2 | deepseek_v3 | deepseek_v32
    config: dict
    seed: int = 0
    prompt_lens: tuple[int, ...] = PROMPT_LENS
    new_tokens: int = NEW_TOKENS
    official_rope_spelling: bool = False  # rewrite config.json with rope_scaling + top-level rope_theta
    init_std: float = 0.25
    extra: dict = field(default_factory=dict)


CASES = [
    Case("v3_qlora_yarn_moe_grouped", "deepseek_v3", dict(
        q_lora_rank=32, rope_parameters=YARN, rope_interleave=True, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True), seed=1),
    Case("v3_no_qlora_halfsplit_tied_5heads", "deepseek_v3", dict(
        q_lora_rank=None, rope_interleave=False, num_attention_heads=5, num_key_value_heads=5,
        first_k_dense_replace=0, n_routed_experts=6, num_experts_per_tok=3, n_group=1, topk_group=1,
        n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}), seed=2),
    Case("v3_dense_only_official_rope_spelling", "deepseek_v3", dict(
        q_lora_rank=24, num_hidden_layers=2, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        n_group=2, topk_group=1, rope_parameters=YARN), seed=3, official_rope_spelling=True),
    Case("v2_lite_greedy_yarn", "deepseek_v2", dict(
        q_lora_rank=None, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=2,
        topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
        rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707)), seed=4),
    Case("v2_group_limited_qlora_7heads", "deepseek_v2", dict(
        q_lora_rank=32, hidden_size=56, num_attention_heads=7, num_key_value_heads=7, first_k_dense_replace=0, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, topk_method="group_limited_greedy",
        routed_scaling_factor=4.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), seed=5),
]

# V3.2: the dsa backend prefills densely (as the reference does while a prompt fits in index_topk), and decodes
# sparsely: prompts up to index_topk tokens, decoding past it, so decode steps attend to a strict subset.
V32_CASE = Case("v32_indexer_yarn_moe", "deepseek_v32", dict(
    q_lora_rank=32, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, index_n_heads=8, index_head_dim=128,
    index_topk=12, rope_parameters=YARN), seed=6, prompt_lens=(1, 3, 5, 8, 9, 10, 11, 12), new_tokens=10)


def _classes(kind: str):
    import transformers as tf

    return {"deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM),
            "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
            "deepseek_v32": (tf.DeepseekV32Config, tf.DeepseekV32ForCausalLM)}[kind]


def build_model(case: Case):
    """The transformers model of ``case`` with seeded weights large enough that greedy choices are not ties."""
    config_cls, model_cls = _classes(case.kind)
    cfg = dict(BASE, **case.config)
    config = config_cls(**cfg)
    config._attn_implementation = "eager"
    torch.manual_seed(case.seed)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(case.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * (case.init_std * 8 / fan_in**0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_bf16_model(case: Case):
    """The model of ``case`` in bfloat16 as transformers loads it in bf16: the modules its class keeps in float32
    (``_keep_in_fp32_modules[_strict]``: DeepSeek-V3's ``e_score_correction_bias``, V3.2's indexer
    ``weights_proj``) stay float32."""
    model = build_model(case)
    keep = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
            *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    model = model.to(torch.bfloat16)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if any(k in name for k in keep):
            t.data = t.data.float()
    return model


def prompts_of(case: Case) -> list[list[int]]:
    gen = torch.Generator().manual_seed(100 + case.seed)
    return [torch.randint(2, VOCAB, (n,), generator=gen).tolist() for n in case.prompt_lens]


@dataclass
class Reference:
    folder: Path
    prompts: list[list[int]]
    tokens: list[list[int]]  # greedy continuations
    last_logits: torch.Tensor  # [num_prompts, vocab] float32 logits at each prompt's last token
    min_gap: float  # smallest top-1 minus top-2 logit over every generated position
    gaps: list[list[float]]


def make_case(case: Case, folder: Path) -> Reference:
    """Save ``case``'s model to ``folder`` and compute the reference outputs."""
    model = build_model(case)
    model.save_pretrained(folder)
    if case.official_rope_spelling:  # as the official releases write it
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        rp = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rp.pop("rope_theta")
        rp["type"] = rp.pop("rope_type")
        cfg["rope_scaling"] = rp
        path.write_text(json.dumps(cfg))
    prompts = prompts_of(case)
    tokens, logits, gaps = [], [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logits.append(model(ids).logits[0, -1].float())
            out = model.generate(ids, max_new_tokens=case.new_tokens, min_new_tokens=case.new_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            tokens.append(out.sequences[0, len(p):].tolist())
            top2 = [torch.topk(s[0].float(), 2).values for s in out.scores]
            gaps.append([float(t[0] - t[1]) for t in top2])
    return Reference(folder, prompts, tokens, torch.stack(logits), min(min(g) for g in gaps), gaps)


def prompt_overrides(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> tuple[str, ...]:
    """Config overrides that serve ``prompts`` (token ids) through the prompts workload (a JSON-lines file written
    to ``folder``), each for exactly ``max_new_tokens`` tokens (no EOS stop, as the references generate)."""
    path = Path(folder) / f"prompts_{abs(hash(str(prompts))) % 10**8}_{max_new_tokens}.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": max_new_tokens}) + "\n" for p in prompts))
    return ("workload=prompts", f"workload.path={path}", "workload.eos_token_ids=[]",
            f"workload.max_new_tokens={max_new_tokens}")


@dataclass
class Bf16Parity:
    """A 16-bit run judged against the float32 reference, teacher forced on the run's own tokens (the references
    read prompt + our tokens, so one flip never cascades into the positions after it).

    ``flips``: (prompt, position, regret, resolution) where our token is not the float32 reference's greedy choice;
    regret = the reference's top logit minus its logit of our token; resolution = twice transformers' own bf16
    logit error at that position (max over the vocabulary of |bf16 - float32|): the most bf16 moves a logit
    difference there. A flip whose regret is below it is a near-tie at bf16 resolution."""

    positions: int
    flips: list[tuple[int, int, float, float]]
    median_err: float  # median over positions of |ours - float32| / |float32| (logit vectors)
    median_err_bf16: float  # the same for transformers' own bf16 run

    @property
    def beyond(self) -> list[tuple[int, int, float, float]]:
        return [f for f in self.flips if f[2] > f[3]]

    def summary(self) -> str:
        return (f"{len(self.flips)}/{self.positions} tokens differ from float32, {len(self.flips) - len(self.beyond)} "
                f"at bf16 near-ties, {len(self.beyond)} beyond; median logit error {self.median_err:.4f} vs "
                f"transformers bf16 {self.median_err_bf16:.4f}")


def bf16_parity(case: Case, ref: Reference, tokens: list[list[int]], logits: list[torch.Tensor],
                device: str | torch.device) -> Bf16Parity:
    """Compare our 16-bit run (``tokens`` and our float32 ``logits`` [new_tokens, vocab] at every generated position
    of each prompt) with transformers' float32 and bfloat16 runs of ``case`` over the same sequences."""
    m32, m16 = build_model(case).to(device), build_bf16_model(case).to(device)
    flips, err, err16 = [], [], []
    with torch.no_grad():
        for i, (prompt, ours, lo) in enumerate(zip(ref.prompts, tokens, logits)):
            seq = torch.tensor([prompt + ours], device=device)
            span = slice(len(prompt) - 1, len(prompt) - 1 + len(ours))
            l32 = m32(seq).logits[0, span].float()
            l16 = m16(seq).logits[0, span].float()
            lo = lo.to(device).float()
            norm = torch.linalg.vector_norm(l32, dim=-1)
            err += (torch.linalg.vector_norm(lo - l32, dim=-1) / norm).tolist()
            err16 += (torch.linalg.vector_norm(l16 - l32, dim=-1) / norm).tolist()
            regret = l32.max(dim=-1).values - l32.gather(1, torch.tensor(ours, device=device)[:, None])[:, 0]
            resolution = 2 * (l16 - l32).abs().max(dim=-1).values
            flips += [(i, j, r, q) for j, (r, q) in enumerate(zip(regret.tolist(), resolution.tolist())) if r > 0]
    return Bf16Parity(len(err), flips, float(torch.tensor(err).median()), float(torch.tensor(err16).median()))


def assert_bf16_parity(p: Bf16Parity, flip_budget: int) -> None:
    """Our logit error no worse than ``BF16_ERROR_RATIO`` x transformers' own bf16 error (a wrong scale or an op in
    the wrong precision fails here), and at most ``flip_budget`` flips beyond bf16 resolution (expert routing and
    top-k selection are discrete: bf16 rounding moves a token to another expert or out of the top-k, and its logits
    with it; see runtime.app.parity.ROUTING_FLIP_FRACTION)."""
    assert p.median_err == p.median_err and p.median_err <= BF16_ERROR_RATIO * p.median_err_bf16, p.summary()
    beyond = [f"prompt {i} position {j}: regret {r:.3f} > resolution {q:.3f}" for i, j, r, q in p.beyond]
    assert len(beyond) <= flip_budget, f"{p.summary()}; budget {flip_budget}: " + "; ".join(beyond)
