"""Programmatic dependent launch of the fused decoder kernels (``model.pdl``, backends/kernels/pdl.py).

CPU: where PDL is not used (the interpreter, CPU tensors, ``pdl=False``) and that ``model.pdl`` reaches the ops.
GPU: a decoder layer's chain of fused kernels at DeepSeek-V3 TP8 shapes, launched with PDL inside a CUDA graph,
gives the bits of the same chain launched plainly and eagerly: a kernel that read its predecessor's output before
that output was visible would give other values.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import compose_config
from triton_env import DEV, INTERPRETED, needs_gpu

import containers
from backends.kernels.decoder import decoder_kernels
from backends.kernels.gemm import skinny_kernels
from backends.kernels.pdl import use_pdl
from runtime.core.kv_pool import MLAKVPool
from runtime.model.deepseek.ops import FusedOps
from runtime.model.deepseek.weights import DenseMLPWeights, MoEWeights


def test_pdl_is_not_used_off_hopper_or_in_the_interpreter():
    for kernel in (decoder_kernels._rms_norm_kernel, skinny_kernels._linear_dot_kernel):
        assert not use_pdl(False, kernel, DEV)
        if INTERPRETED or DEV == "cpu":
            assert not use_pdl(True, kernel, DEV)
        assert not use_pdl(True, kernel, "cpu")


@pytest.mark.parametrize("value", [True, False])
def test_model_pdl_reaches_the_fused_ops(value):
    """The container builds FusedOps (the CPU selects TorchOps; the fused provider is built directly) and the
    triton_mla backend with ``model.pdl``."""
    rt = containers.build(compose_config("device=cpu", f"model.pdl={value}"))
    assert rt.container.decoder_ops.providers["fused"]().pdl is value
    triton = containers.build(compose_config("device=cpu", "backend=triton_mla", f"model.pdl={value}"))
    assert triton.container.backend().pdl is value  # one switch: the attention kernels join the fused ops' chain


def test_fused_ops_take_pdl_from_the_constructor():
    assert FusedOps(16, False).pdl is False and FusedOps().pdl is True


# ---------------------------------------------------------------------------------------- GPU
def _spec():
    return SimpleNamespace(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, rms_norm_eps=1e-6,
                           rope_interleave=True, num_experts_per_tok=8, n_group=8, topk_group=4,
                           scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                           routed_scaling_factor=2.5)


def _layer(ops, spec, pool, w, x, delta, slots, cos, sin):
    """One MLA decoder layer's fused kernels at batch ``len(x)`` (attention itself left out: the absorbed q goes
    straight to the value product), as MLAModel and MLAAttention call them."""
    x, xn = ops.add_rms_norm(x, delta, w["attn_norm"], 1e-6)
    qkv = ops.linear(xn, w["qkv_a"])
    q = ops.norm_linear(qkv[:, :1536], w["q_a_norm"], 1e-6, w["q_b"]).view(x.shape[0], 16, 192)
    _, q_pe, _, _, o_lat = ops.rope_latent(spec, q, pool, 0, slots, qkv[:, 1536:], w["kv_a_norm"], cos, sin, w["w_uk"])
    # attention would run between the two absorb products
    o = ops.linear(ops.head_linear(o_lat, w["w_uv"]).reshape(x.shape[0], 16 * 128), w["o"])
    x, xn = ops.add_rms_norm(x, o, w["mlp_norm"], 1e-6)
    return x, ops.moe(spec, w["moe"], xn, True), q_pe


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7])
def test_pdl_chain_in_a_graph_matches_plain_launches_gpu(t):
    needs_gpu()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0+")
    torch.manual_seed(t)
    bf, dev, d, e, i = torch.bfloat16, "cuda", 7168, 256, 256
    w = {"attn_norm": (torch.rand(d, device=dev) + 0.5).to(bf), "q_a_norm": (torch.rand(1536, device=dev) + 0.5).to(bf),
         "kv_a_norm": (torch.rand(512, device=dev) + 0.5).to(bf), "mlp_norm": (torch.rand(d, device=dev) + 0.5).to(bf),
         "qkv_a": (torch.randn(1536 + 576, d, device=dev) / d**0.5).to(bf),
         "q_b": (torch.randn(16 * 192, 1536, device=dev) / 1536**0.5).to(bf),
         "o": (torch.randn(d, 16 * 128, device=dev) / 2048**0.5).to(bf),
         "w_uk": (torch.randn(16, 128, 512, device=dev) / 128**0.5).to(bf),
         "w_uv": (torch.randn(16, 512, 128, device=dev) / 512**0.5).to(bf),
         "moe": MoEWeights(gate=torch.randn(e, d, device=dev) / d**0.5, bias=torch.randn(e, device=dev) * 0.01,
                           gate_up=(torch.randn(e, 2 * i, d, device=dev) / d**0.5).to(bf),
                           down=(torch.randn(e, d, i, device=dev) / i**0.5).to(bf),
                           shared=DenseMLPWeights((torch.randn(2 * i, d, device=dev) / d**0.5).to(bf),
                                                  (torch.randn(d, i, device=dev) / i**0.5).to(bf)))}
    spec = _spec()
    x, delta = torch.randn(t, d, device=dev).to(bf), torch.randn(t, d, device=dev).to(bf)
    ang = torch.rand(t, 32, device=dev) * 6.28
    cos, sin = ang.cos(), ang.sin()
    slots = torch.arange(t, device=dev) * 3 + 1
    pools = [MLAKVPool([0], 64, 1, 512, 64, bf, dev) for _ in range(2)]

    plain = _layer(FusedOps(16, False), spec, pools[0], w, x, delta, slots, cos, sin)
    fast = FusedOps(16, True)
    _layer(fast, spec, pools[1], w, x, delta, slots, cos, sin)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer(fast, spec, pools[1], w, x, delta, slots, cos, sin)
    pools[1].flat(0).zero_()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, plain):
        assert torch.equal(a, b)
    assert torch.equal(pools[1].flat(0), pools[0].flat(0))
