"""V4's fused RoPE tail (``FusedOps.rope_tail``: backends/kernels/dsv4/rope_tail.py) against the torch ops it replaces
(``TorchOps.rope_tail``: ``cos_sin`` then ``apply_rope_tail``).

CPU: Triton's interpreter in float32 and float16 (its bfloat16 casts truncate) on odd shapes: T = 1 and 7, 2-D
rows and 3-D heads, rope_dim 64 of D 512 and 8 of D 24 (not a power of two), the inverse rotation, a YaRN rope with
attention factor 1.3, positions up to 2^17. The channels before the rope tail must be copied bit for bit; the
rotated ones agree up to cos / sin's last bit (numpy's float32 cos / sin in the interpreter against torch's).
``gpu`` tests: V4-Flash widths in bfloat16 (q [T, 64, 512], kv [T, 512], the indexer query [T, 64, 128], rope_dim
64) at T = 1, 7 and 64, and a CUDA-graph replay equal to the eager call with the positions changed in place.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, needs_gpu

from backends.kernels.dsv4 import rope_tail as rt
from runtime.model.deepseek.ops import FusedOps, TorchOps
from runtime.model.deepseek.rope import RopeParams, inv_freq_on

pytestmark = pytest.mark.usefixtures("one_thread")
REF, FUSED = TorchOps(), FusedOps()
MAIN = RopeParams(theta=10000.0)
YARN = RopeParams(theta=160000.0, rope_type="yarn", factor=16.0, original_max_position_embeddings=65536,
                  attention_factor=1.3)
#: |fused - torch| <= BOUND * eps(dtype) * the largest |value| of the row's rope tail
BOUND = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 8}


def check(x, pos, rope, rope_dim, inverse=False):
    """The fused op against the torch one; returns the number of rotated values that differ."""
    want = REF.rope_tail(x, pos, rope, rope_dim, inverse)
    got = FUSED.rope_tail(x, pos, rope, rope_dim, inverse)
    assert got.dtype == want.dtype == x.dtype and got.shape == want.shape == x.shape
    assert not torch.isnan(got).any()
    d = x.shape[-1]
    assert torch.equal(got[..., : d - rope_dim], want[..., : d - rope_dim])  # copied, not rotated
    g, w = got[..., d - rope_dim :].double(), want[..., d - rope_dim :].double()
    scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    err = float(((g - w).abs() / scale).max()) if g.numel() else 0.0
    assert err <= BOUND[x.dtype] * torch.finfo(x.dtype).eps, f"{err:.3g} of the row's largest value"
    return int((g != w).sum())


def _positions(t, gen, dev, high=1 << 17):
    return torch.randint(0, high, (t,), generator=gen).to(dev)


# ---------------------------------------------------------------------------------------- CPU (interpreter)
@pytest.mark.parametrize("shape,rope_dim,dtype,rope,inverse", [
    pytest.param((1, 512), 64, torch.float32, MAIN, False, id="kv-t1-fp32"),
    pytest.param((7, 3, 512), 64, torch.float16, YARN, True, id="heads-t7-fp16-yarn-inverse"),
    pytest.param((7, 5, 24), 8, torch.float32, YARN, False, id="heads-t7-d24-fp32-yarn"),
    pytest.param((1, 4, 512), 64, torch.float16, MAIN, True, id="heads-t1-fp16-inverse"),
])
def test_matches_torch_small(shape, rope_dim, dtype, rope, inverse):
    gen = torch.Generator().manual_seed(shape[0] * 31 + rope_dim)
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype).to(DEV)
    check(x, _positions(shape[0], gen, DEV), rope, rope_dim, inverse)


def test_strided_and_4d_inputs_small():
    """Strided heads and tokens take the kernel as they are; 4-D x (middle dims flattened) too."""
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(3, 4, 40, generator=gen).to(DEV)
    x = big[:, 1:, 8:]  # [3, 3, 32], rows and heads strided, last dim contiguous
    assert rt.takes(x, torch.zeros(3, dtype=torch.long, device=DEV), 16)
    check(x, _positions(3, gen, DEV), YARN, 16, True)
    check(torch.randn(2, 2, 3, 16, generator=gen).to(DEV), _positions(2, gen, DEV).int(), MAIN, 16)


def test_takes_the_torch_path_where_the_kernel_does_not_apply_small():
    """float64, a strided last dim, an odd D: the torch path, bit for bit; rope_dim 0: a copy."""
    gen = torch.Generator().manual_seed(6)
    pos = _positions(2, gen, DEV)
    for x, rd in [(torch.randn(2, 3, 16, dtype=torch.float64, generator=gen).to(DEV), 8),
                  (torch.randn(2, 16, 3, generator=gen).to(DEV).transpose(1, 2), 8),
                  (torch.randn(2, 15, generator=gen).to(DEV), 8)]:
        assert not rt.takes(x, pos, rd)
        assert torch.equal(FUSED.rope_tail(x, pos, YARN, rd, True), REF.rope_tail(x, pos, YARN, rd, True))
    x = torch.randn(2, 16, generator=gen).to(DEV)
    assert torch.equal(FUSED.rope_tail(x, pos, MAIN, 0), x)


def test_launcher_refuses_what_it_cannot_take():
    x, pos = torch.randn(2, 16, dtype=torch.float64, device=DEV), torch.zeros(2, dtype=torch.long, device=DEV)
    f = inv_freq_on(MAIN, 8, torch.device(DEV), torch.float32)
    with pytest.raises(ValueError, match="float64"):
        rt.rope_tail(x, pos, f)
    with pytest.raises(ValueError, match="positions"):
        rt.rope_tail(x.float(), pos[:1], f)
    with pytest.raises(ValueError, match="inv_freq"):
        rt.rope_tail(x.float()[:, :6], pos, f)


# ---------------------------------------------------------------------------------------- GPU
FLASH = [  # V4-Flash: the query (64 heads x 512), the kv row, the indexer query (64 heads x 128); rope_dim 64
    pytest.param((64, 512), id="q"), pytest.param((512,), id="kv"), pytest.param((64, 128), id="index-q"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64])
@pytest.mark.parametrize("row", FLASH)
@pytest.mark.parametrize("inverse", [False, True])
def test_gpu_flash_widths_bf16(row, t, inverse):
    needs_gpu()
    gen = torch.Generator().manual_seed(t)
    x = (3 * torch.randn(t, *row, generator=gen)).bfloat16().cuda()
    for rope in (MAIN, YARN):
        differ = check(x, _positions(t, gen, "cuda"), rope, 64, inverse)
        assert differ <= max(1, x[..., -64:].numel() // 100)


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager():
    needs_gpu()
    from triton_env import capture_graph

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(8, 64, 512, generator=gen).bfloat16().cuda()
    pos = _positions(8, gen, "cuda")
    out = {}

    def step():
        out["q"] = FUSED.rope_tail(q, pos, YARN, 64, True)

    graph = capture_graph(step)  # the eager run on a side stream makes the frequencies before capture
    replayed = out["q"]
    for _ in range(2):  # new inputs in place: the replay reads them
        q.copy_(torch.randn(8, 64, 512, generator=gen).bfloat16())
        pos.copy_(_positions(8, gen, "cpu"))
        replayed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        step()
        assert torch.equal(replayed, out["q"])
