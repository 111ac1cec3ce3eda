"""DeepSeek-V4 extend through the Triton extend kernel (``backend.impl=triton``; the CPU interpreter here) against the
backend's float64 torch path, on fresh random pools and inputs: sliding, CSA and HCA layers; chunks of 1, 2, 7 and
63 tokens (crossing the window W=7 and many compress windows: CSA every 3, HCA every 5 tokens); empty prefixes,
prefixes shorter and longer than W; a batch of one and several requests of different lengths. Everything not
cached (ring slots of an empty prefix, pool slots of no entry) holds random garbage that must not be read. The
rings after the step must hold the same rows. A ``gpu`` test repeats this at V4-Flash shapes (not yet run)."""

from __future__ import annotations

import pytest
import torch
from triton_env import needs_gpu

import backends.dsv4 as dsv4
from backends.dsv4 import DSV4Backend
from backends.kernels.dsv4.dsv4_extend import dsv4_extend
from runtime.core.batch import ForwardMode, make_batch
from runtime.core.dsv4_pools import DSV4Pools
from runtime.core.dsv4_spec import DSV4AttentionSpec, DSV4LayerType

pytestmark = pytest.mark.usefixtures("one_thread")

L = DSV4LayerType
SPEC = DSV4AttentionSpec(num_heads=3, head_dim=16, rope_dim=4, sliding_window=7, layer_types=(L.sliding, L.csa, L.hca),
                         csa_rate=3, hca_rate=5, index_n_heads=2, index_head_dim=8, index_topk=4)
CASES = {
    "one_request_empty_prefix_63": [(2, 0, 63)],
    "several_requests": [(0, 0, 1), (3, 4, 7), (1, 9, 63), (4, 20, 2), (5, 13, 1)],
}
# V4-Flash attention shapes (64 heads of 512, window 128, CSA every 4 with top-512, HCA every 128)
FLASH = DSV4AttentionSpec(num_heads=64, head_dim=512, rope_dim=64, sliding_window=128,
                          layer_types=(L.sliding, L.csa, L.hca), csa_rate=4, hca_rate=128, index_n_heads=64,
                          index_head_dim=128, index_topk=512)


def _pools(spec, dtype, reqs, device, page):
    pools = DSV4Pools.build(spec, max_requests=6, max_context=1536, entry_pages=60, entry_page_size=page,
                            dtype=dtype, device=torch.device(device))
    for row, prefix, n in reqs:
        pools.admit(row)
        pools.reserve(row, prefix + n)
    return pools


def _topk(spec, positions, g):
    """Per query, up to index_topk of its visible CSA entries in random order, -1 padding, some -1 in between."""
    k = spec.index_topk
    out = torch.full((len(positions), k), -1, dtype=torch.int64)
    for i, p in enumerate(positions.tolist()):
        pick = torch.randperm((p + 1) // spec.csa_rate, generator=g)[:k]
        out[i, : pick.numel()] = pick
        if pick.numel() > 1 and torch.rand(1, generator=g) < 0.3:
            out[i, 0] = -1
    return out


def _buffers(pools) -> list[torch.Tensor]:
    return [pools.window.buffers, *pools.csa.buffers.values(), *pools.hca.buffers.values()]


def _compare(spec, reqs, dtype, device, seed, monkeypatch, page=3) -> list[float]:
    """The Triton extend in ``dtype`` and the torch path in float64 over pools with the same random contents
    (values representable in ``dtype``); asserts the kernel ran for every layer and the rings agree after the
    step; returns each layer's max error relative to the largest output."""
    g = torch.Generator().manual_seed(seed)
    want_pools, got_pools = (_pools(spec, dt, reqs, device, page) for dt in (torch.float64, dtype))
    for want_buf, got_buf in zip(_buffers(want_pools), _buffers(got_pools)):
        got_buf.copy_(torch.randn(got_buf.shape, generator=g).to(dtype))  # garbage where nothing is cached
        want_buf.copy_(got_buf)
    assert torch.equal(want_pools.csa.table, got_pools.csa.table)
    assert torch.equal(want_pools.hca.table, got_pools.hca.table)
    rows, prefix, ext = (list(x) for x in zip(*reqs))
    batch = make_batch(ForwardMode.EXTEND, rows, prefix, ext, [0] * sum(ext), torch.device(device))
    t, h, d = sum(ext), spec.num_heads, spec.head_dim
    q, kv, sinks = (x.to(dtype).to(device) for x in (torch.randn(t, h, d, generator=g),
                                                      torch.randn(t, d, generator=g), torch.randn(h, generator=g)))
    topk = _topk(spec, batch.positions.cpu(), g).to(device)

    calls = []
    monkeypatch.setattr(dsv4, "dsv4_extend", lambda *a, **k: calls.append(1) or dsv4_extend(*a, **k))
    oracle, kernel = DSV4Backend(want_pools, "float64", impl="torch"), DSV4Backend(got_pools, "float32", impl="triton")
    for backend in (oracle, kernel):
        backend.init_forward_metadata(batch)
    errors = []
    for layer, kind in enumerate(spec.layer_types):
        sel = topk if kind == L.csa else None
        want = oracle.forward_extend(q.double(), kv.double(), sinks.double(), sel, layer, batch)
        got = kernel.forward_extend(q, kv, sinks, sel, layer, batch)
        assert got.dtype == dtype
        errors.append(((got.double() - want).abs().max() / want.abs().max()).item())
    assert len(calls) == len(spec.layer_types)  # every layer went through the kernel
    assert torch.equal(got_pools.window.buffers.double(), want_pools.window.buffers)
    return errors


@pytest.mark.parametrize("case", list(CASES))
def test_triton_extend_matches_float64_torch_path(case, monkeypatch):
    errors = _compare(SPEC, CASES[case], torch.float32, "cpu", len(case), monkeypatch)
    assert max(errors) < 1e-5, f"relative errors per layer (sliding, csa, hca): {errors}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_extend_at_v4_flash_shapes(dtype, monkeypatch):
    """Passed on an H100 (fp32 and bf16): chunks of 300 (empty prefix), 257 (after 1000 cached: up to 9 HCA
    entries and 314 CSA entries, so top-512 is -1 padded) and 1."""
    needs_gpu()
    errors = _compare(FLASH, [(0, 0, 300), (1, 1000, 257), (2, 130, 1)], dtype, "cuda", 0, monkeypatch, page=64)
    assert max(errors) < (1e-4 if dtype == torch.float32 else 2e-2), f"relative errors per layer: {errors}"
