"""The block-fp8 MoE expert kernels (backends/kernels/gemm/fp8_moe.py): the few-token decode path and the W8A8 grouped
GEMM path, against float64 references built from the dequantized weights.

CPU: Triton's interpreter at small sizes. The few-token path runs in float16 (the interpreter's ``tl.dot`` is
wrong for bfloat16; fp8 -> fp16 widening is exact). The grouped path's fp8 x fp8 ``tl.dot`` works in the
interpreter (checked: exact against float64 on e4m3 inputs), so it runs here too, in float16: the interpreter's
float32 -> bfloat16 cast truncates instead of rounding to nearest (Triton 3.9), which moves bf16 results by
1-2% through the activation quantization. Its float32 -> e4m3 cast is wrong when rounding carries into the next
binade, so the quantize kernel pre-rounds there (``ROUND_FIRST``); the GPU's own cast is checked by a ``gpu`` test.
``gpu`` tests: DeepSeek-V3 TP8 (moe=tp: 256 experts, I 256) and moe=ep (32 local experts, I 2048) widths in bf16,
CUDA-graph replays equal eager runs.

Tolerances (relative Frobenius error, measured on the interpreter, bound about 3x the measurement):
few-token path vs float64 on the dequantized weights: fp16 2-6e-4 -> 2e-3; grouped path vs a float64 reference
that quantizes the activations as the kernels do: 2-6e-4 -> 3e-3 (the rounding of h to 16 bits flips a few
e4m3 roundings); grouped vs the plain float64 MoE (W8A8's activation quantization, two e4m3 roundings of 2.6% each):
4-5% -> 0.08.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEV, needs_gpu, rel_err

from backends.kernels.gemm import fp8_moe
from runtime.model.deepseek.mlp import swiglu
from runtime.model.deepseek.moe import routed_expert_sum, sort_by_expert
from runtime.model.quantized import dequantize_fp8, quantize_fp8

SMALL = fp8_moe.Fp8ExpertConfig(up_block_i=64, up_sub_k=2, down_block_d=64)  # fewer interpreted programs
FEW_TOL, W8A8_TOL = 2e-3, 0.08
# the grouped path against the same quantization emulated in torch: fp16 (CPU) 2-6e-4, bf16 at real widths 5e-3
EMULATED_TOL = {torch.float16: 3e-3, torch.bfloat16: 1e-2}


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] float -> (e4m3, float32 128 x 128 block scales), stacked over the leading dims."""
    if w.dim() == 2:
        return quantize_fp8(w)
    pairs = [_quantize(wi) for wi in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if q.dim() == 2:
        return dequantize_fp8(q, s, torch.float64)
    return torch.stack([_dequantize(qi, si) for qi, si in zip(q, s)])


def make_experts(e, d, i, i_s, dev):
    """Routed experts gate_up [e, 2i, d] / down [e, d, i] and shared ones [2 i_s, d] / [d, i_s] (i_s 0: none), as
    (e4m3, scale) pairs: (gate_up, gate_up_scale, down, down_scale), (shared four or four Nones)."""
    gu = _quantize(torch.randn(e, 2 * i, d, device=dev) / d**0.5)
    dn = _quantize(torch.randn(e, d, i, device=dev) / i**0.5)
    if not i_s:
        return (*gu, *dn), (None,) * 4
    sgu = _quantize(torch.randn(2 * i_s, d, device=dev) / d**0.5)
    sdn = _quantize(torch.randn(d, i_s, device=dev) / i_s**0.5)
    return (*gu, *dn), (*sgu, *sdn)


def moe_reference(x, ids, wts, routed, shared):
    """float64 on the dequantized weights: the routed experts' weighted sum (ids == E: other ranks' experts,
    adding 0) plus the shared experts' MLP. Dequantizes only the experts the ids use."""
    gu, gus, dn, dns = routed
    n_local = gu.shape[0]
    used = sorted(set(ids[ids < n_local].tolist()))
    remap = torch.full((n_local + 1,), len(used), dtype=torch.int64, device=ids.device)
    remap[torch.tensor(used, dtype=torch.int64, device=ids.device)] = torch.arange(len(used), device=ids.device)
    gu64 = torch.stack([_dequantize(gu[e], gus[e]) for e in used]) if used else \
        torch.zeros(0, gu.shape[1], gu.shape[2], dtype=torch.float64, device=x.device)
    dn64 = torch.stack([_dequantize(dn[e], dns[e]) for e in used]) if used else \
        torch.zeros(0, dn.shape[1], dn.shape[2], dtype=torch.float64, device=x.device)
    out = routed_expert_sum(x.double(), wts.double(), remap[ids], gu64, dn64, 0, len(used) + 1, swiglu, False,
                            torch.float64)
    if shared[0] is not None:
        sg, sd = _dequantize(*shared[:2]), _dequantize(*shared[2:])
        out = out + F.linear(swiglu(F.linear(x.double(), sg)), sd)
    return out


def random_ids(t, k, n_local, dev, other=True):
    """[t, k] distinct local ids per token; with ``other``, about one pair in five is another rank's (n_local)."""
    ids = torch.stack([torch.randperm(n_local, device=dev)[:k] for _ in range(t)])
    if other:
        ids = torch.where(torch.rand(t, k, device=dev) < 0.2, n_local, ids)
    return ids.contiguous()


def check_few(t, e, d, i, i_s, k, dtype, dev, tol, config=None, ids=None):
    torch.manual_seed(t * 100 + d + i)
    routed, shared = make_experts(e, d, i, i_s, dev)
    x = torch.randn(t, d, device=dev).to(dtype)
    ids = random_ids(t, k, e, dev) if ids is None else ids
    wts = torch.rand(t, k, device=dev)
    out = fp8_moe.fp8_moe_experts(x, ids, wts, *routed, *shared, config=config)
    assert out.dtype == dtype and out.shape == (t, d)
    err = rel_err(out, moe_reference(x, ids, wts, routed, shared))
    assert err <= tol, err
    one = fp8_moe.fp8_moe_experts(x[:1], ids[:1], wts[:1], *routed, *shared, config=config)
    assert torch.equal(one, out[:1]), "token 0 alone: not the bits of the whole batch"
    return out


def grouped_inputs(t, e, d, i, k, dtype, dev, ids=None):
    """Routed (token, slot) pairs sorted by expert: (x, ids, wts, routed experts, xs, order, offsets, n_mine)."""
    routed, _ = make_experts(e, d, i, 0, dev)
    x = torch.randn(t, d, device=dev).to(dtype)
    ids = random_ids(t, k, e, dev) if ids is None else ids
    wts = torch.rand(t, k, device=dev)
    order, counts = sort_by_expert(ids.reshape(-1), e + 1)  # other ranks' pairs: one last group, dropped
    offsets = counts[:e].cumsum(0).to(torch.int32)
    return x, ids, wts, routed, x[order // k], order, offsets


def combine(y, order, ids, wts, offsets):
    """Back to (token, slot) order, other ranks' rows (past offsets[-1]) zeroed, weighted sum in float64."""
    t, k = ids.shape
    y = torch.where((torch.arange(y.shape[0], device=y.device) < offsets[-1])[:, None], y.double(), 0.0)
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return (unsorted.view(t, k, -1) * wts.double()[:, :, None]).sum(dim=1)


def emulated_reference(xs, routed, offsets, dtype):
    """float64 on the dequantized weights with the activations quantized as the kernels quantize them (per row
    and 128 columns, amax / 448, e4m3), h rounded to ``dtype`` and SiLU * up in ``dtype``."""
    gu, gus, dn, dns = routed

    def q(a):
        return dequantize_fp8(*quantize_fp8(a.float(), (1, 128)), torch.float64, block=(1, 128))

    out = torch.zeros(xs.shape[0], dn.shape[1], dtype=torch.float64, device=xs.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            h = F.linear(q(xs[start:end]), _dequantize(gu[e], gus[e])).to(dtype)
            out[start:end] = F.linear(q(swiglu(h)), _dequantize(dn[e], dns[e]))
        start = end
    return out


def check_grouped(t, e, d, i, k, dtype, dev, config=None, ids=None):
    torch.manual_seed(t + e + d)
    x, ids, wts, routed, xs, order, offsets = grouped_inputs(t, e, d, i, k, dtype, dev, ids)
    y = fp8_moe.fp8_grouped_expert_mlp(xs, *routed, offsets, swiglu, config)
    assert y.dtype == dtype and y.shape == xs.shape
    n = int(offsets[-1])
    # the rows read from x through their tokens (no gathered copy, each token quantized once): the same bits
    yg = fp8_moe.fp8_grouped_expert_mlp(x, *routed, offsets, swiglu, config, tokens=order // ids.shape[1])
    assert yg.shape == xs.shape and torch.equal(yg[:n], y[:n])
    err_emu = rel_err(y[:n], emulated_reference(xs, routed, offsets, dtype)[:n])
    assert err_emu <= EMULATED_TOL[dtype], err_emu
    err = rel_err(combine(y, order, ids, wts, offsets).to(dtype), moe_reference(x, ids, wts, routed, (None,)))
    assert err <= W8A8_TOL, err
    return err_emu, err


# ---------------------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("t", [1, 3, 9])
@pytest.mark.parametrize("i_s", [128, 0])
def test_few_tokens_match_float64(t, i_s):
    check_few(t, 5, 200, 128, i_s, 3, torch.float16, DEV, FEW_TOL, SMALL)


FMA = fp8_moe.Fp8ExpertConfig(up_block_i=8, up_sub_k=2, down_block_d=16, fma=True, down_sub_i=2)


def test_few_tokens_fma_kernels_match_float64():
    """The CUDA-core kernels: odd hidden width (a partial scale block), I 256 in chunks of 2 x 128, I_s 128 (a
    chunk past the shared width), other ranks' experts; one token, no shared experts. fp16: the interpreter's
    bf16 cast truncates (module docstring); bf16 runs in the gpu test."""
    check_few(3, 4, 199, 256, 128, 2, torch.float16, DEV, FEW_TOL, FMA)
    check_few(1, 5, 136, 128, 0, 3, torch.float16, DEV, FEW_TOL, FMA)


def test_unrolled_down_slots_give_the_loops_bits():
    """The down kernel's unrolled slots (sub_i 2: one chunk holds I 256 and I_s 128) compute the same products in
    the same order: the bits of the slot loop; other ranks' experts and a partial last scale block included. (With
    several chunks the loop stays whatever ``down_unroll`` says: nothing to compare.)"""
    sub_i = 2
    torch.manual_seed(7)
    routed, shared = make_experts(4, 136, 256, 128, DEV)
    x = torch.randn(2, 136, device=DEV).half()
    ids, wts = random_ids(2, 2, 4, DEV), torch.rand(2, 2, device=DEV)
    outs = [fp8_moe.fp8_moe_experts(x, ids, wts, *routed, *shared, config=dataclasses.replace(
        FMA, down_sub_i=sub_i, down_unroll=on)) for on in (True, False)]
    assert torch.equal(*outs)


def test_few_tokens_odd_width_default_config_and_wide_hidden():
    """D = 199 (a partial last scale block in both matrices), I 256 (two scale blocks), shared 128."""
    check_few(2, 4, 199, 256, 128, 2, torch.float16, DEV, FEW_TOL)


def test_few_tokens_one_expert_for_all_and_other_ranks_add_zero():
    torch.manual_seed(0)
    t, e, d, i, k = 4, 3, 136, 128, 2
    every = torch.tensor([[1, 3]] * t, device=DEV)  # expert 1 takes every token; slot 1: another rank's expert
    check_few(t, e, d, i, 128, k, torch.float16, DEV, FEW_TOL, SMALL, every)
    routed, _ = make_experts(e, d, i, 0, DEV)
    x = torch.randn(t, d, device=DEV).half()
    nobody = torch.full((t, k), e, device=DEV)  # every pair on other ranks, no shared experts: exactly 0
    out = fp8_moe.fp8_moe_experts(x, nobody, torch.rand(t, k, device=DEV), *routed, config=SMALL)
    assert torch.equal(out, torch.zeros_like(out))


def test_few_tokens_expert_parallel_partials_sum_to_the_whole():
    """moe=ep: two ranks hold 3 of 6 experts each (other ranks' pairs carry id 3), the shared experts on rank 0."""
    torch.manual_seed(3)
    t, d, e, i, k = 3, 72, 6, 128, 3
    routed, shared = make_experts(e, d, i, 128, DEV)
    x = torch.randn(t, d, device=DEV).half()
    ids = random_ids(t, k, e, DEV, other=False)
    wts = torch.rand(t, k, device=DEV)
    parts = []
    for r in range(2):
        local = ids - 3 * r
        local = torch.where((local >= 0) & (local < 3), local, 3).contiguous()
        mine = tuple(w[3 * r:3 * r + 3].contiguous() for w in routed)
        parts.append(fp8_moe.fp8_moe_experts(x, local, wts, *mine, *(shared if r == 0 else (None,) * 4),
                                             config=SMALL).double())
    assert rel_err(parts[0] + parts[1], moe_reference(x, ids, wts, routed, shared)) <= FEW_TOL


def test_few_tokens_refuse_what_they_cannot_take():
    routed, shared = make_experts(2, 64, 128, 128, DEV)
    x, ids, wts = torch.randn(2, 64, device=DEV).half(), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(ValueError, match="T <= 16"):
        fp8_moe.fp8_moe_experts(torch.randn(17, 64).half(), torch.zeros(17, 1, dtype=torch.int64),
                                torch.ones(17, 1), *routed)
    with pytest.raises(ValueError, match="bfloat16 / float16"):
        fp8_moe.fp8_moe_experts(x.float(), ids, wts, *routed)
    with pytest.raises(ValueError, match="gate_up \\[2, 256, 64\\] float8_e4m3fn"):
        fp8_moe.fp8_moe_experts(x, ids, wts, routed[0].half(), *routed[1:])
    with pytest.raises(ValueError, match="gate_up_scale \\[2, 2, 1\\] float32"):
        fp8_moe.fp8_moe_experts(x, ids, wts, routed[0], routed[1][:, :1].contiguous(), *routed[2:])
    with pytest.raises(ValueError, match="int64"):
        fp8_moe.fp8_moe_experts(x, ids.int(), wts, *routed)
    with pytest.raises(ValueError, match="all given or all None"):
        fp8_moe.fp8_moe_experts(x, ids, wts, *routed, *shared[:2])
    odd, _ = make_experts(2, 64, 96, 0, DEV)
    with pytest.raises(ValueError, match="multiple of 128 .*got 96"):
        fp8_moe.fp8_moe_experts(x, ids, wts, *odd)
    assert fp8_moe.fp8_moe_experts(x[:0], ids[:0], wts[:0], *routed).shape == (0, 64)


def test_quantize_rows_matches_torch():
    """Per row and 128 columns, amax / 448, e4m3 to nearest even (runtime.model.quantized.quantize_fp8 with a
    (1, 128) block computes the same float32 quotients); an all-zero group gives zeros, not NaN."""
    torch.manual_seed(1)
    x = torch.randn(37, 300, device=DEV) * torch.logspace(-3, 3, 300, device=DEV)
    x[5, 128:256] = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xd = x.to(dtype)
        q, s = fp8_moe.quantize_rows_fp8(xd)
        qr, sr = quantize_fp8(xd.float(), (1, 128))
        assert torch.equal(s[s > 1e-12], sr[s > 1e-12]) and not torch.isnan(q.float()).any()
        assert torch.equal(q.float(), qr.float()), dtype
        assert torch.equal(q[5, 128:256].float(), torch.zeros(128, device=DEV))


@pytest.mark.parametrize("t", [17, 129])
def test_grouped_matches_float64(t):
    errs = check_grouped(t, 6, 200, 128, 3, torch.float16, DEV)
    assert errs[1] > 1e-3  # the activations really are e4m3 (W8A8), not 16-bit


def check_grouped_w8a16(t, e, d, i, k, dtype, dev, ids=None):
    """W8A16 (``model.fp8_compute=w8a16``): the 16-bit rows times the widened weights, no e4m3 activations, so
    the error against float64 is the 16-bit rounding of h and of the output, several times below W8A8's."""
    torch.manual_seed(t + e + d)
    x, ids, wts, routed, xs, order, offsets = grouped_inputs(t, e, d, i, k, dtype, dev, ids)
    ref = moe_reference(x, ids, wts, routed, (None,))
    errs = []
    n = int(offsets[-1])
    for w8a8 in (False, True):
        y = fp8_moe.fp8_grouped_expert_mlp(xs, *routed, offsets, swiglu, w8a8=w8a8)
        assert y.dtype == dtype and y.shape == xs.shape
        yg = fp8_moe.fp8_grouped_expert_mlp(x, *routed, offsets, swiglu, w8a8=w8a8, tokens=order // ids.shape[1])
        assert torch.equal(yg[:n], y[:n]), w8a8
        errs.append(rel_err(combine(y, order, ids, wts, offsets).to(dtype), ref))
    assert errs[0] <= EMULATED_TOL[dtype] and errs[0] * 4 < errs[1], errs
    return errs


@pytest.mark.parametrize("t", [17, 40])
def test_grouped_w8a16_matches_float64(t):
    check_grouped_w8a16(t, 6, 200, 128, 3, torch.float16, DEV)


def test_grouped_w8a16_refuses_fp8_rows_without_scales():
    routed, _ = make_experts(2, 64, 128, 0, DEV)
    q, _ = fp8_moe.quantize_rows_fp8(torch.randn(4, 64, device=DEV))
    with pytest.raises(ValueError, match="bfloat16 / float16 \\(W8A16: a_scale None\\)"):
        fp8_moe.fp8_grouped_gemm(q, None, routed[0], routed[1], torch.tensor([1, 4], dtype=torch.int32),
                                 torch.float16)


def test_grouped_odd_width_empty_and_single_expert():
    """D = 199; expert 2 takes every routed pair (experts 0, 1, 3 have none), other ranks' pairs (id 4) sorted
    last and left out; I 256 with 16 x 64 tiles."""
    t, k = 20, 2
    ids = torch.tensor([[2, 4]] * t, device=DEV)
    check_grouped(t, 4, 199, 128, k, torch.float16, DEV, ids=ids)
    check_grouped(t, 4, 199, 256, k, torch.float16, DEV, fp8_moe.GroupedConfig(block_m=16, block_n=64, group_m=3))


def test_grouped_tma_weight_tiles_give_the_same_bits():
    """The weight tiles by TMA (B as [E * N, K]: an expert's tile past N reads the next expert's rows, the last
    expert's zeros) at N 96 with 64-column tiles, uneven groups, an empty expert: the pointer loads' bits, both
    activation kinds; K not a multiple of 16 is refused."""
    torch.manual_seed(3)
    counts = torch.tensor([5, 0, 19, 2], device=DEV)
    offsets = counts.cumsum(0).to(torch.int32)
    w, ws = _quantize(torch.randn(4, 96, 256, device=DEV))
    a = torch.randn(int(counts.sum()), 256, device=DEV).half()
    q, s = fp8_moe.quantize_rows_fp8(a)
    for x, xs in ((q, s), (a, None)):
        outs = [fp8_moe.fp8_grouped_gemm(x, xs, w, ws, offsets, torch.float32, fp8_moe.GroupedConfig(16, 64, 2,
                                                                                                     tma=tma))
                for tma in (False, True)]
        assert torch.equal(outs[0], outs[1])
    w, ws = _quantize(torch.randn(4, 96, 200, device=DEV))
    with pytest.raises(ValueError, match="K a multiple of 16"):
        fp8_moe.fp8_grouped_gemm(a[:, :200].contiguous(), None, w, ws, offsets, torch.float32,
                                 fp8_moe.GroupedConfig(tma=True))


def test_grouped_tile_lookup_covers_every_row():
    """Uneven groups (0, 1, 33, 64, 2 rows) with 16-row tiles: every row of every expert is written once."""
    torch.manual_seed(2)
    counts = torch.tensor([0, 1, 33, 64, 2], device=DEV)
    offsets = counts.cumsum(0).to(torch.int32)
    rows, e, n, kd = int(counts.sum()), 5, 64, 128
    w, ws = _quantize(torch.randn(e, n, kd, device=DEV))
    a = torch.randn(rows, kd, device=DEV)
    q, s = fp8_moe.quantize_rows_fp8(a)
    out = fp8_moe.fp8_grouped_gemm(q, s, w, ws, offsets, torch.float32, fp8_moe.GroupedConfig(16, 32, 2))
    a64 = dequantize_fp8(q, s, torch.float64, block=(1, 128))
    expert = torch.repeat_interleave(torch.arange(e, device=DEV), counts)
    ref = torch.stack([_dequantize(w[j], ws[j]) @ a64[r] for r, j in enumerate(expert.tolist())])
    assert rel_err(out, ref) <= 1e-6


def test_grouped_refuses_what_it_cannot_take():
    routed, _ = make_experts(2, 64, 128, 0, DEV)
    xs, offs = torch.randn(4, 64, device=DEV).half(), torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="offsets \\[E = 2\\] int32"):
        fp8_moe.fp8_grouped_expert_mlp(xs, *routed, offs.long(), swiglu)
    with pytest.raises(ValueError, match="down \\[2, 64, 128\\] float8_e4m3fn"):
        fp8_moe.fp8_grouped_expert_mlp(xs, *routed[:2], routed[2].half(), routed[3], offs, swiglu)
    with pytest.raises(ValueError, match="a \\[rows, K = 64\\]"):
        fp8_moe.fp8_grouped_expert_mlp(torch.randn(4, 65).half(), *routed, offs, swiglu)
    assert fp8_moe.fp8_grouped_expert_mlp(xs[:0], *routed, torch.zeros(2, dtype=torch.int32), swiglu).shape == (0, 64)


# ---------------------------------------------------------------------------------------- GPU (real widths)
D_V3 = 7168
REAL = [pytest.param(256, 256, 256, id="moe=tp"), pytest.param(32, 2048, 2048, id="moe=ep")]


@pytest.mark.gpu
@pytest.mark.parametrize("e,i,i_s", REAL)
@pytest.mark.parametrize("t", [1, 16])
def test_gpu_few_tokens_real_widths(e, i, i_s, t):
    needs_gpu()
    check_few(t, e, D_V3, i, i_s, 8, torch.bfloat16, "cuda", 1e-2)
    check_few(t, e, D_V3, i, i_s, 8, torch.bfloat16, "cuda", 1e-2, fp8_moe.Fp8ExpertConfig(16, 4, 32, fma=True,
                                                                                          down_sub_i=2))


@pytest.mark.gpu
@pytest.mark.parametrize("e,i,i_s", REAL)
@pytest.mark.parametrize("t", [17, 512])
def test_gpu_grouped_real_widths(e, i, i_s, t):
    needs_gpu()
    check_grouped(t, e, D_V3, i, 8, torch.bfloat16, "cuda")
    check_grouped_w8a16(t, e, D_V3, i, 8, torch.bfloat16, "cuda")


@pytest.mark.gpu
def test_gpu_quantize_cast_matches_torch():
    """The GPU's own float32 -> e4m3 cast (no pre-rounding) against torch's."""
    needs_gpu()
    torch.manual_seed(4)
    x = (torch.randn(64, 1000, device="cuda") * torch.logspace(-4, 4, 1000, device="cuda")).bfloat16()
    q, s = fp8_moe.quantize_rows_fp8(x)
    qr, sr = quantize_fp8(x.float(), (1, 128))
    assert torch.equal(s, sr) and torch.equal(q.float(), qr.float())


@pytest.mark.gpu
def test_gpu_graph_replays_equal_eager():
    """Both paths captured in one CUDA graph (no host sync, no allocation outside the pool) give the eager bits,
    with the routing changed in place between replays."""
    needs_gpu()
    from triton_env import capture_graph

    torch.manual_seed(5)
    e, d, i, k, t = 32, 1024, 256, 8, 64
    routed, shared = make_experts(e, d, i, 256, "cuda")
    x = torch.randn(t, d, device="cuda").bfloat16()
    ids = random_ids(t, k, e, "cuda")
    wts = torch.rand(t, k, device="cuda")
    flat = ids.reshape(-1)
    outs = {}

    def step():
        outs["few"] = fp8_moe.fp8_moe_experts(x[:8], ids[:8], wts[:8], *routed, *shared, pdl=True)
        order, counts = sort_by_expert(flat, e + 1)
        outs["grouped"] = fp8_moe.fp8_grouped_expert_mlp(x[order // k], *routed, counts[:e].cumsum(0).to(
            torch.int32), swiglu)

    graph = capture_graph(step)
    replayed = dict(outs)  # the graph's output tensors
    for _ in range(3):
        ids.copy_(random_ids(t, k, e, "cuda"))
        step()
        graph.replay()
        torch.cuda.synchronize()
        n = int((ids < e).sum())
        assert torch.equal(replayed["few"], outs["few"])
        assert torch.equal(replayed["grouped"][:n], outs["grouped"][:n])
