"""The fused mHC kernels (backends/kernels/dsv4/hc_mix.py) against their torch reference (runtime/model/mhc.py), and
their use by FusedOps in the V4 decoder layer.

CPU: Triton's interpreter, float32 and float16 streams (the interpreter rounds float32 -> bfloat16 by truncation,
the GPU to nearest, so bf16 runs only on the GPU). The kernels keep torch's float32 operation order; what differs
is the exp inside sigmoid / softmax (numpy's in the interpreter, Sleef's in torch on the CPU), about 1 ulp of float32
in pre / post / comb. Measured on the interpreter over this file's cases, elementwise: post <= 2.0e-7 and comb
<= 7.4e-7 relative; the float32 collapse <= 4.8e-7 absolute (<= 2.7e-7 of sum_j |pre_j s_j|); the float16 collapse
differs in 3 of 11886 elements, by one float16 ulp. Given the same pre, the collapse is bitwise torch's. hc_post:
float16 bitwise torch's; float32 <= 4.8e-7 absolute (the matmul's summation order). The tiny V4 model (float32,
hc_mult 4) through FusedOps vs TorchOps: hidden states within 7.7e-7 relative (Frobenius).

``gpu`` tests: DeepSeek-V4-Flash's mHC (n 4, hidden 4096, 20 Sinkhorn rounds) in bf16 at T 1 and 32 against torch
on the GPU, and CUDA-graph replays equal to eager runs.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, needs_gpu

from backends.kernels.dsv4 import hc_mix as K
from runtime.model import mhc
from runtime.model.deepseek.ops import FusedOps, TorchOps

pytestmark = pytest.mark.usefixtures("one_thread")
EPS = 1e-6  # V4's hc_eps
ULP = {torch.float32: 0.0, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # output rounding, relative bound


def inputs(t: int, n: int, hidden: int, dtype: torch.dtype, dev, seed: int = 0):
    """(mixed [T, 2n + n^2] float32, base, scale [3], streams [T, n, hidden] in dtype), V4-like magnitudes."""
    g = torch.Generator().manual_seed(seed)
    w = 2 * n + n * n
    mixed = torch.randn(t, w, generator=g)
    base = torch.randn(w, generator=g)
    scale = 0.5 + torch.rand(3, generator=g)
    streams = torch.randn(t, n, hidden, generator=g).to(dtype)
    return mixed.to(dev), base.to(dev), scale.to(dev), streams.to(dev)


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest elementwise |out - ref| / |ref| (ref bounded away from 0 here: post > 0, comb > 0)."""
    assert not torch.isnan(out).any()
    return float(((out.double() - ref.double()).abs() / ref.double().abs()).max())


def assert_within(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, f32_rel: float) -> None:
    """|out - ref| <= f32_rel * scale + (one ulp of out's dtype) * |ref|, elementwise (scale: sum of the terms'
    magnitudes, the float32 sum's natural error scale)."""
    assert not torch.isnan(out).any()
    diff = (out.double() - ref.double()).abs()
    bound = f32_rel * scale.double() + ULP[out.dtype] * ref.double().abs()
    assert (diff <= bound).all(), f"max excess {(diff - bound).max().item():.3g}"


def check_mix(t, n, hidden, iters, dtype, dev, pre_rel=1e-6, comb_rel=4e-6, coll_rel=4e-6):
    mixed, base, scale, streams = inputs(t, n, hidden, dtype, dev, seed=t * 100 + n * 10 + iters)
    post, comb, coll = K.hc_mix(mixed, base, scale, streams, iters, EPS)
    post_r, comb_r, coll_r = mhc.hc_mix(mixed, base, scale, streams, iters, EPS)
    assert post.shape == (t, n) and comb.shape == (t, n, n) and coll.shape == (t, hidden)
    assert post.dtype == comb.dtype == torch.float32 and coll.dtype == dtype
    assert max_rel(post, post_r) <= pre_rel
    assert max_rel(comb, comb_r) <= comb_rel
    pre = torch.sigmoid(mixed[:, :n] * scale[0] + base[:n]) + EPS
    assert_within(coll, coll_r, (pre[..., None] * streams.float()).abs().sum(1), coll_rel)
    return post_r, comb_r, streams


def check_post(post, comb, streams, dev, f32_rel=2e-6):
    t, n, hidden = streams.shape
    bo = torch.randn(t, hidden, generator=torch.Generator().manual_seed(7)).to(streams.dtype).to(dev)
    out = K.hc_post(post, comb, bo, streams)
    ref = mhc.hc_post(post, comb, bo, streams)
    assert out.shape == (t, n, hidden) and out.dtype == streams.dtype
    terms = post.abs()[..., None] * bo.float().abs()[:, None] + torch.matmul(comb.abs().mT, streams.float().abs())
    assert_within(out, ref, terms, f32_rel)


@pytest.mark.parametrize("dtype,n,t,hidden,iters", [
    (torch.float32, 4, 17, 77, 20), (torch.float16, 4, 17, 77, 20), (torch.float32, 2, 3, 200, 1),
    (torch.float16, 2, 1, 72, 20), (torch.float32, 1, 1, 72, 20), (torch.float16, 1, 3, 200, 1)])
def test_hc_mix_and_post_match_torch(dtype, n, t, hidden, iters):
    """Hidden widths that are not powers of two (72, 77: one masked block; 200: a full and a masked block of the
    interpreter's 128); one Sinkhorn round (the column normalisation alone) and V4's 20."""
    post, comb, streams = check_mix(t, n, hidden, iters, dtype, DEV)
    check_post(post, comb, streams, DEV)


