"""The fused decoder kernels (FusedOps, backends/kernels/decoder/decoder_ops.py) against the unfused torch ops
(TorchOps).

On the CPU the kernels run in Triton's interpreter at tiny sizes (float32); the ``gpu`` tests run them compiled
at DeepSeek-V3 TP8 sizes in bfloat16 on odd row counts (1, 7, 63): relative error <= 1e-2, no NaN.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from triton_env import DEV, needs_gpu, rel_err

from runtime.core.kv_pool import MLAKVPool
from runtime.model.deepseek.moe import route
from runtime.model.deepseek.ops import GEMM_COUNTERS, FusedOps, TorchOps
from runtime.model.deepseek.weights import DenseMLPWeights, MoEWeights

REF, FUSED = TorchOps(), FusedOps()


def _spec(**kw):
    base = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, rms_norm_eps=1e-6, rope_interleave=True,
                num_experts_per_tok=3, n_group=4, topk_group=2, scoring_func="sigmoid", topk_method="noaux_tc",
                norm_topk_prob=True, routed_scaling_factor=2.5)
    return SimpleNamespace(**{**base, **kw})


def _close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = rel_err(a, b)  # a NaN fails there
    assert err <= tol, f"relative error {err:.3e} > {tol}"


def _cos_sin(t, half, dev):
    ang = torch.rand(t, half, device=dev) * 6.28
    return ang.cos(), ang.sin()


# ---------------------------------------------------------------------------------------- one case per op
def check_add_rms_norm(t, d, dtype, dev, tol):
    x = torch.randn(t, d + 8, dtype=dtype, device=dev)[:, :d]  # strided rows
    delta = torch.randn(t, d, dtype=dtype, device=dev)
    w = (torch.rand(d, device=dev) + 0.5).to(dtype)
    r_ref, y_ref = REF.add_rms_norm(x, delta, w, 1e-6)
    r, y = FUSED.add_rms_norm(x, delta, w, 1e-6)
    _close(r, r_ref, tol)
    _close(y, y_ref, tol)
    r0, y0 = FUSED.add_rms_norm(x, None, w, 1e-6)
    assert r0 is x
    _close(y0, REF.rms_norm(x, w, 1e-6), tol)


def check_v4_rms_norm(shape, dtype, dev, tol, weighted, out_dtype=None):
    """V4's norms (the weight before the cast; unweighted) against runtime.model.dsv4.norms, on a strided view."""
    d = shape[-1]
    x = torch.randn(*shape[:-1], d + 8, dtype=dtype, device=dev)[..., :d] * 3
    w = (torch.rand(d, device=dev) + 0.5).to(dtype) if weighted else None
    y = FUSED.v4_rms_norm(x, w, 1e-6, out_dtype)
    assert y.dtype == (out_dtype or dtype) and y.is_contiguous()
    _close(y, REF.v4_rms_norm(x, w, 1e-6, out_dtype), tol)


