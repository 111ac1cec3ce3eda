"""The few-row product kernels (backends/kernels/gemm/skinny.py) and their use by FusedOps (``model.gemv_rows``).

CPU: Triton's interpreter at small odd sizes, float32 and float16 (its ``tl.dot`` gives garbage for bfloat16, so
bf16 runs only in the ``gpu`` tests, at DeepSeek-V3 TP8 sizes). Every case against float64; row independence is
checked bit for bit (a CUDA graph padded to more rows must give the eager run's bits).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEV, needs_gpu, rel_err

from backends.kernels.gemm import skinny
from runtime.model.deepseek.mlp import swiglu
from runtime.model.deepseek.moe import routed_expert_sum
from runtime.model.deepseek.ops import GEMV_MAX_ROWS, FusedOps, TorchOps
from runtime.model.deepseek.weights import DenseMLPWeights, MoEWeights
from runtime.model.layers import rms_norm


def check_linear(n, kd, rows, dtype, dev, tol, config=None) -> torch.Tensor:
    w = torch.randn(n, kd, dtype=dtype, device=dev) / kd**0.5
    x = torch.randn(max(rows), kd, dtype=dtype, device=dev)
    ref = F.linear(x.double(), w.double())
    full = skinny.linear(x, w, config)
    assert full.dtype == dtype and full.shape == (max(rows), n)
    assert rel_err(full, ref) <= tol
    for m in rows:  # each row as the full call computed it, whatever the row count
        assert torch.equal(skinny.linear(x[:m], w, config), full[:m]), f"rows {m}: not the {max(rows)}-row bits"
    return full


def check_head_linear(h, kd, n, rows, dtype, dev, tol) -> torch.Tensor:
    """Per-head products, x a strided view (as q_nope of q): float64 bmm, and each row's bits whatever the rows."""
    w = torch.randn(h, kd, n, dtype=dtype, device=dev) / kd**0.5
    x = torch.randn(max(rows), h, kd + 8, dtype=dtype, device=dev)[..., :kd]
    ref = torch.einsum("thk,hkn->thn", x.double(), w.double())
    full = skinny.head_linear(x, w)
    assert full.dtype == dtype and full.shape == (max(rows), h, n)
    assert rel_err(full, ref) <= tol
    for m in rows:
        assert torch.equal(skinny.head_linear(x[:m], w), full[:m]), f"rows {m}: not the {max(rows)}-row bits"
    return full


def check_norm_linear(n, kd, rows, dtype, dev, tol) -> torch.Tensor:
    """RMSNorm inside the linear kernel (x a strided view, as q_a of the qkv_a output): against float64 over the
    torch norm's rounded output, and each row's bits whatever the rows."""
    w = torch.randn(n, kd, dtype=dtype, device=dev) / kd**0.5
    x = torch.randn(max(rows), kd + 24, dtype=dtype, device=dev)[:, :kd] * 3
    g = (torch.rand(kd, device=dev) + 0.5).to(dtype)
    normed = rms_norm(x, g, 1e-6)
    full = skinny.norm_linear(x, g, 1e-6, w)
    assert full.dtype == dtype and full.shape == (max(rows), n)
    assert rel_err(full, F.linear(normed.double(), w.double())) <= tol
    for m in rows:
        assert torch.equal(skinny.norm_linear(x[:m], g, 1e-6, w), full[:m]), f"rows {m}: not the {max(rows)}-row bits"
    return full


def _experts(e, d, i, i_s, dtype, dev):
    gu = torch.randn(e, 2 * i, d, dtype=dtype, device=dev) / d**0.5
    dn = torch.randn(e, d, i, dtype=dtype, device=dev) / i**0.5
    shared = (torch.randn(2 * i_s, d, dtype=dtype, device=dev) / d**0.5,
              torch.randn(d, i_s, dtype=dtype, device=dev) / i_s**0.5) if i_s else (None, None)
    return gu, dn, shared


def moe_reference(x, ids, wts, gu, dn, shared, first=0, n_experts=None):
    """float64: the routed experts' weighted sum (+ the shared experts' MLP)."""
    out = routed_expert_sum(x.double(), wts.double(), ids, gu.double(), dn.double(), first,
                            n_experts or gu.shape[0], swiglu, False, torch.float64)
    if shared[0] is not None:
        out = out + F.linear(swiglu(F.linear(x.double(), shared[0].double())), shared[1].double())
    return out


