"""The DeepSeek-V4 indexer for a whole batch (backends/kernels/dsv4/dsv4_indexer.py: batched torch, and the DSA scoring
kernel in the CPU interpreter) equal to the per-request reference ``indexer_topk`` over the same pool: requests of
different lengths in odd table rows, queries that see no entry yet (-1 only), fewer visible entries than top_k
(-1 padding), chunks of tokens smaller than a request, exact ties (equal scores: the same score multiset)."""

from __future__ import annotations

import pytest
import torch
from dsv4_harness import boundary_ties

import backends.kernels.dsv4.dsv4_indexer as idx_mod
from backends.kernels.dsv4.dsv4_indexer import indexer_topk_paged, triton_indexer_fits
from backends.kernels.dsv4.dsv4_reference import indexer_topk
from runtime.core.batch import ForwardMode, make_batch
from runtime.core.dsv4_pools import CompressedKVPool

RATE, TOP_K, HI = 3, 5, 4
REQS = [(4, 0, 7), (1, 0, 1), (0, 11, 31), (3, 26, 2), (2, 40, 1)]  # (table row, prefix, new tokens)


def _setup(di, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    pool = CompressedKVPool(RATE, [0], {"index": di}, num_pages=40, page_size=4, max_requests=5, max_entries=20,
                            dtype=dtype, device=torch.device("cpu"))
    for row, prefix, n in REQS:
        pool.open(row)
        pool.reserve(row, prefix + n)
    pool.buffers["index"].copy_(torch.randn(pool.buffers["index"].shape, generator=g))  # garbage included
    rows, prefix, ext = (list(x) for x in zip(*REQS))
    batch = make_batch(ForwardMode.EXTEND, rows, prefix, ext, [0] * sum(ext), torch.device("cpu"))
    t = batch.num_tokens
    q = torch.randn(t, HI, di, generator=g, dtype=dtype)
    w = torch.randn(t, HI, generator=g, dtype=dtype)
    return pool, batch, q, w


def _args(pool, batch, q, w):
    return (q, w, pool.flat(0, "index"), pool.table, batch.req_pool_indices, batch.qo_indptr, batch.positions, RATE,
            TOP_K, pool.entries_for(batch.max_seq_len))


def _reference(pool, batch, q, w):
    out, qo = [], batch.qo_indptr_cpu.tolist()
    for b, row in enumerate(batch.req_pool_indices_cpu.tolist()):
        s, e = qo[b], qo[b + 1]
        keys = pool.gather(0, "index", row, pool.entries_for(int(batch.seq_lens_cpu[b]))).to(q.dtype)
        out.append(indexer_topk(q[s:e], w[s:e], keys, batch.positions[s:e], RATE, TOP_K))
    return torch.cat(out)


@pytest.mark.parametrize("budget", [idx_mod.CHUNK_ELEMENTS, 200])
def test_batched_torch_equals_per_request_reference(budget, monkeypatch):
    monkeypatch.setattr(idx_mod, "CHUNK_ELEMENTS", budget)  # 200: a few tokens per chunk, chunks cut requests
    pool, batch, q, w = _setup(8, seed=0)
    args = _args(pool, batch, q, w)
    assert not boundary_ties(*args[:-1]), "exact ties at the top-k boundary: reseed"
    want = _reference(pool, batch, q, w)
    assert (want[:2] == -1).all() and (want == -1).any(dim=1).sum() > 3  # nothing visible yet; padding
    got = indexer_topk_paged(*args, impl="torch", compute_dtype=torch.float64)
    assert got.dtype == torch.int64 and torch.equal(got, want)


@pytest.mark.parametrize("budget", [idx_mod.CHUNK_ELEMENTS, 70])
def test_triton_scoring_kernel_equals_reference(budget, monkeypatch):
    """Di=16 (the DSA kernel's smallest tile), float32 inputs against the float64 reference; budget 70: score
    buffers of 5 tokens x 14 entries, so the slices cut requests."""
    monkeypatch.setattr(idx_mod, "CHUNK_ELEMENTS", budget)
    assert triton_indexer_fits(16) and not triton_indexer_fits(8) and not triton_indexer_fits(24)
    pool, batch, q, w = _setup(16, seed=1, dtype=torch.float32)
    args = _args(pool, batch, q, w)
    wide = [a.double() for a in args[:3]]
    assert not boundary_ties(*wide, *args[3:-1], gap=1e-4), "near-ties float32 could flip: reseed"
    want = _reference(pool, batch, q.double(), w.double())
    assert torch.equal(indexer_topk_paged(*args, impl="triton"), want)


def test_ties_pick_equal_scores_and_no_entry_means_all_padding():
    pool, batch, q, w = _setup(8, seed=2)
    keys = pool.buffers["index"]
    keys[..., 1::2, :] = keys[..., 0::2, :]  # every slot pair holds the same key: entries tie in pairs
    args = _args(pool, batch, q, w)
    assert boundary_ties(*args[:-1]), "the premise: ties at the top-k boundary"
    want, got = _reference(pool, batch, q, w), indexer_topk_paged(*args, impl="torch", compute_dtype=torch.float64)
    assert torch.equal(got == -1, want == -1)

    def scores(sel):
        flat = pool.flat(0, "index")
        rows = batch.req_pool_indices.repeat_interleave(batch.qo_indptr.diff())
        k = flat[pool.table[rows[:, None], sel.clamp_min(0)].long()]
        return torch.where(sel >= 0, (torch.relu(torch.einsum("thd,tkd->thk", q, k)) * w[:, :, None]).sum(1), 0)

    assert torch.allclose(scores(got), scores(want), rtol=0, atol=1e-12)
    empty = make_batch(ForwardMode.EXTEND, [1], [0], [2], [0, 0], torch.device("cpu"))
    none = indexer_topk_paged(q[:2], w[:2], keys.view(-1, 8), pool.table, empty.req_pool_indices, empty.qo_indptr,
                              empty.positions, RATE, TOP_K, 0)
    assert none.shape == (2, TOP_K) and (none == -1).all()
