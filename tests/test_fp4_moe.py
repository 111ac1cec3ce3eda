"""The fp4 MoE expert kernels (backends/kernels/gemm/fp4_moe.py, DeepSeek-V4's packed e2m1 experts): the few-token
decode path, the W4A16 grouped path, and ``routed_expert_sum``'s use of them, against float64 references built from
``PackedFP4.dequantize``.

CPU: Triton's interpreter at tiny widths, in float16 (the interpreter's ``tl.dot`` is wrong for bfloat16; e2m1 times
a power-of-two scale is exact in float16 at these scales). Odd shapes: D 96 (a partial 128-input tile), I 48
(partial row / column tiles and a partial last scale group of the down projection), experts with no tokens, one
expert for every token, other ranks' experts. Scales as ``PackedFP4`` holds them (ue8m0 bytes); float32 scales of the
same values give the same bits. ``gpu`` tests: DeepSeek-V4-Flash widths (D 4096, I 2048 cut by tp 2 / 8, and
moe=ep's 32 whole experts) in bf16, CUDA-graph replays equal eager runs.

Tolerances (relative Frobenius error, float16, measured on the interpreter, bound about 3x the measurement): decode
and grouped vs float64 on the dequantized weights 4-7e-4 -> 2e-3 (the 16-bit roundings of h; the weights are exact).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton_env import DEV, needs_gpu, rel_err

from backends.kernels.gemm import fp4_moe
from backends.kernels.gemm import fp4_moe_kernels as kernels
from runtime.model.deepseek import moe as ds_moe
from runtime.model.deepseek.mlp import swiglu as v3_swiglu
from runtime.model.deepseek.moe import GatedAct, routed_expert_sum, sort_by_expert
from runtime.model.dsv4.moe import swiglu as v4_swiglu
from runtime.model.quantized import PackedFP4, scale_values

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 2e-3
SMALL = fp4_moe.Fp4ExpertConfig(up_block_i=64, up_block_k=128, down_block_d=64, down_block_i=64)
SMALL_FMA = fp4_moe.Fp4ExpertConfig(up_block_i=64, up_block_k=128, down_block_d=64, down_block_i=64, fma=True)
FEW_CONFIGS = [pytest.param(SMALL, id="tensor-cores"), pytest.param(SMALL_FMA, id="cuda-cores")]
GSMALL = fp4_moe.GroupedConfig(block_n=64, block_k=64, group_m=2, num_warps=4)
LIMITS = [pytest.param(None, id="silu"), pytest.param(0.6, id="clamped")]  # 0.6: the clamps bite at these scales


def make_experts(e: int, d: int, i: int, dev) -> tuple[PackedFP4, PackedFP4]:
    """Packed fp4 gate_up [e, 2i, d] and down [e, d, i] from random weights (the release's quantization)."""
    return (PackedFP4.quantize(torch.randn(e, 2 * i, d, device=dev) / d**0.5),
            PackedFP4.quantize(torch.randn(e, d, i, device=dev) / i**0.5))


def args(gu: PackedFP4, dn: PackedFP4) -> tuple[torch.Tensor, ...]:
    return gu.weight, gu.scale, dn.weight, dn.scale


def reference(x, ids, wts, gu, dn, limit):
    """float64 on the dequantized weights: the routed experts' weighted sum; ids == E: other ranks' experts (add 0).
    Only the experts the ids use are dequantized (256 experts of V4's widths in float64 are tens of GB)."""
    e = gu.weight.shape[0]
    used = sorted(set(ids[ids < e].tolist()))
    remap = torch.full((e + 1,), len(used), dtype=torch.int64, device=ids.device)
    remap[torch.tensor(used, dtype=torch.int64, device=ids.device)] = torch.arange(len(used), device=ids.device)

    def deq(w):
        return torch.stack([w[j].dequantize(torch.float64) for j in used]) if used else \
            torch.zeros(0, *w.shape[1:], dtype=torch.float64, device=x.device)
    return routed_expert_sum(x.double(), wts.double(), remap[ids], deq(gu), deq(dn), 0, len(used) + 1,
                             GatedAct(limit), False, torch.float64)


def rows_reference(xs, offsets, gu, dn, limit):
    """float64, per expert over its rows of xs (grouped), rows past offsets[-1] zero; each expert dequantized on
    its own."""
    out = torch.zeros(xs.shape[0], dn.shape[1], dtype=torch.float64, device=xs.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            g64, d64 = gu[e].dequantize(torch.float64), dn[e].dequantize(torch.float64)
            out[start:end] = F.linear(GatedAct(limit)(F.linear(xs[start:end].double(), g64)), d64)
        start = end
    return out


def random_ids(t, k, n_local, dev, other=True):
    """[t, k] distinct local ids per token; with ``other``, about one pair in five is another rank's (n_local)."""
    ids = torch.stack([torch.randperm(n_local, device=dev)[:k] for _ in range(t)])
    if other:
        ids = torch.where(torch.rand(t, k, device=dev) < 0.2, n_local, ids)
    return ids.contiguous()


def check_few(t, e, d, i, k, limit, dtype, dev, tol, config=None, ids=None, more=False):
    """The float32 weighted sum against float64; ``more``: also the rounded output and token 0 alone."""
    torch.manual_seed(t * 100 + d + i)
    gu, dn = make_experts(e, d, i, dev)
    x = torch.randn(t, d, device=dev).to(dtype)
    ids = random_ids(t, k, e, dev) if ids is None else ids
    wts = torch.rand(t, k, device=dev)
    out = fp4_moe.fp4_moe_experts(x, ids, wts, *args(gu, dn), limit, out_dtype=torch.float32, config=config)
    assert out.dtype == torch.float32 and out.shape == (t, d)
    ref = reference(x, ids, wts, gu, dn, limit)
    err = rel_err(out, ref)
    assert err <= tol, err
    if more:
        rounded = fp4_moe.fp4_moe_experts(x, ids, wts, *args(gu, dn), limit, config=config)
        assert rounded.dtype == dtype and torch.equal(rounded, out.to(dtype))
        one = fp4_moe.fp4_moe_experts(x[:1], ids[:1], wts[:1], *args(gu, dn), limit, out_dtype=torch.float32,
                                      config=config)
        assert torch.equal(one, out[:1]), "token 0 alone: not the bits of the whole batch"
    return err


# ---------------------------------------------------------------------------------------- CPU (interpreter)
def test_widening_is_exact_for_every_byte_and_scale():
    """Every byte (both nibbles, -0 included) times powers of two from 2^-20 to 2^10, as float32 scales and as
    ue8m0 bytes: the grouped GEMM against an identity activation gives the dequantized weight back bit for bit."""
    torch.manual_seed(0)
    w = torch.arange(256, dtype=torch.uint8, device=DEV).view(1, 8, 32)  # [E 1, N 8, K 64 / 2]
    exps = torch.randint(-20, 11, (1, 8, 2), device=DEV)
    a = torch.eye(64, device=DEV).half()
    for s in (exps.float().exp2(), (exps + 127).to(torch.uint8)):
        out = fp4_moe.fp4_grouped_gemm(a, w, s, torch.tensor([64], dtype=torch.int32, device=DEV),
                                       config=fp4_moe.GroupedConfig(16, 16, 64))
        assert torch.equal(out.float(), PackedFP4(w, s).dequantize(torch.float32)[0].T), s.dtype


@triton.jit
def _ue8m0_probe(S, OUT, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(OUT + i, kernels._ue8m0(tl.load(S + i), True))


def test_ue8m0_bytes_widen_to_the_values_of_scale_values():
    """Every byte 0 .. 255 (0: the subnormal 2^-127, 255: inf) -> the float32 bits ``scale_values`` gives."""
    b = torch.arange(256, dtype=torch.uint8, device=DEV)
    out = torch.empty(256, dtype=torch.float32, device=DEV)
    _ue8m0_probe[(1,)](b, out, N=256)
    assert torch.equal(out.view(torch.int32), scale_values(b).view(torch.int32))


def test_ue8m0_scales_give_the_float32_scales_bits():
    """Both paths with the scales as ue8m0 bytes (as PackedFP4 holds them), as float32 values, and mixed (gate_up
    bytes, down float32): the same bits."""
    torch.manual_seed(3)
    t, e, d, i, k = 3, 3, 96, 48, 2
    gu, dn = make_experts(e, d, i, DEV)
    assert gu.scale.dtype == dn.scale.dtype == torch.uint8
    gu32, dn32 = (PackedFP4(w.weight, scale_values(w.scale)) for w in (gu, dn))
    x, ids, wts = torch.randn(t, d, device=DEV).half(), random_ids(t, k, e, DEV), torch.rand(t, k, device=DEV)
    few = [fp4_moe.fp4_moe_experts(x, ids, wts, *args(g, n), 0.6, out_dtype=torch.float32, config=SMALL)
           for g, n in ((gu, dn), (gu32, dn32), (gu, dn32))]
    assert torch.equal(few[0], few[1]) and torch.equal(few[0], few[2])
    xs, offsets = torch.randn(17, d, device=DEV).half(), torch.tensor([5, 5, 17], dtype=torch.int32, device=DEV)
    grouped = [fp4_moe.fp4_grouped_expert_mlp(xs, *args(g, n), offsets, limit=0.6, config=GSMALL)
               for g, n in ((gu, dn), (gu32, dn32))]
    assert torch.equal(grouped[0], grouped[1])


@pytest.mark.parametrize("config", FEW_CONFIGS)
@pytest.mark.parametrize("t,limit", [(1, None), (1, 0.6), (3, 0.6), (16, None)])
def test_few_tokens_match_float64(t, limit, config):
    """D 96 (a partial 128-input step and a partial 64-row down tile), I 48 (a partial 64-row up tile and a partial
    last scale group in down); the tensor-core and the CUDA-core kernels."""
    check_few(t, 5, 96, 48, 2, limit, torch.float16, DEV, TOL, config, more=t == 3)


def test_few_tokens_default_config_whole_groups():
    """The default tiles (clipped to the widths), I 64: whole scale groups in both matrices; 20 tokens on the
    CUDA-core kernels (past the tensor-core kernels' 16; bigger tiles: the interpreter pays per program)."""
    check_few(2, 4, 160, 64, 2, 10.0, torch.float16, DEV, TOL)
    check_few(20, 4, 160, 64, 2, 10.0, torch.float16, DEV, TOL, SMALL_FMA)


def test_widths_that_are_not_whole_words_take_the_tensor_core_kernels():
    """D 100 (12.5 words): the default is the tensor-core kernels (up to 16 tokens); the CUDA-core ones refuse."""
    assert fp4_moe.few_tokens_max(100, 48) == fp4_moe.MAX_TOKENS and fp4_moe.few_tokens_max(96, 48) == 64
    assert not fp4_moe.fma_config(48, 100).fma and fp4_moe.fma_config(48, 96).fma
    check_few(3, 3, 100, 48, 2, 0.6, torch.float16, DEV, TOL)
    with pytest.raises(ValueError, match="fma=True\\) reads whole 32-bit words"):
        check_few(3, 3, 100, 48, 2, 0.6, torch.float16, DEV, TOL, SMALL_FMA)


@pytest.mark.parametrize("config", FEW_CONFIGS)
def test_few_tokens_one_expert_for_all_and_other_ranks_add_zero(config):
    t, e, d, i, k = 4, 3, 96, 48, 2
    every = torch.tensor([[1, 3]] * t, device=DEV)  # expert 1 takes every token (0, 2 none); slot 1 another rank's
    check_few(t, e, d, i, k, 0.6, torch.float16, DEV, TOL, config, every)
    gu, dn = make_experts(e, d, i, DEV)
    nobody = torch.full((t, k), e, device=DEV)  # every pair on other ranks: exactly 0
    out = fp4_moe.fp4_moe_experts(torch.randn(t, d, device=DEV).half(), nobody, torch.rand(t, k, device=DEV),
                                  *args(gu, dn), config=config)
    assert torch.equal(out, torch.zeros_like(out))


def test_few_tokens_refuse_what_they_cannot_take():
    gu, dn = make_experts(2, 64, 32, DEV)
    x, ids, wts = torch.randn(2, 64, device=DEV).half(), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(ValueError, match="T <= 64"):
        fp4_moe.fp4_moe_experts(torch.randn(65, 64).half(), torch.zeros(65, 1, dtype=torch.int64),
                                torch.ones(65, 1), *args(gu, dn))
    with pytest.raises(ValueError, match="T <= 16"):
        fp4_moe.fp4_moe_experts(torch.randn(17, 64).half(), torch.zeros(17, 1, dtype=torch.int64),
                                torch.ones(17, 1), *args(gu, dn), config=fp4_moe.Fp4ExpertConfig())
    with pytest.raises(ValueError, match="bfloat16 / float16"):
        fp4_moe.fp4_moe_experts(x.float(), ids, wts, *args(gu, dn))
    with pytest.raises(ValueError, match="gate_up \\[2, 64, 32\\] uint8"):
        fp4_moe.fp4_moe_experts(x, ids, wts, gu.weight.view(torch.int8), *args(gu, dn)[1:])
    with pytest.raises(ValueError, match="gate_up_scale \\[2, 64, 2\\] uint8 \\(ue8m0 bytes\\) or float32"):
        fp4_moe.fp4_moe_experts(x, ids, wts, gu.weight, gu.scale[..., :1].contiguous(), dn.weight, dn.scale)
    with pytest.raises(ValueError, match="down_scale .* got \\(\\(2, 64, 1\\), 'bfloat16'\\)"):
        fp4_moe.fp4_moe_experts(x, ids, wts, gu.weight, gu.scale, dn.weight, scale_values(dn.scale).bfloat16())
    with pytest.raises(ValueError, match="int64"):
        fp4_moe.fp4_moe_experts(x, ids.int(), wts, *args(gu, dn))
    with pytest.raises(ValueError, match="positive float"):
        fp4_moe.fp4_moe_experts(x, ids, wts, *args(gu, dn), limit=-1.0)
    assert fp4_moe.fp4_moe_experts(x[:0], ids[:0], wts[:0], *args(gu, dn)).shape == (0, 64)


def grouped_case(rows_per_expert, d, i, dev):
    """xs [rows, d] grouped by expert and the int32 inclusive offsets of ``rows_per_expert``."""
    e = len(rows_per_expert)
    gu, dn = make_experts(e, d, i, dev)
    counts = torch.tensor(rows_per_expert, device=dev)
    xs = torch.randn(int(counts.sum()), d, device=dev).half()
    return xs, counts.cumsum(0).to(torch.int32), gu, dn


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("counts", [[0, 1, 0], [5, 0, 12, 0], [0, 40, 1, 88]], ids=["M1", "M17", "M129"])
def test_grouped_matches_float64(counts, limit):
    """M = 1, 17, 129 rows over experts with no rows; D 96 (a partial k step), I 48 (partial column tiles and a
    partial last scale group); the activation fused, and as the contract's callable."""
    torch.manual_seed(sum(counts))
    xs, offsets, gu, dn = grouped_case(counts, 96, 48, DEV)
    ref = rows_reference(xs, offsets, gu, dn, limit)
    fused = fp4_moe.fp4_grouped_expert_mlp(xs, *args(gu, dn), offsets, limit=limit, config=GSMALL)
    assert fused.dtype == torch.float16 and fused.shape == xs.shape
    assert rel_err(fused, ref) <= TOL
    called = fp4_moe.fp4_grouped_expert_mlp(xs, *args(gu, dn), offsets, GatedAct(limit), config=GSMALL)
    assert rel_err(called, fused) <= 1e-3  # the same rounding points; torch's SiLU differs in a few last bits


def test_grouped_skips_rows_past_the_last_offset_and_default_tiles():
    """Other ranks' pairs sorted last (past offsets[-1]) are never read nor written; default tiles."""
    torch.manual_seed(1)
    xs, offsets, gu, dn = grouped_case([3, 0, 30], 64, 64, DEV)
    xs = torch.cat([xs, torch.full((5, 64), float("nan"), device=DEV).half()])
    y = fp4_moe.fp4_grouped_expert_mlp(xs, *args(gu, dn), offsets, limit=10.0)
    n = int(offsets[-1])
    assert rel_err(y[:n], rows_reference(xs[:n], offsets, gu, dn, 10.0)[:n]) <= TOL


def test_grouped_refuses_what_it_cannot_take():
    gu, dn = make_experts(2, 64, 32, DEV)
    xs, offs = torch.randn(4, 64, device=DEV).half(), torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="offsets \\[E = 2\\] int32"):
        fp4_moe.fp4_grouped_expert_mlp(xs, *args(gu, dn), offs.long())
    with pytest.raises(ValueError, match="down \\[2, 64, 16\\] uint8"):
        fp4_moe.fp4_grouped_expert_mlp(xs, gu.weight, gu.scale, dn.weight.int(), dn.scale, offs)
    with pytest.raises(ValueError, match="a \\[rows, K = 64\\]"):
        fp4_moe.fp4_grouped_expert_mlp(torch.randn(4, 66).half(), *args(gu, dn), offs)
    with pytest.raises(ValueError, match="even and positive"):
        fp4_moe.fp4_moe_experts(xs[:2, :63], torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), *args(gu, dn))
    with pytest.raises(ValueError, match="down's rows D = 64"):
        fp4_moe.fp4_grouped_expert_mlp(xs, *args(gu, dn)[:2], dn.weight[:, :32], dn.scale[:, :32], offs)
    assert fp4_moe.fp4_grouped_expert_mlp(xs[:0], *args(gu, dn), torch.zeros(2, dtype=torch.int32)).shape == (0, 64)


MX_FEW = fp4_moe.Fp4ExpertConfig(up_block_i=32, up_block_k=128, down_block_d=32, down_block_i=64, mx=True)
MX_GROUPED = [pytest.param(fp4_moe.GroupedConfig(16, 64, 64, 2, 4, mx=True), id="16-rows"),
              pytest.param(fp4_moe.GroupedConfig(64, 32, 64, 2, 4, mx=True), id="64-rows")]
TOL_BF16_INTERP = 2.5e-2  # the interpreter truncates to bf16 (measured 1.5e-2, the CUDA-core kernels' own)


def test_microscaled_few_tokens_match_float64_and_the_cuda_core_kernels():
    """``Fp4ExpertConfig(mx=True)`` (``tl.dot_scaled``, bf16 only) on the odd widths, other ranks' pairs included:
    within the interpreter's bf16 error of float64, and the CUDA-core kernels' result (same products, float32
    sums)."""
    for t in (1, 3):
        err = check_few(t, 5, 96, 48, 2, 0.6, torch.bfloat16, DEV, TOL_BF16_INTERP, MX_FEW)
        assert err == pytest.approx(check_few(t, 5, 96, 48, 2, 0.6, torch.bfloat16, DEV, 1.0, SMALL_FMA), rel=0.05)
    with pytest.raises(ValueError, match="mx=True\\) takes bfloat16"):
        check_few(1, 5, 96, 48, 2, 0.6, torch.float16, DEV, 1.0, MX_FEW)


@pytest.mark.parametrize("config", MX_GROUPED)
def test_microscaled_grouped_matches_float64(config):
    """M 1 and 129 over experts with no rows, D 96, I 48, fused clamped SwiGLU; float32 scales (exponent bytes taken
    in the kernel) give the ue8m0 bytes' bits."""
    for counts in ([0, 1, 0], [0, 40, 1, 88]):
        torch.manual_seed(len(counts))
        xs, offsets, gu, dn = grouped_case(counts, 96, 48, DEV)
        xs = xs.bfloat16()
        y = fp4_moe.fp4_grouped_expert_mlp(xs, *args(gu, dn), offsets, limit=0.6, config=config)
        assert y.dtype == torch.bfloat16 and rel_err(y, rows_reference(xs, offsets, gu, dn, 0.6)) <= TOL_BF16_INTERP
    f32 = fp4_moe.fp4_grouped_expert_mlp(xs, gu.weight, scale_values(gu.scale), dn.weight, scale_values(dn.scale),
                                         offsets, limit=0.6, config=config)
    assert torch.equal(f32, y)
    with pytest.raises(ValueError, match="mx=True\\) takes bfloat16"):
        fp4_moe.fp4_grouped_expert_mlp(xs.half(), *args(gu, dn), offsets, config=config)


def test_gated_act_is_the_models_activations_bit_for_bit():
    h = (torch.randn(7, 64) * 8).bfloat16()
    assert torch.equal(GatedAct()(h), v3_swiglu(h))
    assert torch.equal(GatedAct(10.0)(h), v4_swiglu(*h.chunk(2, dim=-1), 10.0))


@pytest.mark.parametrize("t", [3, 65], ids=["decode", "grouped"])
def test_routed_expert_sum_takes_the_kernels(monkeypatch, t):
    """With the CPU admitted as a kernel device, ``routed_expert_sum`` on packed fp4 stacks runs the kernels (not
    the per-expert loop and its host sync), under expert parallelism (experts 2.. of 8 held, others
    add 0), and matches both float64 and the torch loop it replaces."""
    torch.manual_seed(t)
    e, first, n_experts, d, i, k = 4, 2, 8, 96, 48, 3
    gu, dn = make_experts(e, d, i, DEV)
    x = torch.randn(t, d, device=DEV).half()
    ids = torch.stack([torch.randperm(n_experts, device=DEV)[:k] for _ in range(t)])
    wts = torch.rand(t, k, device=DEV).half()  # V4's routing weights are in x's dtype
    act = GatedAct(0.6)
    loop = routed_expert_sum(x, wts, ids, gu, dn, first, n_experts, act, False, torch.float32)
    calls = []
    for name in ("fp4_moe_experts", "fp4_grouped_expert_mlp"):
        real = getattr(fp4_moe, name)
        monkeypatch.setattr(fp4_moe, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    monkeypatch.setattr(ds_moe, "FP4_KERNEL_DEVICES", ("cuda", "cpu"))
    out = routed_expert_sum(x, wts, ids, gu, dn, first, n_experts, act, False, torch.float32)
    monkeypatch.undo()
    assert calls == ["fp4_moe_experts" if t <= fp4_moe.FMA_MAX_TOKENS else "fp4_grouped_expert_mlp"]
    assert out.dtype == torch.float32
    local = torch.where((ids >= first) & (ids < first + e), ids - first, e)
    ref = reference(x, local, wts.float(), gu, dn, 0.6)
    assert rel_err(out, ref) <= TOL and rel_err(loop, ref) <= TOL


# ---------------------------------------------------------------------------------------- GPU (real widths)
D_V4, I_V4, TOP_K = 4096, 2048, 6
REAL = [pytest.param(256, I_V4 // 2, id="tp2"), pytest.param(256, I_V4 // 8, id="tp8"),
        pytest.param(32, I_V4, id="ep8")]


@pytest.mark.gpu
@pytest.mark.parametrize("e,i", REAL)
@pytest.mark.parametrize("t", [1, 16])
@pytest.mark.parametrize("config", [pytest.param(None, id="default"),
                                    pytest.param(fp4_moe.Fp4ExpertConfig(), id="tensor-cores"),
                                    pytest.param(fp4_moe.Fp4ExpertConfig(32, 256, 32, 256, mx=True), id="mx")])
def test_gpu_few_tokens_real_widths(e, i, t, config):
    needs_gpu()
    check_few(t, e, D_V4, i, TOP_K, 10.0, torch.bfloat16, "cuda", 1e-2, config, more=t == 16)


@pytest.mark.gpu
@pytest.mark.parametrize("e,i", REAL)
@pytest.mark.parametrize("t", [17, 512])
@pytest.mark.parametrize("config", [pytest.param(None, id="default"),
                                    pytest.param(fp4_moe.GroupedConfig(32, 64, 256, num_warps=4, mx=True), id="mx"),
                                    pytest.param(fp4_moe.GroupedConfig(128, 128, 128, mx=True), id="mx-128")])
def test_gpu_grouped_real_widths(e, i, t, config):
    needs_gpu()
    torch.manual_seed(t)
    gu, dn = make_experts(e, D_V4, i, "cuda")
    x = torch.randn(t, D_V4, device="cuda").bfloat16()
    ids = random_ids(t, TOP_K, e, "cuda")
    order, counts = sort_by_expert(ids.reshape(-1), e + 1)
    offsets = counts[:e].cumsum(0).to(torch.int32)
    xs = x[order // TOP_K]
    y = fp4_moe.fp4_grouped_expert_mlp(xs, *args(gu, dn), offsets, limit=10.0, config=config)
    n = int(offsets[-1])
    assert rel_err(y[:n], rows_reference(xs, offsets, gu, dn, 10.0)[:n]) <= 1e-2


@pytest.mark.gpu
def test_gpu_graph_replays_equal_eager():
    """Both paths captured in one CUDA graph (no host sync, no allocation outside the pool) give the eager bits,
    with the routing changed in place between replays."""
    needs_gpu()
    from triton_env import capture_graph

    torch.manual_seed(5)
    e, d, i, t = 32, 1024, 256, 64
    gu, dn = make_experts(e, d, i, "cuda")
    x = torch.randn(t, d, device="cuda").bfloat16()
    ids = random_ids(t, TOP_K, e, "cuda")
    wts = torch.rand(t, TOP_K, device="cuda")
    outs = {}

    def step():
        outs["few"] = fp4_moe.fp4_moe_experts(x[:8], ids[:8], wts[:8], *args(gu, dn), 10.0, pdl=True)
        order, counts = sort_by_expert(ids.reshape(-1), e + 1)
        outs["grouped"] = fp4_moe.fp4_grouped_expert_mlp(x[order // TOP_K], *args(gu, dn),
                                                         counts[:e].cumsum(0).to(torch.int32), limit=10.0)

    graph = capture_graph(step)
    replayed = dict(outs)
    for _ in range(3):
        ids.copy_(random_ids(t, TOP_K, e, "cuda"))
        step()
        graph.replay()
        torch.cuda.synchronize()
        n = int((ids < e).sum())
        assert torch.equal(replayed["few"], outs["few"])
        assert torch.equal(replayed["grouped"][:n], outs["grouped"][:n])