def check_rope_latent(t, h, nope, c, r, interleave, dtype, dev, tol, kv_dtype="auto", absorb=False):
    """The query's RoPE and the latent row (norm, RoPE, cache write) in one launch against the torch ops; an fp8
    pool keeps the torch write (it counts clipped values) beside the fused query RoPE. ``absorb``: also
    q_nope @ W_UK (in the same launch for 16-bit dtypes at few rows), whose bits must equal FusedOps.head_linear's."""
    spec = _spec(qk_nope_head_dim=nope, kv_lora_rank=c, qk_rope_head_dim=r, rope_interleave=interleave)
    pools = [MLAKVPool([0], 8, 16, c, r, dtype, dev, kv_dtype=kv_dtype) for _ in range(2)]
    slots = torch.randperm(8 * 16 - 16, device=dev)[:t] + 16  # distinct, off the padding page
    q = torch.randn(t, h, nope + r, dtype=dtype, device=dev)
    kv = torch.randn(t, 24 + c + r, dtype=dtype, device=dev)[:, 24:]  # a slice of the fused GEMM output
    w = (torch.rand(c, device=dev) + 0.5).to(dtype)
    cos, sin = _cos_sin(t, r // 2, dev)
    w_uk = (torch.randn(h, nope, c, device=dev) / nope**0.5).to(dtype) if absorb else None
    ref = REF.rope_latent(spec, q.clone(), pools[0], 0, slots, kv.clone(), w, cos, sin, w_uk)
    out = FUSED.rope_latent(spec, q, pools[1], 0, slots, kv, w, cos, sin, w_uk)
    assert (out[4] is None) == (ref[4] is None) == (not absorb)
    for a, b in zip(out[: 5 if absorb else 4], ref):
        _close(a, b, tol)
    if absorb:  # at few rows the per-head kernel's bits; past gemv_rows the batched matmul's
        assert torch.equal(out[4], FUSED.head_linear(out[0], w_uk))
    _close(pools[1].flat(0)[slots].float(), pools[0].flat(0)[slots].float(), tol)
    assert out[0].data_ptr() == q.data_ptr() and out[1].data_ptr() == q[..., nope:].data_ptr()  # q in place
    if kv_dtype == "auto":
        assert out[2].data_ptr() == kv.data_ptr()  # the latent in place
    assert pools[1].quant_stats() == pools[0].quant_stats()


def check_silu_mul(t, inter, dtype, dev, tol):
    h = torch.randn(t, 2 * inter + 4, dtype=dtype, device=dev)[:, : 2 * inter]
    _close(FUSED.silu_mul(h), REF.silu_mul(h), tol)


def check_route(t, e, d, spec, dev):
    x = torch.randn(t, d, device=dev)
    w = MoEWeights(gate=torch.randn(e, d, device=dev) / d**0.5, bias=torch.randn(e, device=dev) * 0.01,
                   gate_up=None, down=None, shared=None)
    wr, ir = route(spec, w, x)
    from backends.kernels.decoder.decoder_ops import route_sigmoid

    wf, idf = route_sigmoid(torch.nn.functional.linear(x, w.gate), w.bias, spec.n_group, spec.topk_group, spec.num_experts_per_tok,
                            spec.norm_topk_prob, spec.routed_scaling_factor)
    assert torch.equal(idf, ir), "expert ids differ from the torch routing"
    _close(wf, wr, 1e-5)


def check_dispatch_combine(t, k, e, d, dtype, dev, tol, sort_from=None):
    from backends.kernels.decoder.decoder_ops import SORT_DISPATCH_FROM, moe_combine, moe_dispatch

    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    tokens, inv, offs = moe_dispatch(ids, e, sort_from or SORT_DISPATCH_FROM)
    order = torch.argsort(ids.reshape(-1), stable=True)
    assert torch.equal(tokens, order // k)
    assert torch.equal(inv[order], torch.arange(t * k, device=dev))
    assert torch.equal(offs, torch.bincount(ids.reshape(-1), minlength=e).cumsum(0).to(torch.int32))
    y = torch.randn(t * k, d, dtype=dtype, device=dev)
    wts = torch.rand(t, k, device=dev)
    shared = torch.randn(t, d, dtype=dtype, device=dev)
    unsorted = torch.empty(t * k, d, device=dev)
    unsorted[order] = y.float()
    ref = (unsorted.view(t, k, d) * wts[:, :, None]).sum(dim=1).to(dtype) + shared
    _close(moe_combine(y, inv, wts, shared, dtype), ref, tol)
    # limit: rows of y from it on (other ranks' pairs) read as zeros, whatever they hold
    cut = torch.tensor([t * k // 2], dtype=torch.int32, device=dev)
    zeroed = torch.where((torch.arange(t * k, device=dev) < cut)[:, None], y, 0.0)
    assert torch.equal(moe_combine(y, inv, wts, shared, dtype, cut), moe_combine(zeroed, inv, wts, shared, dtype))


# ---------------------------------------------------------------------------------------- CPU (interpreter)
def test_add_rms_norm_small():
    check_add_rms_norm(3, 40, torch.float32, DEV, 1e-5)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, None), (torch.float16, None),
                                             (torch.float16, torch.float32)])
def test_v4_rms_norm_small(weighted, dtype, out_dtype):
    """Rows of 40 and per-head [T, H, D] rows; float16 in, float32 out (the mHC mixing input). float16 within one
    of its ulps (the sum of squares in another order), float32 within a few."""
    tol = 1e-6 if (out_dtype or dtype) == torch.float32 else 1e-3
    check_v4_rms_norm((3, 40), dtype, DEV, tol, weighted, out_dtype)
    check_v4_rms_norm((2, 3, 24), dtype, DEV, tol, weighted, out_dtype)


def test_v4_rms_norm_refuses_what_it_cannot_take():
    from backends.kernels.decoder import decoder_ops

    with pytest.raises(ValueError, match="v4_rms_norm"):
        decoder_ops.v4_rms_norm(torch.randn(2, 8, dtype=torch.float64, device=DEV), None, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        decoder_ops.v4_rms_norm(torch.randn(2, 8, device=DEV), torch.ones(7, device=DEV), 1e-6)
    wide = torch.randn(1, decoder_ops.V4_NORM_MAX + 1, dtype=torch.float64, device=DEV)
    assert torch.equal(FUSED.v4_rms_norm(wide, None, 1e-6), REF.v4_rms_norm(wide, None, 1e-6))  # torch serves


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_latent_small(interleave):
    check_rope_latent(3, 3, 16, 32, 8, interleave, torch.float32, DEV, 1e-5)


def test_rope_latent_over_an_fp8_pool_small():
    check_rope_latent(2, 3, 16, 32, 8, True, torch.float32, DEV, 1e-5, kv_dtype="fp8_e4m3")


@pytest.mark.parametrize("t,kv_dtype", [(1, "auto"), (5, "auto"), (3, "fp8_e4m3")])
def test_rope_latent_with_the_absorbed_query_small(t, kv_dtype):
    """float16 (the interpreter's tensor-core dtype): the absorb programs beside the RoPE / latent ones."""
    torch.manual_seed(t)
    check_rope_latent(t, 3, 16, 48, 8, True, torch.float16, DEV, 3e-3, kv_dtype=kv_dtype, absorb=True)


def test_silu_mul_small():
    check_silu_mul(3, 24, torch.float32, DEV, 1e-5)


# groups of 3 and 5 experts: the kernel's padded group rows must not alias the next group's experts
@pytest.mark.parametrize("e,groups,topk_group,k", [(16, 4, 2, 3), (6, 1, 1, 3), (8, 2, 1, 2), (6, 2, 1, 2),
                                                   (12, 4, 2, 3), (10, 2, 1, 4)])
def test_route_sigmoid_small(e, groups, topk_group, k):
    torch.manual_seed(0)
    check_route(5, e, 24, _spec(n_group=groups, topk_group=topk_group, num_experts_per_tok=k), DEV)


def _route_lowest_index_first(logits, bias, groups, topk_group, k, scale):
    """noaux_tc routing in plain Python with ties broken toward the lower group / expert id."""
    ids, weights = [], []
    for row in logits.tolist():
        s = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [a + b for a, b in zip(s, bias.tolist())]
        per = len(row) // groups
        gs = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: (-gs[g], g))[:topk_group]
        cand = [e for e in range(len(row)) if e // per in kept]
        top = sorted(cand, key=lambda e: (-choice[e], e))[:k]
        w = [s[e] for e in top]
        ids.append(top)
        weights.append([v / (sum(w) + 1e-20) * scale for v in w])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


def test_route_sigmoid_breaks_ties_toward_the_lower_expert_id():
    """Logits from four values and a zero bias: many equal choices, in and across groups; among equal choices the
    lower group and the lower expert id come first (the kernel's rule before and after its one-max-per-pick form)."""
    from backends.kernels.decoder.decoder_ops import route_sigmoid

    g = torch.Generator().manual_seed(3)
    logits = torch.tensor([-1.0, 0.0, 0.5, 2.0])[torch.randint(0, 4, (6, 32), generator=g)]
    bias = torch.zeros(32)
    w, ids = route_sigmoid(logits.to(DEV), bias.to(DEV), 4, 2, 5, True, 2.5)
    want_ids, want_w = _route_lowest_index_first(logits.double(), bias.double(), 4, 2, 5, 2.5)
    assert torch.equal(ids.cpu(), want_ids)
    assert torch.allclose(w.cpu().double(), want_w, rtol=1e-6)


@pytest.mark.parametrize("sort_from", [None, 1], ids=["counting-kernel", "block-sort"])
def test_dispatch_combine_small(sort_from):
    """Both ways of grouping the pairs (the counting kernel of decode, the block counting sort of prefill sizes)
    give the stable order."""
    torch.manual_seed(0)
    check_dispatch_combine(5, 3, 8, 24, torch.float32, DEV, 1e-5, sort_from)


def check_dispatch(ids, e, sort_from):
    """moe_dispatch of any ids (repeats, idle experts) against a stable argsort."""
    from backends.kernels.decoder.decoder_ops import moe_dispatch

    tokens, inv, offs = moe_dispatch(ids, e, sort_from)
    k = ids.shape[1]
    order = torch.argsort(ids.reshape(-1), stable=True)
    assert torch.equal(tokens, order // k)
    assert torch.equal(inv[order], torch.arange(ids.numel(), device=ids.device))
    assert torch.equal(offs, torch.bincount(ids.reshape(-1), minlength=e).cumsum(0).to(torch.int32))


@pytest.mark.parametrize("t,k,e", [(300, 3, 9), (129, 8, 16), (1, 1, 1), (100, 2, 1), (70, 4, 257)])
def test_dispatch_block_sort_odd_sizes(t, k, e):
    """The block counting sort across several blocks of 256 pairs (and a partial last one): skewed routing (half
    the pairs on expert 0), experts with no pair, one expert taking every pair, E a power of two (its spare bin
    in the next one), 257 groups (moe=ep's 256 + the other ranks' group)."""
    torch.manual_seed(t)
    ids = torch.randint(0, e, (t, k), device=DEV)
    ids[torch.rand(t, k, device=DEV) < 0.5] = 0
    check_dispatch(ids, e, 1)


def test_torch_ops_without_delta_return_x():
    x = torch.randn(2, 8)
    r, y = REF.add_rms_norm(x, None, torch.ones(8), 1e-6)
    assert r is x and torch.allclose(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


# ---------------------------------------------------------------------------------------- GPU, real sizes
ROWS = [1, 7, 63]
BF = torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("t", ROWS)
def test_fused_ops_match_torch_gpu(t):
    needs_gpu()
    torch.manual_seed(t)
    check_add_rms_norm(t, 7168, BF, "cuda", 1e-2)
    check_add_rms_norm(t, 1536, BF, "cuda", 1e-2)
    for interleave in (True, False):
        check_rope_latent(t, 16, 128, 512, 64, interleave, BF, "cuda", 1e-2, absorb=interleave)
    check_silu_mul(t, 2304, BF, "cuda", 1e-2)
    check_silu_mul(t, 256, BF, "cuda", 1e-2)
    check_dispatch_combine(t, 8, 256, 7168, BF, "cuda", 1e-2)
    check_dispatch_combine(t, 8, 256, 7168, BF, "cuda", 1e-2, sort_from=1)  # the prefill-size path
    # DeepSeek-V4-Flash: q_a_norm (1024), the per-head query norm (64 x 512), the mHC input (4 x 4096) to float32
    check_v4_rms_norm((t, 1024), BF, "cuda", 1e-2, True)
    check_v4_rms_norm((t, 64, 512), BF, "cuda", 1e-2, False)
    check_v4_rms_norm((t, 16384), BF, "cuda", 1e-5, False, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e", [(513, 256), (1024, 257), (16384, 257)])
def test_dispatch_block_sort_gpu(t, e):
    """Prefill-sized dispatch (the block counting sort: 4104 to 131072 pairs) against a stable argsort, routing
    skewed to expert 0."""
    needs_gpu()
    torch.manual_seed(t)
    ids = torch.randint(0, e, (t, 8), device="cuda")
    ids[torch.rand(t, 8, device="cuda") < 0.3] = 0
    check_dispatch(ids, e, 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [17, 2048])
def test_router_product_bf16_gpu(t):
    """Past the few-row kernel a 16-bit router's float32 logits come from one tensor-core product with float32
    output (16-bit products are exact in float32): within float32 summation order of the reference's
    F.linear(x.float(), gate.float()); the same experts but for near-ties (summation order: at most 1% of the
    tokens), the weights within 1e-5 elsewhere."""
    needs_gpu()
    torch.manual_seed(7 + t)
    e, d = 256, 7168
    spec = _spec(num_experts_per_tok=8, n_group=8, topk_group=4)
    w = MoEWeights(gate=(torch.randn(e, d, device="cuda") / d**0.5).to(BF), bias=torch.randn(e, device="cuda") * 0.01,
                   gate_up=None, down=None, shared=None)
    x = torch.randn(t, d, device="cuda").to(BF)
    _close(torch.mm(x, w.gate.t(), out_dtype=torch.float32), torch.nn.functional.linear(x.float(), w.gate.float()),
           1e-5)
    wf, idf = FUSED._route(spec, w, x, few=False)
    wr, ir = route(spec, w, x)
    same = (idf == ir).all(-1)
    assert int((~same).sum()) <= t // 100, f"{int((~same).sum())} of {t} tokens route elsewhere"
    _close(wf[same], wr[same], 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("t", ROWS)
def test_fused_moe_matches_torch_gpu(t):
    """The whole fused MoE (V3 routing, grouping, grouped GEMMs, combine + shared) against the torch MoE at
    the TP8 expert shapes (256 experts, intermediate 256)."""
    needs_gpu()
    torch.manual_seed(100 + t)
    e, d, i = 256, 7168, 256
    spec = _spec(num_experts_per_tok=8, n_group=8, topk_group=4)
    check_route(t, e, d, spec, "cuda")
    w = MoEWeights(gate=torch.randn(e, d, device="cuda") / d**0.5, bias=torch.randn(e, device="cuda") * 0.01,
                   gate_up=(torch.randn(e, 2 * i, d, device="cuda") / d**0.5).to(BF),
                   down=(torch.randn(e, d, i, device="cuda") / i**0.5).to(BF),
                   shared=DenseMLPWeights((torch.randn(2 * i, d, device="cuda") / d**0.5).to(BF),
                                          (torch.randn(d, i, device="cuda") / i**0.5).to(BF)))
    x = torch.randn(t, d, device="cuda").to(BF)
    _close(FUSED.moe(spec, w, x, True), REF.moe(spec, w, x, True), 1e-2)
    _close(FUSED.dense_mlp(w.shared, x), REF.dense_mlp(w.shared, x), 1e-2)


def _grouped_mm_emulated(x, w, offs):
    """torch._grouped_mm's contract on the CPU: rows offs[e-1]:offs[e] of x times w[e] ([E, K, N])."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


@pytest.mark.parametrize("scoring,e,groups,topk_group,k", [("sigmoid", 8, 4, 2, 2), ("sigmoid", 6, 1, 1, 3),
                                                            ("softmax", 8, 1, 1, 3)])
def test_fused_moe_glue_matches_torch_small(monkeypatch, scoring, e, groups, topk_group, k):
    """The fused MoE's routing, grouping and combine around an emulated grouped GEMM, at the tiny checkpoint
    cases' expert counts (the torch MoE runs on the same emulation)."""
    monkeypatch.setattr(torch, "_grouped_mm", _grouped_mm_emulated, raising=False)
    torch.manual_seed(e + k)
    d, i, t = 24, 8, 5
    spec = _spec(scoring_func=scoring, topk_method="noaux_tc" if scoring == "sigmoid" else "greedy", n_group=groups,
                 topk_group=topk_group, num_experts_per_tok=k)
    w = MoEWeights(gate=torch.randn(e, d, device=DEV) / d**0.5,
                   bias=torch.randn(e, device=DEV) * 0.01 if scoring == "sigmoid" else None,
                   gate_up=torch.randn(e, 2 * i, d, device=DEV) / d**0.5, down=torch.randn(e, d, i, device=DEV) / i**0.5,
                   shared=DenseMLPWeights(torch.randn(2 * i, d, device=DEV) / d**0.5,
                                          torch.randn(d, i, device=DEV) / i**0.5))
    x = torch.randn(t, d, device=DEV)
    _close(FUSED.moe(spec, w, x, True), REF.moe(spec, w, x, True), 1e-5)


def _grouped_mm_nan_tail(x, w, offs):
    """The emulation, with NaN in the rows past the last offset (the real kernel leaves them unwritten)."""
    out = _grouped_mm_emulated(x, w, offs)
    out[int(offs[-1]):] = float("nan")
    return out


@pytest.mark.parametrize("e,groups,k", [(8, 2, 2), (8, 4, 3), (4, 1, 3)])
def test_fused_moe_expert_parallel_partials_sum_to_the_whole(monkeypatch, e, groups, k):
    """Expert parallelism (parallel.moe=ep): each of two ranks holds half the experts (``first_expert``) and
    its fused MoE output counts only its own (token, expert) pairs; other ranks' pairs fall in a group past the
    last grouped-GEMM offset, whose unwritten rows (NaN here) must not leak. The two partial outputs sum (as the
    all-reduce does) to the whole MoE's."""
    monkeypatch.setattr(torch, "_grouped_mm", _grouped_mm_nan_tail, raising=False)
    torch.manual_seed(10 * e + k)
    d, i, t, half = 24, 8, 7, e // 2
    spec = _spec(n_group=groups, topk_group=max(1, groups // 2), num_experts_per_tok=k)
    w = MoEWeights(gate=torch.randn(e, d, device=DEV) / d**0.5, bias=torch.randn(e, device=DEV) * 0.01,
                   gate_up=torch.randn(e, 2 * i, d, device=DEV) / d**0.5, down=torch.randn(e, d, i, device=DEV) / i**0.5,
                   shared=DenseMLPWeights(torch.randn(2 * i, d, device=DEV) / d**0.5,
                                          torch.randn(d, i, device=DEV) / i**0.5))
    ranks = [MoEWeights(w.gate, w.bias, w.gate_up[r * half:(r + 1) * half], w.down[r * half:(r + 1) * half],
                        w.shared if r == 0 else None, first_expert=r * half) for r in range(2)]
    x = torch.randn(t, d, device=DEV)
    want = REF.moe(spec, w, x, True)
    for ops in (FUSED, REF):
        _close(sum(ops.moe(spec, r, x, True) for r in ranks), want, 1e-5)


@pytest.mark.parametrize("w8a8", [True, False])
def test_fused_fp8_moe_expert_parallel_partials_sum_to_the_whole(w8a8):
    """Stored block-fp8 experts above the few-row path (the grouped GEMMs reading x through the dispatch's tokens,
    the combine skipping other ranks' rows, whatever they hold): two ranks' finite partial outputs sum to the
    one-rank MoE's, W8A8 and W8A16."""
    from runtime.model.quantized import BlockFP8

    torch.manual_seed(31)
    e, d, i, t, k, half = 8, 256, 128, 20, 3, 4
    spec = _spec(n_group=2, topk_group=1, num_experts_per_tok=k)
    gu = BlockFP8.quantize(torch.randn(e * 2 * i, d, device=DEV) / d**0.5)
    dn = BlockFP8.quantize(torch.randn(e * d, i, device=DEV) / i**0.5)

    def stack(w, rows, lo, hi):
        return BlockFP8(w.weight.view(e, rows, -1)[lo:hi].contiguous(),
                        w.scale.view(e, rows // 128, -1)[lo:hi].contiguous())

    gate, bias = torch.randn(e, d, device=DEV) / d**0.5, torch.randn(e, device=DEV) * 0.01
    whole = MoEWeights(gate, bias, stack(gu, 2 * i, 0, e), stack(dn, d, 0, e), None)
    ranks = [MoEWeights(gate, bias, stack(gu, 2 * i, r * half, (r + 1) * half), stack(dn, d, r * half, (r + 1) * half),
                        None, first_expert=r * half) for r in range(2)]
    x = torch.randn(t, d, device=DEV).half()
    ops = FusedOps(fp8_compute="w8a8" if w8a8 else "w8a16")
    want = ops.moe(spec, whole, x, True).float()
    parts = [ops.moe(spec, r, x, True).float() for r in ranks]
    assert all(torch.isfinite(p).all() for p in parts)
    _close(parts[0] + parts[1], want, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [17, 64])
def test_fp8_compute_picks_the_activation_precision_gpu(t):
    """model.fp8_compute on stored block-fp8 weights above the few-row path (17 and 64 rows: decode batches that
    used to take W8A8 whatever the setting): ``w8a16`` keeps the 16-bit activations (the dequantized model's
    error against float64), ``w8a8`` quantizes them to e4m3 (ten times that), for a linear layer and the MoE."""
    needs_gpu()
    from runtime.model.quantized import BlockFP8

    torch.manual_seed(300 + t)
    d, n, e, i = 7168, 2112, 32, 256
    w = BlockFP8.quantize(torch.randn(n, d, device="cuda") / d**0.5)
    x = torch.randn(t, d, device="cuda").to(BF)
    exact = x.double() @ w.dequantize(torch.float64).T
    ops = {c: FusedOps(fp8_compute=c) for c in ("w8a16", "w8a8")}
    err = {c: rel_err(o.linear(x, w), exact) for c, o in ops.items()}
    assert err["w8a16"] < 5e-3 and err["w8a8"] > 3 * err["w8a16"], err
    # with the workspace gemm_counters, the few-row kernel's split-K partials (9 rows) are summed in its last
    # programs: the second kernel's bits
    counted = FusedOps(fp8_compute="w8a8", counters=torch.zeros(GEMM_COUNTERS.nbytes, dtype=torch.uint8,
                                                                 device="cuda"))
    assert torch.equal(counted.linear(x[:9], w), ops["w8a8"].linear(x[:9], w)) and not counted.counters.any()
    spec = _spec(num_experts_per_tok=8, n_group=8, topk_group=4)

    def experts(rows, cols):
        parts = [BlockFP8.quantize(torch.randn(rows, cols, device="cuda") / cols**0.5) for _ in range(e)]
        return BlockFP8(torch.stack([p.weight for p in parts]), torch.stack([p.scale for p in parts]))

    moe = MoEWeights(gate=torch.randn(e, d, device="cuda") / d**0.5, bias=torch.zeros(e, device="cuda"),
                     gate_up=experts(2 * i, d), down=experts(d, i), shared=None)
    ref = REF.moe(spec, moe, x.float(), False)  # float32: the torch loop, weights dequantized per expert
    err = {c: rel_err(o.moe(spec, moe, x, False), ref) for c, o in ops.items()}
    assert err["w8a16"] < 1e-2 and err["w8a8"] > 2 * err["w8a16"], err
