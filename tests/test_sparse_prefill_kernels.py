"""Sparse prefill kernels of DeepSeek-V3.2 (issue 48): the indexer top-k of extend tokens in tiles of query tokens
(:mod:`backends.kernels.sparse.indexer_extend`) and the sparse MLA extend over the paged cache
(:mod:`backends.kernels.sparse.sparse_mla_extend`), against float64 oracles written here and the torch references.

Without CUDA the Triton kernels run in the CPU interpreter on tiny odd shapes (one token, a prefix shorter than
top-k, tiles that cut through requests, chunk boundaries, pages of 1 / 4 / 64); ``gpu``-marked tests add V3.2's
real widths (128 heads, indexer 64 x 128, top-2048, pages of 64 and 128, bf16 and fp8 caches).
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, needs_gpu  # noqa: F401  (skips the module without Triton)

from backends.kernels.sparse.indexer import indexer_scratch_bytes, indexer_topk_reference
from backends.kernels.sparse.indexer_extend import extend_tile_tokens, indexer_topk_extend
from backends.kernels.sparse.sparse_mla_extend import (
    sparse_mla_extend,
    sparse_mla_extend_reference,
    token_rows,
    topk_locations,
)

D_CKV, D_PE = 512, 64


def _rel(out, ref) -> float:
    out = out.detach().double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    ref = ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


class Paged:
    """Requests of ``prefix + extend`` tokens on scattered pages of ``page`` slots; indexer keys and latent rows by
    slot; the step's extend tokens laid end to end."""

    def __init__(self, prefix, extend, page, hi, di, heads, dtype, seed, device="cpu", kv_dtype=None):
        g = torch.Generator().manual_seed(seed)
        lens = [p + e for p, e in zip(prefix, extend)]
        pages = [-(-n // page) for n in lens]
        order = torch.randperm(sum(pages) + 3, generator=g) + 1  # page 0: padding
        width = max(lens)
        self.r2t = torch.zeros(len(lens) + 2, width + 5, dtype=torch.int32)
        self.rows = torch.arange(len(lens)) + 1  # request rows 1..B (row 0 unused)
        used = 0
        self.slots = []
        for b, n in enumerate(lens):
            pg = order[used : used + pages[b]]
            used += pages[b]
            s = (pg[:, None] * page + torch.arange(page)[None, :]).reshape(-1)[:n]
            self.r2t[b + 1, :n] = s.int()
            self.slots.append(s)
        nslots = (sum(pages) + 4) * page
        self.keys = torch.randn(nslots, di, generator=g).to(dtype)
        kv = torch.randn(nslots, D_CKV + D_PE, generator=g)
        self.kv = kv.to(kv_dtype or dtype)
        self.positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, extend)])
        self.qo = torch.tensor([0, *torch.tensor(extend).cumsum(0).tolist()], dtype=torch.int32)
        t = int(self.qo[-1])
        self.iq = torch.randn(t, hi, di, generator=g).to(dtype)
        self.iw = torch.rand(t, hi, generator=g) - 0.3
        self.q_nope = (torch.randn(t, heads, D_CKV, generator=g) * 0.3).to(dtype)
        self.q_pe = (torch.randn(t, heads, D_PE, generator=g) * 0.3).to(dtype)
        self.prefix, self.extend, self.max_len = prefix, extend, width
        self.device = device
        for name in ("r2t", "rows", "keys", "kv", "positions", "qo", "iq", "iw", "q_nope", "q_pe"):
            setattr(self, name, getattr(self, name).to(device))

    def index_args(self):
        return self.iq, self.iw, self.keys, self.r2t, self.rows, self.positions, self.qo


def _index_oracle(pr: Paged, top_k: int) -> list[set]:
    """float64: the set of selected positions of each extend token (all visible ones when fewer than top_k)."""
    out = []
    t = 0
    for b, (p, e) in enumerate(zip(pr.prefix, pr.extend)):
        keys = pr.keys.double().cpu()[pr.slots[b]]
        for i in range(e):
            n = p + i + 1
            sc = (torch.relu(pr.iq[t].double().cpu() @ keys[:n].T) * pr.iw[t].double().cpu()[:, None]).sum(0)
            out.append(set(torch.topk(sc, min(top_k, n)).indices.tolist()))
            t += 1
    return out


INDEX_CASES = [  # (prefix, extend, page, top_k, tile_tokens)
    ([0], [1], 4, 8, None),  # one token
    ([0, 2], [3, 4], 4, 16, None),  # every prefix shorter than top-k
    ([0, 7, 30], [21, 9, 1], 4, 6, 5),  # tiles of 5 cut through requests; a decode-like token
    ([13], [20], 1, 7, 16),  # pages of one slot, a chunk after a cached prefix
    ([64, 0], [3, 12], 64, 9, None),  # a chunk starting at a page boundary, pages of 64
]


@pytest.mark.parametrize("prefix,extend,page,top_k,tile", INDEX_CASES)
def test_indexer_extend_equals_the_float64_selection(prefix, extend, page, top_k, tile):
    pr = Paged(prefix, extend, page, 4, 32, 2, torch.float32, seed=sum(extend) + page, device=DEV)
    scratch = torch.empty(indexer_scratch_bytes(tile or 64, pr.max_len, top_k), dtype=torch.uint8, device=DEV)
    pos, scores = indexer_topk_extend(*pr.index_args(), top_k, max_len=pr.max_len, scratch=scratch,
                                      tile_tokens=tile)
    ref_pos, ref_scores = indexer_topk_reference(*pr.index_args(), top_k)
    oracle = _index_oracle(pr, top_k)
    for t, want in enumerate(oracle):
        got = pos[t].cpu()
        assert set(got[got >= 0].tolist()) == want, t
        assert int((got >= 0).sum()) == len(want)  # -1 after the visible count
    assert torch.allclose(scores.cpu(), ref_scores.cpu(), rtol=1e-5, atol=1e-5)
    assert torch.equal(pos.cpu() == -1, ref_pos.cpu() == -1)


