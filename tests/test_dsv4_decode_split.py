"""The dsv4 decode kernel split over the rows (flash-decoding: partial softmax states per slice of a request's
window-then-compressed index list, merged with the sink), in the CPU interpreter against the float64 reference:
num_splits 1, 2, 3, 7 and the automatic choice, fp32 and bf16, batch 1, heads not a multiple of the head block,
odd window fills, requests without compressed entries, splits that fall on -1 padding only or on an empty range
(each case asserts it has them); large sinks over few rows, so a sink counted once per split cannot pass. The
automatic choice and the workspace bound are checked as functions of shapes, and the backend's decode (its ledger
workspace, lists long enough that the automatic choice splits) against its float64 torch path."""

from __future__ import annotations

import pytest
import torch
from test_dsv4_extend import _buffers, _pools, _topk
from test_dsv4_kernels import DEV, _oracle

import backends.dsv4 as dsv4
from backends.dsv4 import DSV4Backend, decode_workspace_spec
from backends.kernels.dsv4.dsv4_decode import (
    CPU_SM_COUNT,
    MIN_TILES_PER_SPLIT,
    PROGRAMS_PER_SM,
    decode_splits,
    decode_workspace_bytes,
    decode_workspace_floats,
    dsv4_decode,
    dsv4_decode_torch,
    split_len,
)
from runtime.core.batch import ForwardMode, make_batch
from runtime.core.device import DeviceInfo
from runtime.core.dsv4_spec import DSV4AttentionSpec, DSV4LayerType

H, D, BLOCK_N = 20, 32, 16
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (window width, compressed width, per request: window rows filled, compressed entries valid); -1 pads the rest
CASES = {
    "batch 1, no compressed entry": (40, 57, [(37, 0)]),
    "odd fills": (40, 57, [(1, 57), (40, 0), (23, 11)]),
    "short lists": (7, 19, [(3, 0), (7, 2)]),
}


