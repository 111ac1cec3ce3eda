"""DeepSeek pieces against hand-written formulas: YaRN frequencies and scales, interleaved RoPE, routing (V2
greedy / group-limited, V3 noaux_tc), grouped expert compute, the V3.2 indexer's projections."""

from __future__ import annotations

import cmath
import math
from dataclasses import replace

import pytest
import torch

from runtime.core.model_spec import ModelSpec
from runtime.model.deepseek.moe import route, routed_experts
from runtime.model.deepseek.rope import apply_rope_half, apply_rope_interleaved, inv_freq, rope_params
from runtime.model.deepseek.weights import DenseMLPWeights, MoEWeights
from runtime.model.indexer import IndexerWeights, indexer_projections

BASE = {"name": "t", "num_layers": 1, "hidden_size": 16, "num_heads": 2, "qk_rope_head_dim": 64, "dtype": "float32"}


def spec(**kw) -> ModelSpec:
    return ModelSpec.from_config({**BASE, **kw})


def test_yarn_frequencies_and_scales_by_hand():
    s = spec(rope_type="yarn", rope_factor=40.0, rope_original_max_position=4096, rope_beta_fast=32.0,
             rope_beta_slow=1.0, rope_mscale=0.707, rope_mscale_all_dim=0.707, rope_theta=10000.0)
    dim, base = 64, 10000.0
    low = math.floor(dim * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(base)))
    high = math.ceil(dim * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(base)))
    want = []
    for i in range(dim // 2):
        f = base ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep f, 1: f / factor
        want.append(f / 40 * ramp + f * (1 - ramp))
    assert torch.allclose(inv_freq(rope_params(s), s.qk_rope_head_dim), torch.tensor(want, dtype=torch.float64), rtol=1e-12)
    m = 0.1 * 0.707 * math.log(40) + 1
    assert s.sm_scale == pytest.approx(m * m / math.sqrt(128 + 64))
    assert s.rope_attention_factor == pytest.approx(1.0)  # mscale / mscale_all_dim
    s2 = replace(s, rope_mscale=1.0, rope_mscale_all_dim=None)
    assert s2.rope_attention_factor == pytest.approx(0.1 * math.log(40) + 1) and s2.sm_scale == pytest.approx(192**-0.5)
    assert spec().sm_scale == pytest.approx(192**-0.5) and spec().rope_attention_factor == 1.0


def test_interleaved_rope_is_complex_rotation_of_pairs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)
    ang = torch.rand(3, 4, generator=g, dtype=torch.float64) * 6
    out = apply_rope_interleaved(x, ang.cos(), ang.sin())
    for t in range(3):
        for h in range(2):
            for i in range(4):
                z = complex(x[t, h, 2 * i], x[t, h, 2 * i + 1]) * cmath.exp(1j * ang[t, i].item())
                assert out[t, h, i].item() == pytest.approx(z.real) and out[t, h, 4 + i].item() == pytest.approx(z.imag)
    half = apply_rope_half(x, ang.cos(), ang.sin())
    for i in range(4):
        z = complex(x[0, 0, i], x[0, 0, 4 + i]) * cmath.exp(1j * ang[0, i].item())
        assert half[0, 0, i].item() == pytest.approx(z.real) and half[0, 0, 4 + i].item() == pytest.approx(z.imag)