def check_moe(t, d, e, i, i_s, k, dtype, dev, tol, config=None):
    gu, dn, shared = _experts(e, d, i, i_s, dtype, dev)
    x = torch.randn(t, d, dtype=dtype, device=dev)
    ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
    wts = torch.rand(t, k, device=dev)
    out = skinny.moe_experts(x, ids, wts, gu, dn, *shared, config=config)
    assert out.dtype == dtype and rel_err(out, moe_reference(x, ids, wts, gu, dn, shared)) <= tol
    one = skinny.moe_experts(x[:1], ids[:1], wts[:1], gu, dn, *shared, config=config)
    assert torch.equal(one, out[:1]), "token 0 alone: not the bits of the whole batch"


# ---------------------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("n,kd", [(37, 70), (16, 16), (1, 33), (50, 300)])
def test_linear_matches_float64_and_rows_are_independent(n, kd, dtype, tol):
    torch.manual_seed(n + kd)
    check_linear(n, kd, [1, 7, 16], dtype, DEV, tol, skinny.TileConfig(16, 32))


def test_linear_default_config_and_empty_inputs():
    torch.manual_seed(0)
    check_linear(40, 64, [1, 3], torch.float16, DEV, 2e-3)
    assert skinny.linear(torch.empty(0, 8), torch.randn(5, 8)).shape == (0, 5)
    cpu = torch.device("cpu")  # counted as 132 SMs: 64-row blocks when they give at least 66 programs
    assert skinny.default_config(4608, 7168, cpu) == skinny.TileConfig(64, 256, 4, 4)  # 72 blocks
    assert skinny.default_config(2112, 7168, cpu) == skinny.TileConfig(32, 512, 4, 4)  # 33 blocks of 64
    assert skinny.default_config(40000, 100, cpu) == skinny.TileConfig(64, 128, 4, 4)


def test_linear_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="M <= 16"):
        skinny.linear(torch.randn(17, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="one dtype"):
        skinny.linear(torch.randn(2, 8, dtype=torch.float16), torch.randn(4, 8))


@pytest.mark.parametrize("n,kd", [(37, 70), (16, 1030), (5, 16)])
def test_norm_linear_small(n, kd):
    torch.manual_seed(n * kd)
    check_norm_linear(n, kd, [1, 5, 16], torch.float16, DEV, 3e-3)


def test_norm_linear_refuses_what_it_cannot_take():
    x, w = torch.randn(2, 8, dtype=torch.float16), torch.randn(4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="norm_weight \\[K\\] of x's dtype"):
        skinny.norm_linear(x, torch.ones(8), 1e-6, w)
    with pytest.raises(ValueError, match="one dtype \\(bfloat16, float16\\)"):
        skinny.norm_linear(x.float(), torch.ones(8), 1e-6, w.float())


def test_fused_norm_linear_takes_the_kernel_for_few_rows(monkeypatch):
    """FusedOps.norm_linear: <= gemv_rows float16 rows through skinny.norm_linear, more rows through the norm kernel
    and F.linear, with TorchOps' values."""
    calls = []
    real = skinny.norm_linear
    monkeypatch.setattr(skinny, "norm_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w = torch.randn(24, 40, dtype=torch.float16, device=DEV) / 40**0.5
    g = (torch.rand(40, device=DEV) + 0.5).to(torch.float16)
    for rows, want in [(4, 1), (5, 0)]:
        calls.clear()
        x = torch.randn(rows, 40, dtype=torch.float16, device=DEV)
        y = FusedOps(4).norm_linear(x, g, 1e-6, w)
        assert len(calls) == want and y.shape == (rows, 24)
        assert rel_err(y, TorchOps().norm_linear(x, g, 1e-6, w)) <= 3e-3


def test_linear_f32_is_the_router_product_without_casts():
    torch.manual_seed(1)
    x = torch.randn(3, 70, dtype=torch.float16, device=DEV)
    w = torch.randn(24, 70, device=DEV)
    y = skinny.linear_f32(x, w)
    assert y.dtype == torch.float32
    assert rel_err(y, F.linear(x.double(), w.double())) <= 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 3e-3)])