def test_extend_tiles_fit_the_scratch_and_a_too_small_one_is_refused():
    n = indexer_scratch_bytes(7, 100, 16)
    assert extend_tile_tokens(n, 100, 16) == 7 and extend_tile_tokens(n - 1, 100, 16) == 6
    pr = Paged([0], [3], 4, 4, 32, 2, torch.float32, seed=0, device=DEV)
    with pytest.raises(ValueError, match="scratch"):
        indexer_topk_extend(*pr.index_args(), 8, max_len=pr.max_len, scratch=torch.empty(8, dtype=torch.uint8))


def _attention_oracle(pr: Paged, locs: torch.Tensor, sm_scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    kv = pr.kv.cpu().double() * (kv_scale if pr.kv.dtype == torch.float8_e4m3fn else 1.0)
    qn, qp = pr.q_nope.cpu().double(), pr.q_pe.cpu().double()
    out = torch.zeros(qn.shape, dtype=torch.float64)
    for t in range(qn.shape[0]):
        sel = locs[t][locs[t] >= 0].long().cpu()
        if sel.numel() == 0:
            continue
        rows = kv[sel]
        s = (qn[t] @ rows[:, :D_CKV].T + qp[t] @ rows[:, D_CKV:].T) * sm_scale
        out[t] = torch.softmax(s, dim=-1) @ rows[:, :D_CKV]
    return out


@pytest.mark.parametrize("dtype,kv_dtype,tol", [(torch.float32, None, 1e-4), (torch.bfloat16, None, 2e-2),
                                                (torch.bfloat16, torch.float8_e4m3fn, 2e-2)])
@pytest.mark.parametrize("prefix,extend,page,top_k", [([0], [1], 4, 8), ([0, 5], [6, 2], 4, 16),
                                                      ([9, 0], [6, 5], 16, 5)])
def test_sparse_extend_equals_the_float64_oracle(dtype, kv_dtype, tol, prefix, extend, page, top_k):
    pr = Paged(prefix, extend, page, 4, 32, 3, dtype, seed=len(extend) * 7 + top_k, device=DEV, kv_dtype=kv_dtype)
    topk, _ = indexer_topk_reference(*pr.index_args(), top_k)
    rows = token_rows(pr.rows, pr.qo, int(pr.qo[-1]))
    locs = topk_locations(topk, pr.r2t, rows)
    sm, kvs = 0.0722, 0.5
    out = sparse_mla_extend(pr.q_nope, pr.q_pe, pr.kv, locs, sm, kv_scale=kvs)
    ref = sparse_mla_extend_reference(pr.q_nope, pr.q_pe, pr.kv, locs, sm, kv_scale=kvs)
    oracle = _attention_oracle(pr, locs, sm, kvs)
    assert _rel(out, oracle) < tol and _rel(ref, oracle) < (1e-5 if dtype == torch.float32 else tol)
    # the locations are the request table's slots of the selected positions
    for t in range(locs.shape[0]):
        b = int(rows[t]) - 1
        want = {int(pr.slots[b][p]) for p in topk[t].cpu().tolist() if p >= 0}
        assert set(locs[t][locs[t] >= 0].cpu().tolist()) == want


def test_a_token_without_selection_outputs_zeros():
    pr = Paged([0], [2], 4, 4, 32, 2, torch.float32, seed=3, device=DEV)
    locs = torch.tensor([[-1, -1], [0 + int(pr.r2t[1, 0]), -1]], dtype=torch.int32, device=DEV)
    out = sparse_mla_extend(pr.q_nope, pr.q_pe, pr.kv, locs, 0.1)
    assert torch.count_nonzero(out[0]) == 0 and _rel(out, _attention_oracle(pr, locs, 0.1)) < 1e-4


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_sparse_prefill_real_widths(page, kv):
    """V3.2 on one GPU: 128 heads, indexer 64 x 128, top-2048; a 300-token chunk after a 4000-token prefix and
    a 50-token prompt (shorter than top-k) in one step, the indexer scratch holding 96 query tokens."""
    needs_gpu()
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else None
    pr = Paged([4000, 0], [300, 50], page, 64, 128, 128, torch.bfloat16, seed=page, device="cuda",
               kv_dtype=kv_dtype)
    top_k = 2048
    scratch = torch.empty(indexer_scratch_bytes(96, pr.max_len, top_k), dtype=torch.uint8, device="cuda")
    pos, scores = indexer_topk_extend(*pr.index_args(), top_k, max_len=pr.max_len, scratch=scratch)
    ref_pos, ref_scores = indexer_topk_reference(*pr.index_args(), top_k)
    assert torch.equal(pos == -1, ref_pos == -1)
    assert torch.allclose(scores, ref_scores, rtol=1e-3, atol=1e-2)  # sorted scores: same multiset, rank by rank
    rows = token_rows(pr.rows, pr.qo, int(pr.qo[-1]))
    locs = topk_locations(ref_pos, pr.r2t, rows)
    sm = 192**-0.5
    out = sparse_mla_extend(pr.q_nope, pr.q_pe, pr.kv, locs, sm, kv_scale=0.5)
    ref = sparse_mla_extend_reference(pr.q_nope, pr.q_pe, pr.kv, locs, sm, kv_scale=0.5)
    assert _rel(out, ref) < 2e-2