def _moe_weights(e: int, d: int, inter: int, bias: bool, g: torch.Generator) -> MoEWeights:
    return MoEWeights(gate=torch.randn(e, d, generator=g), bias=torch.randn(e, generator=g) * 0.1 if bias else None,
                      gate_up=torch.randn(e, 2 * inter, d, generator=g), down=torch.randn(e, d, inter, generator=g),
                      shared=None)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_routing_by_hand(method):
    g = torch.Generator().manual_seed(1)
    e, groups, tg, k = 8, 4, 2, 3
    sigmoid = method == "noaux_tc"
    s = spec(n_routed_experts=e, num_experts_per_tok=k, n_group=groups, topk_group=tg, routed_scaling_factor=2.5,
             norm_topk_prob=sigmoid, scoring_func="sigmoid" if sigmoid else "softmax", topk_method=method)
    w = _moe_weights(e, 16, 4, sigmoid, g)
    x = torch.randn(5, 16, generator=g)
    weights, ids = route(s, w, x)
    for t in range(5):
        logits = [sum(x[t, j].item() * w.gate[i, j].item() for j in range(16)) for i in range(e)]
        if sigmoid:
            score = [1 / (1 + math.exp(-v)) for v in logits]
            choice = [score[i] + w.bias[i].item() for i in range(e)]
            gscore = [sum(sorted(choice[2 * q : 2 * q + 2])[-2:]) for q in range(groups)]
        else:
            z = sum(math.exp(v) for v in logits)
            score = choice = [math.exp(v) / z for v in logits]
            gscore = [max(choice[2 * q : 2 * q + 2]) for q in range(groups)]
        if method == "greedy":
            allowed = set(range(e))
        else:
            best = sorted(range(groups), key=lambda q: -gscore[q])[:tg]
            allowed = {i for i in range(e) if i // 2 in best}
        chosen = sorted(allowed, key=lambda i: -choice[i])[:k]
        wt = [score[i] for i in chosen]
        if sigmoid:
            wt = [v / (sum(wt) + 1e-20) for v in wt]
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(chosen)
        for i, v in zip(chosen, wt):
            assert got[i] == pytest.approx(2.5 * v, rel=1e-5)


def test_grouped_experts_equal_per_token_sum():
    g = torch.Generator().manual_seed(2)
    w = _moe_weights(6, 16, 8, False, g)
    x = torch.randn(7, 16, generator=g)
    ids = torch.tensor([[0, 5], [5, 0], [2, 3], [3, 2], [5, 4], [1, 0], [0, 1]])
    weights = torch.rand(7, 2, generator=g)
    out = routed_experts(w, x, weights, ids, grouped_mm=False)
    for t in range(7):
        want = torch.zeros(16)
        for j in range(2):
            e = ids[t, j]
            gate, up = w.gate_up[e, :8] @ x[t], w.gate_up[e, 8:] @ x[t]
            want += weights[t, j] * (w.down[e] @ (torch.nn.functional.silu(gate) * up))
        assert torch.allclose(out[t], want, rtol=1e-5, atol=1e-5)


def test_indexer_projections_by_hand():
    """LayerNorm (with bias) on k, half-split RoPE on the first rope dims of q and k, weights * Hi^-1/2 * Di^-1/2."""
    g = torch.Generator().manual_seed(3)
    s = spec(q_lora_rank=8, index_n_heads=2, index_head_dim=96, layer_pattern=["sparse"])
    iw = IndexerWeights(wq_b=torch.randn(2 * 96, 8, generator=g), wk=torch.randn(96, 16, generator=g),
                        k_norm_weight=torch.randn(96, generator=g), k_norm_bias=torch.randn(96, generator=g),
                        weights_proj=torch.randn(2, 16, generator=g))
    xn, q_in = torch.randn(3, 16, generator=g), torch.randn(3, 8, generator=g)
    ang = torch.rand(3, 32, generator=g)
    q, k, w = indexer_projections(iw, s, xn, q_in, ang.cos(), ang.sin())
    raw_k = iw.wk @ xn[1]
    normed = (raw_k - raw_k.mean()) / torch.sqrt(raw_k.var(unbiased=False) + 1e-6) * iw.k_norm_weight + iw.k_norm_bias
    rot = torch.cat([normed[:32] * ang[1].cos() - normed[32:64] * ang[1].sin(),
                     normed[32:64] * ang[1].cos() + normed[:32] * ang[1].sin(), normed[64:]])
    assert torch.allclose(k[1], rot, atol=1e-5)
    qh = (iw.wq_b @ q_in[2]).view(2, 96)[1]
    assert torch.allclose(q[2, 1, 64:], qh[64:], atol=1e-5)
    assert torch.allclose(q[2, 1, :32], qh[:32] * ang[2].cos() - qh[32:64] * ang[2].sin(), atol=1e-5)
    assert torch.allclose(w[0], (iw.weights_proj @ xn[0]) / math.sqrt(2 * 96), atol=1e-6)


def test_dense_mlp_swiglu_by_hand():
    from runtime.model.deepseek.mlp import dense_mlp

    g = torch.Generator().manual_seed(4)
    w = DenseMLPWeights(gate_up=torch.randn(10, 6, generator=g), down=torch.randn(6, 5, generator=g))
    x = torch.randn(2, 6, generator=g)
    gate, up = x @ w.gate_up[:5].T, x @ w.gate_up[5:].T
    assert torch.allclose(dense_mlp(w, x), (gate * torch.sigmoid(gate) * up) @ w.down.T, atol=1e-5)
