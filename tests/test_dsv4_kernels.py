"""The dsv4 decode kernel (Triton; the CPU interpreter here, V4-Flash shapes on the GPU in
bench/dsv4_decode_bench.py) and its torch fallback against the float64 reference: odd window fills, -1 padding,
compressed parts of odd lengths and none, heads not a multiple of the head block. The extend kernel's gather
contract (per-query and shared index rows, lengths, -1 inside) against the reference one query at a time; the
extend kernel inside the backend: tests/test_dsv4_extend.py."""

from __future__ import annotations

import pytest
import torch

from backends.kernels.dsv4.dsv4_decode import dsv4_decode, dsv4_decode_torch
from backends.kernels.dsv4.dsv4_extend import GatherPart, dsv4_extend
from backends.kernels.dsv4.dsv4_reference import sink_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(b, h, d, w, n_cmp, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    win = torch.randn(b * w + 1, d, generator=g).to(dtype)
    cmp_rows = torch.randn(50, d, generator=g).to(dtype)
    win_idx = torch.full((b, w), -1, dtype=torch.int32)
    cmp_idx = torch.full((b, n_cmp), -1, dtype=torch.int32)
    for i in range(b):
        fill = int(torch.randint(1, w + 1, (1,), generator=g))  # a window partly filled
        win_idx[i, :fill] = torch.randperm(w, generator=g)[:fill].int() + i * w
        if n_cmp:
            k = int(torch.randint(0, n_cmp + 1, (1,), generator=g))  # some requests see no entry at all
            cmp_idx[i, :k] = torch.randperm(50, generator=g)[:k].int()
    sinks = torch.randn(h, generator=g)
    return tuple(t.to(DEV) for t in (q, win, win_idx, cmp_rows, cmp_idx, sinks))


def _oracle(q, win, win_idx, cmp_rows, cmp_idx, sinks, scale):
    """Per request, only its valid rows, straight into the reference (no gather tricks)."""
    out = []
    for i in range(q.shape[0]):
        parts = []
        for rows, idx in ((win, win_idx[i]), (cmp_rows, cmp_idx[i])):
            sel = idx[idx >= 0].long()
            if sel.numel():
                parts.append((rows[sel].double(), torch.ones(1, sel.numel(), dtype=torch.bool, device=DEV)))
        out.append(sink_attention(q[i: i + 1].double(), parts, sinks.double(), scale))
    return torch.cat(out)


@pytest.mark.parametrize("n_cmp", [0, 19])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_fallback_match_float64(n_cmp, dtype):
    b, h, d, w = 3, 20, 32, 7
    args = _case(b, h, d, w, n_cmp, dtype)
    scale = d**-0.5
    want = _oracle(*args, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got in (dsv4_decode(*args, scale, block_n=16), dsv4_decode_torch(*args, scale)):
        assert got.dtype == dtype
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < tol, f"relative error {err:.2e}"


def _extend_case(t, h, d, dtype, seed=1):
    """Three parts with odd shapes: per-query index rows (lengths short of the row, -1 inside), and a part whose
    queries share index rows (as HCA reads the entry table), some queries reading nothing."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    parts = []
    for n_rows, shared, width in ((23, False, 6), (t + 3, False, 7), (41, True, 19)):
        rows = torch.randn(n_rows, d, generator=g).to(dtype)
        r = 3 if shared else t
        idx = torch.randint(0, n_rows, (r, width), generator=g, dtype=torch.int32)
        idx[torch.rand(r, width, generator=g) < 0.2] = -1
        sel = torch.randint(0, r, (t,), generator=g, dtype=torch.int32) if shared else torch.arange(t, dtype=torch.int32)
        length = torch.randint(0, width + 1, (t,), generator=g, dtype=torch.int32)
        parts.append(GatherPart(*(x.to(DEV) for x in (rows, idx, sel, length))))
    return q.to(DEV), tuple(parts), torch.randn(h, generator=g).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_kernel_matches_float64(dtype):
    t, h, d = 9, 20, 32
    q, parts, sinks = _extend_case(t, h, d, dtype)
    scale = d**-0.5
    want = []
    for i in range(t):
        sub = []
        for p in parts:
            idx = p.idx[p.sel[i].long(), : int(p.length[i])]
            sel = idx[idx >= 0].long()
            if sel.numel():
                sub.append((p.rows[sel].double(), torch.ones(1, sel.numel(), dtype=torch.bool, device=DEV)))
        want.append(sink_attention(q[i: i + 1].double(), sub, sinks.double(), scale))
    want = torch.cat(want)
    got = dsv4_extend(q, parts, sinks, scale, block_n=16)
    assert got.dtype == dtype
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), f"relative error {err:.2e}"