def _case(w, n_cmp, fills, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = len(fills)
    q = torch.randn(b, H, D, generator=g).to(dtype)
    win = torch.randn(b * w, D, generator=g).to(dtype)
    cmp_rows = torch.randn(61, D, generator=g).to(dtype)
    win_idx = torch.full((b, w), -1, dtype=torch.int32)
    cmp_idx = torch.full((b, n_cmp), -1, dtype=torch.int32)
    for i, (nw, nc) in enumerate(fills):
        win_idx[i, :nw] = torch.randperm(w, generator=g)[:nw].int() + i * w
        cmp_idx[i, :nc] = torch.randperm(61, generator=g)[:nc].int()
    sinks = 2.0 + torch.rand(H, generator=g) * 2  # heavy sinks: their weight matters next to few rows
    return tuple(t.to(DEV) for t in (q, win, win_idx, cmp_rows, cmp_idx, sinks))


def _split_coverage(win_idx, cmp_idx, num_splits):
    """(a split over an empty range exists, a non-empty split with only -1 rows exists)."""
    rows = torch.cat([win_idx, cmp_idx], dim=1).cpu()
    n, step = rows.shape[1], split_len(rows.shape[1], num_splits, BLOCK_N)
    empty = any(s * step >= n for s in range(num_splits))
    masked = any(s * step < n and not (rows[b, s * step: (s + 1) * step] >= 0).any()
                 for b in range(rows.shape[0]) for s in range(num_splits))
    return empty, masked


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_matches_float64(num_splits, dtype):
    scale = D**-0.5
    seen_empty = seen_masked = False
    for name, (w, n_cmp, fills) in CASES.items():
        args = _case(w, n_cmp, fills, dtype)
        want = _oracle(*args, scale)
        got = dsv4_decode(*args, scale, block_n=BLOCK_N, num_splits=num_splits)
        assert got.dtype == dtype
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < TOL[dtype], f"{name}, num_splits={num_splits}: relative error {err:.2e}"
        if num_splits:
            empty, masked = _split_coverage(args[2], args[4], num_splits)
            seen_empty, seen_masked = seen_empty or empty, seen_masked or masked
    if num_splits in (3, 7):  # the cases reach the corners they claim
        assert seen_masked
    if num_splits == 7:
        assert seen_empty


@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_lengths_bound_a_padded_compressed_list(num_splits):
    """cmp_len (CUDA graphs' fixed-width HCA lists): request b reads only its first cmp_len[b] compressed
    indices. The padding here holds valid slots (not -1), so a kernel or fallback that read past cmp_len fails."""
    w, n_cmp, fills = CASES["odd fills"]
    q, win, win_idx, cmp_rows, cmp_idx, sinks = _case(w, n_cmp, fills, torch.float32)
    lens = torch.tensor([nc for _, nc in fills], dtype=torch.int32, device=DEV)
    pad = 23
    garbage = torch.randint(0, cmp_rows.shape[0], (len(fills), n_cmp + pad), dtype=torch.int32, device=DEV)
    cols = torch.arange(n_cmp + pad, device=DEV)[None, :]
    padded = torch.where(cols < lens[:, None], torch.cat([cmp_idx, garbage[:, n_cmp:]], dim=1), garbage)
    want = _oracle(q, win, win_idx, cmp_rows, cmp_idx, sinks, D**-0.5)
    for got in (dsv4_decode(q, win, win_idx, cmp_rows, padded, sinks, D**-0.5, block_n=BLOCK_N,
                            num_splits=num_splits, cmp_len=lens),
                dsv4_decode_torch(q, win, win_idx, cmp_rows, padded, sinks, D**-0.5, cmp_len=lens)):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < TOL[torch.float32], f"num_splits={num_splits}: relative error {err:.2e}"
    bad = dsv4_decode_torch(q, win, win_idx, cmp_rows, padded, sinks, D**-0.5)  # without the lengths
    assert ((bad.double() - want).abs().max() / want.abs().max()).item() > 1e-3  # the padding is not inert


def test_automatic_choice_splits_here_and_needs_no_more_workspace_than_the_bound():
    w, n_cmp, fills = CASES["batch 1, no compressed entry"]
    auto = decode_splits(1, H, w + n_cmp, CPU_SM_COUNT, 16, BLOCK_N)
    assert auto > 1  # the automatic test above runs the split path
    # a caller's workspace of the bound's size gives the automatic choice bit for bit, without allocating
    args = _case(w, n_cmp, fills, torch.float32)
    ws = torch.empty(decode_workspace_bytes(H, D, CPU_SM_COUNT), dtype=torch.uint8, device=DEV)
    got = dsv4_decode(*args, D**-0.5, block_n=BLOCK_N, workspace=ws)
    assert torch.equal(got, dsv4_decode(*args, D**-0.5, block_n=BLOCK_N, num_splits=auto))


@pytest.mark.parametrize("sms", [8, 132])
@pytest.mark.parametrize("heads", [20, 64, 128])
def test_automatic_choice_from_shapes(sms, heads):
    hb = -(-heads // 16)
    for n_rows in (7, 128, 640, 1152, 4096):
        for batch in range(1, 300, 7):
            s = decode_splits(batch, heads, n_rows, sms, 16, 32)
            if batch * hb >= sms:  # the grid already has a program per SM: no split
                assert s == 1
                continue
            assert 1 <= s <= -(-PROGRAMS_PER_SM * sms // (batch * hb))
            if s > 1:
                step = split_len(n_rows, s, 32)
                assert step >= MIN_TILES_PER_SPLIT * 32 and (s - 1) * step < n_rows  # no short or empty split
            assert 4 * decode_workspace_floats(batch, heads, 512, s) <= decode_workspace_bytes(heads, 512, sms)
    # V4-Flash (64 heads, window 128 + top-512) on a 132-SM H100 with the default 64-row tiles: batch 1 and 4
    # split 10 ways (a tile each), batch 64 not (2 splits measured 0.9x the single pass there)
    assert [decode_splits(b, 64, 640, 132) for b in (1, 4, 64)] == [10, 10, 1]


def test_workspace_too_small_for_the_asked_splits_is_refused():
    args = _case(7, 19, [(3, 0), (7, 2)], torch.float32)
    small = torch.empty(decode_workspace_floats(2, H, D, 2), dtype=torch.float32, device=DEV)
    with pytest.raises(ValueError, match="num_splits=3"):
        dsv4_decode(*args, D**-0.5, block_n=BLOCK_N, num_splits=3, workspace=small)
    with pytest.raises(ValueError, match="num_splits None"):
        dsv4_decode(*args, D**-0.5, block_n=BLOCK_N, num_splits=0)


L = DSV4LayerType
# 20 heads (two head blocks), window 70, top-64: per layer 70 (sliding), 134 (csa) and 70 + 200 (hca, 1000 tokens)
SPEC = DSV4AttentionSpec(num_heads=20, head_dim=16, rope_dim=4, sliding_window=70,
                         layer_types=(L.sliding, L.csa, L.hca), csa_rate=3, hca_rate=5, index_n_heads=2,
                         index_head_dim=8, index_topk=64)


@pytest.mark.parametrize("reqs", [[(2, 1000, 1)], [(0, 999, 1), (3, 40, 1)]], ids=["batch 1", "batch 2"])
def test_backend_decode_splits_and_matches_float64_torch_path(reqs, monkeypatch):
    """impl=triton with its ledger workspace vs impl=torch in float64, on pools of the same random contents."""
    g = torch.Generator().manual_seed(len(reqs))
    want_pools, got_pools = (_pools(SPEC, dt, reqs, "cpu", 16) for dt in (torch.float64, torch.float32))
    for want_buf, got_buf in zip(_buffers(want_pools), _buffers(got_pools)):
        got_buf.copy_(torch.randn(got_buf.shape, generator=g))
        want_buf.copy_(got_buf)
    rows, prefix, ext = (list(x) for x in zip(*reqs))
    batch = make_batch(ForwardMode.DECODE, rows, prefix, ext, [0] * len(rows), torch.device("cpu"))
    b, h, d = len(rows), SPEC.num_heads, SPEC.head_dim
    q, kv, sinks = torch.randn(b, h, d, generator=g), torch.randn(b, d, generator=g), torch.randn(h, generator=g)
    topk = _topk(SPEC, batch.positions, g)
    info = DeviceInfo("cpu", "cpu", 0, False, None, "cpu")
    ws = torch.empty(decode_workspace_spec(SPEC, {"impl": "triton"}, info).nbytes, dtype=torch.uint8)
    splits = []

    def spy(q, win_rows, win_idx, cmp_rows, cmp_idx, *args, **kw):
        assert kw["workspace"] is ws
        splits.append(decode_splits(q.shape[0], q.shape[1], win_idx.shape[1] + cmp_idx.shape[1], CPU_SM_COUNT))
        return dsv4_decode(q, win_rows, win_idx, cmp_rows, cmp_idx, *args, **kw)

    monkeypatch.setattr(dsv4, "dsv4_decode", spy)
    oracle = DSV4Backend(want_pools, "float64", impl="torch")
    kernel = DSV4Backend(got_pools, "float32", impl="triton", decode_workspace=ws)
    for backend in (oracle, kernel):
        backend.init_forward_metadata(batch)
    for layer, kind in enumerate(SPEC.layer_types):
        sel = topk if kind == L.csa else None
        want = oracle.forward_decode(q.double(), kv.double(), sinks.double(), sel, layer, batch)
        got = kernel.forward_decode(q, kv, sinks, sel, layer, batch)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-5, f"layer {layer} ({kind.name}): relative error {err:.2e}"
    assert splits[0] == 1 and min(splits[1:]) > 1  # sliding: 70 rows, one pass; csa and hca split
    assert torch.equal(got_pools.window.buffers.double(), want_pools.window.buffers)