def test_zero_tokens():
    mixed, base, scale, streams = inputs(0, 4, 72, torch.float32, DEV)
    post, comb, coll = K.hc_mix(mixed, base, scale, streams, 20, EPS)
    assert post.shape == (0, 4) and comb.shape == (0, 4, 4) and coll.shape == (0, 72)
    assert K.hc_post(post, comb, coll, streams).shape == (0, 4, 72)


@pytest.mark.parametrize("n", [3, 32])
def test_refuses_other_hc_mult(n):
    mixed, base, scale, streams = inputs(2, n, 16, torch.float32, DEV)
    with pytest.raises(ValueError, match=r"hc_mult \(streams.shape\[1\]\) got %d; expected a power of two" % n):
        K.hc_mix(mixed, base, scale, streams, 20, EPS)
    with pytest.raises(ValueError, match="Fix: use the torch path"):
        K.hc_post(mixed[:, :n], mixed[:, : n * n].reshape(2, n, n).contiguous(), streams[:, 0], streams)


def test_refuses_bad_arguments():
    mixed, base, scale, streams = inputs(2, 4, 16, torch.float32, DEV)
    with pytest.raises(ValueError, match="mixed .* float32"):
        K.hc_mix(mixed.half(), base, scale, streams, 20, EPS)
    with pytest.raises(ValueError, match="streams .* dtype in"):
        K.hc_mix(mixed, base, scale, streams.double(), 20, EPS)
    post, comb, coll = K.hc_mix(mixed, base, scale, streams, 20, EPS)
    with pytest.raises(ValueError, match="block_out .* in the streams' dtype"):
        K.hc_post(post, comb, coll.half(), streams)


def test_ops_dispatch():
    """FusedOps runs the kernels for n in HC_MULTS and float32 / 16-bit streams, the torch ops otherwise (n 3,
    float64); TorchOps is the torch reference itself."""
    fused, ref = FusedOps(), TorchOps()
    for n, dtype in ((4, torch.float32), (3, torch.float32), (4, torch.float64)):
        mixed, base, scale, streams = inputs(5, n, 40, dtype, DEV)
        mixed = mixed.to(torch.float64 if dtype == torch.float64 else torch.float32)
        kernel = n == 4 and dtype == torch.float32
        want = mhc.hc_mix(mixed, base, scale, streams, 20, EPS)
        expect = K.hc_mix(mixed, base, scale, streams, 20, EPS) if kernel else want
        for got, e in zip(fused.hc_mix(mixed, base, scale, streams, 20, EPS), expect):
            assert torch.equal(got, e)
        for got, w in zip(ref.hc_mix(mixed, base, scale, streams, 20, EPS), want):
            assert torch.equal(got, w)
        post, comb, bo = want[0], want[1], streams[:, 0].clone()
        torch_post = mhc.hc_post(post, comb, bo, streams)
        expect = K.hc_post(post, comb, bo, streams) if kernel else torch_post
        assert torch.equal(fused.hc_post(post, comb, bo, streams), expect)
        assert torch.equal(ref.hc_post(post, comb, bo, streams), torch_post)


def test_v4_model_fused_ops_match_torch_ops():
    """The tiny V4 model (hc_mult 4, float32) through FusedOps (the kernels that take float32: mHC, V4's norms, the
    RoPE tail, the compressors' decode step) and through TorchOps: an extend of two requests, then a decode step."""
    from dsv4_harness import Driver, tiny_pair

    _, cfg, w = tiny_pair(seed=3, dtype=torch.float32, hc_mult=4)
    outs = []
    for ops in (TorchOps(), FusedOps()):
        drv = Driver(cfg, w, dtype=torch.float32, ops=ops)
        drv.admit(0)
        drv.admit(1)
        ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(4))
        h1 = drv.step([0, 1], [ids[:5], ids[5:]])
        h2 = drv.step([0, 1], [ids[:1], ids[5:6]])
        outs.append((h1, h2))
    for a, b in zip(*outs):
        assert ((a - b).norm() / b.norm()).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 32])
def test_gpu_v4_flash_shape(t):
    """n 4, hidden 4096, 20 rounds, bf16 streams: against torch on the GPU (its exp, cuBLAS's matmul)."""
    needs_gpu()
    post, comb, streams = check_mix(t, 4, 4096, 20, torch.bfloat16, "cuda", pre_rel=1e-5, comb_rel=1e-5,
                                    coll_rel=1e-5)
    check_post(post, comb, streams, "cuda", f32_rel=1e-5)


@pytest.mark.gpu
def test_gpu_graph_replays_equal_eager():
    """hc_mix then hc_post captured in one CUDA graph give the eager bits, with the inputs changed in place."""
    needs_gpu()
    from triton_env import capture_graph

    mixed, base, scale, streams = inputs(8, 4, 4096, torch.bfloat16, "cuda")
    bo = torch.randn(8, 4096, device="cuda").bfloat16()
    res = {}

    def step():
        post, comb, coll = K.hc_mix(mixed, base, scale, streams, 20, EPS)
        res["out"] = (post, comb, coll, K.hc_post(post, comb, bo, streams))

    graph = capture_graph(step)
    graph_out = res["out"]  # the captured launches write these
    for seed in (1, 2):
        new = inputs(8, 4, 4096, torch.bfloat16, "cuda", seed=seed)
        mixed.copy_(new[0])
        streams.copy_(new[3])
        graph.replay()
        torch.cuda.synchronize()
        replayed = [x.clone() for x in graph_out]
        step()
        for a, b in zip(replayed, res["out"]):
            assert torch.equal(a, b)