@pytest.mark.parametrize("t,i,i_s", [(1, 24, 48), (3, 24, 0), (5, 17, 17)])
def test_moe_experts_match_float64(t, i, i_s, dtype, tol):
    torch.manual_seed(t * 10 + i)
    check_moe(t, 40, 6, i, i_s, 2, dtype, DEV, tol, skinny.ExpertConfig(16, 32, 16, 16))


@pytest.mark.parametrize("others", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_moe_experts_expert_parallel_partials_sum_to_the_whole(monkeypatch, dtype, tol, others):
    """parallel.moe=ep: two ranks hold 3 of 6 experts each (other ranks' pairs carry id n_local: the up kernel
    returns at once, the down kernel branches over their slots (``others``) or loads nothing of them, so their
    hidden rows, NaN-filled here, are never read); the shared experts live on rank 0. The partial sums add up to
    the whole MoE (float32 CUDA-core products and 16-bit tensor-core ones)."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    torch.manual_seed(3)
    t, d, e, i, k = 4, 40, 6, 24, 3
    gu, dn, shared = _experts(e, d, i, 24, dtype, DEV)
    x = torch.randn(t, d, device=DEV).to(dtype)
    monkeypatch.setattr(torch, "empty", nan_empty)
    ids = torch.stack([torch.randperm(e, device=DEV)[:k] for _ in range(t)])
    wts = torch.rand(t, k, device=DEV)
    cfg = skinny.ExpertConfig(16, 32, 16, 16)
    parts = []
    for r in range(2):
        local = ids - 3 * r
        local = torch.where((local >= 0) & (local < 3), local, 3).contiguous()
        sh = shared if r == 0 else (None, None)
        parts.append(skinny.moe_experts(x, local, wts, gu[3 * r:3 * r + 3].contiguous(),
                                        dn[3 * r:3 * r + 3].contiguous(), *sh, config=cfg, others=others))
    monkeypatch.undo()
    assert all(torch.isfinite(p).all() for p in parts)
    assert rel_err(parts[0].float() + parts[1].float(), moe_reference(x, ids, wts, gu, dn, shared)) <= tol


def _spec(**kw):
    return SimpleNamespace(**{**dict(num_experts_per_tok=2, n_group=2, topk_group=1, scoring_func="sigmoid",
                                     topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=2.5), **kw})


def _moe_weights(e, d, i, dtype):
    gu, dn, (sgu, sdn) = _experts(e, d, i, i, dtype, DEV)
    return MoEWeights(gate=torch.randn(e, d, device=DEV) / d**0.5, bias=torch.randn(e, device=DEV) * 0.01,
                      gate_up=gu, down=dn, shared=DenseMLPWeights(sgu, sdn))


def test_fused_ops_take_the_few_row_kernels_up_to_gemv_rows(monkeypatch):
    """FusedOps: float16 products of <= gemv_rows rows go through skinny (linear, router, experts), more rows
    and ``gemv_rows=0`` through F.linear and the grouped path; the few-row MoE equals the torch MoE."""
    torch.manual_seed(4)
    calls = []
    for name in ("linear", "linear_f32", "moe_experts"):
        real = getattr(skinny, name)
        monkeypatch.setattr(skinny, name, lambda *a, _n=name, _f=real, **kw: calls.append(_n) or _f(*a, **kw))
    ops, off = FusedOps(4), FusedOps(0)
    w = torch.randn(24, 40, dtype=torch.float16, device=DEV)
    for rows, fn, want in [(4, ops, ["linear"]), (5, ops, []), (1, off, [])]:
        calls.clear()
        x = torch.randn(rows, 40, dtype=torch.float16, device=DEV)
        assert rel_err(fn.linear(x, w), F.linear(x.double(), w.double())) <= 2e-3
        assert calls == want, (rows, calls)
    spec, mw = _spec(), _moe_weights(4, 40, 16, torch.float16)
    x = torch.randn(3, 40, dtype=torch.float16, device=DEV)
    calls.clear()
    out = ops.moe(spec, mw, x, grouped_mm=False)
    assert calls == ["linear_f32", "moe_experts"]
    mw32 = MoEWeights(mw.gate, mw.bias, mw.gate_up.float(), mw.down.float(),
                      DenseMLPWeights(mw.shared.gate_up.float(), mw.shared.down.float()))
    assert rel_err(out, TorchOps().moe(spec, mw32, x.float(), grouped_mm=False)) <= 3e-3


@pytest.mark.parametrize("h,kd,n", [(3, 40, 24), (2, 24, 40), (1, 16, 16), (5, 7, 9)])
def test_head_linear_small(h, kd, n):
    torch.manual_seed(h * kd + n)
    check_head_linear(h, kd, n, [1, 5, 16], torch.float16, DEV, 2e-3)


def test_head_linear_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="x \\[M <= 16, H, K\\] and w \\[H, K, N\\]"):
        skinny.head_linear(torch.randn(17, 2, 8, dtype=torch.float16), torch.randn(2, 8, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="got x \\(1, 2, 8\\) torch.float32"):
        skinny.head_linear(torch.randn(1, 2, 8), torch.randn(2, 8, 4))
    assert skinny.head_linear(torch.empty(0, 2, 8, dtype=torch.float16),
                              torch.randn(2, 8, 4, dtype=torch.float16)).shape == (0, 2, 4)


def test_fused_head_linear_takes_the_kernel_for_few_rows(monkeypatch):
    """FusedOps.head_linear: <= gemv_rows float16 rows through skinny.head_linear, more rows and float32 through the
    batched matmul (TorchOps), with the same values."""
    calls = []
    real = skinny.head_linear
    monkeypatch.setattr(skinny, "head_linear", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w = torch.randn(3, 24, 40, dtype=torch.float16, device=DEV)
    for rows, dtype, want in [(4, torch.float16, 1), (5, torch.float16, 0), (2, torch.float32, 0)]:
        calls.clear()
        x = torch.randn(rows, 3, 24, dtype=dtype, device=DEV)
        y = FusedOps(4).head_linear(x, w.to(dtype))
        assert len(calls) == want and y.shape == (rows, 3, 40)
        assert rel_err(y, TorchOps().head_linear(x.double(), w.double())) <= 2e-3


def test_gemv_rows_is_checked_where_it_is_used():
    assert GEMV_MAX_ROWS == skinny.MAX_ROWS
    with pytest.raises(ValueError, match=r"model.gemv_rows: got 17; expected 0 .. 16"):
        FusedOps(17)


# ---------------------------------------------------------------------------------------- GPU, real sizes
TP8_LINEARS = [(2112, 7168), (3072, 1536), (7168, 2048), (4608, 7168), (7168, 2304), (16160, 7168), (37, 7168)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,kd", TP8_LINEARS)
def test_linear_bf16_gpu(n, kd):
    needs_gpu()
    torch.manual_seed(n)
    check_linear(n, kd, [1, 7, 16], torch.bfloat16, "cuda", 1e-2)


@pytest.mark.gpu
def test_norm_linear_bf16_gpu():
    """q_a_layernorm inside q_b_proj's kernel at TP8 shapes (N 3072, K 1536) and TP1's (N 24576)."""
    needs_gpu()
    torch.manual_seed(3)
    for n in (3072, 24576):
        check_norm_linear(n, 1536, [1, 7, 16], torch.bfloat16, "cuda", 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [16, 128])
def test_head_linear_bf16_gpu(h):
    """The absorbed MLA's per-head products at decode: q_nope [T, H, 128] @ w_uk [H, 128, 512] and o_lat [T, H, 512]
    @ w_uv [H, 512, 128], 1, 7 and 16 rows."""
    needs_gpu()
    torch.manual_seed(h)
    check_head_linear(h, 128, 512, [1, 7, 16], torch.bfloat16, "cuda", 1e-2)
    check_head_linear(h, 512, 128, [1, 7, 16], torch.bfloat16, "cuda", 1e-2)


@pytest.mark.gpu
def test_router_and_moe_bf16_gpu():
    """The router product (bf16 hidden, float32 weights) and the two expert kernels at TP8 shapes (256 experts,
    intermediate 256, top-8, one shared expert), 1, 7 and 16 tokens, and whole experts (intermediate 2048)."""
    needs_gpu()
    torch.manual_seed(7)
    x = torch.randn(7, 7168, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, 7168, device="cuda")
    assert rel_err(skinny.linear_f32(x, w), F.linear(x.double(), w.double())) <= 1e-6
    for t in (1, 7, 16):
        check_moe(t, 7168, 256, 256, 256, 8, torch.bfloat16, "cuda", 1e-2)
    check_moe(3, 7168, 16, 2048, 2048, 8, torch.bfloat16, "cuda", 1e-2)
