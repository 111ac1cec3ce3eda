"""A whole tiny DeepSeek-V4 model through our layers, pools and the dsv4 backend against transformers:
decode token by token, extend in chunks (two requests interleaved in shared batches), greedy generation."""

from __future__ import annotations

import pytest
import torch
from dsv4_harness import Driver, tiny_pair

from backends.base import CudaGraphLevel
from backends.dsv4 import DSV4AttentionBackend, DSV4Backend
from runtime.core.batch import ForwardMode
from runtime.core.dsv4_pools import CompressedKVPool, SlidingWindowKV
from runtime.core.errors import PoolExhausted

pytestmark = pytest.mark.usefixtures("no_indexer_ties")

S = 21


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=0)


def _ids(seed, n=S):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def _reference_logits(ref, ids):
    with torch.no_grad():
        return ref(ids[None], use_cache=False).logits[0]


def _close(got, want, rtol=1e-5):
    assert not torch.isnan(got).any()
    err = (got - want).abs().max() / want.abs().max()
    assert err < rtol, f"relative error {err:.3g}"


def test_decode_token_by_token_matches_full_forward(pair):
    ref, cfg, w = pair
    ids = _ids(1)
    want = _reference_logits(ref, ids)
    d = Driver(cfg, w)
    d.admit(2)
    got = torch.cat([d.logits(d.step([2], [ids[t:t + 1]])) for t in range(S)])
    _close(got, want)


def _two_requests_chunked(ref, d):
    """Requests in rows 3 and 0 advance by different chunks in shared batches (extend, then decode, then extend
    again), so windows, partial compressor windows and entry pages are carried across steps; our logits are
    compared with transformers' full forward of each sequence."""
    a, b = _ids(2), _ids(3, 17)
    want_a, want_b = _reference_logits(ref, a), _reference_logits(ref, b)
    d.admit(3)
    d.admit(0)
    got_a, got_b = [], []
    sched = [(7, 3), (1, 1), (1, 1), (5, 9), (7, 0), (0, 3)]
    ia = ib = 0
    for na, nb in sched:
        rows, chunks = [], []
        if na:
            rows.append(3)
            chunks.append(a[ia:ia + na])
        if nb:
            rows.append(0)
            chunks.append(b[ib:ib + nb])
        logits = d.logits(d.step(rows, chunks))
        got_a.append(logits[:na])
        got_b.append(logits[na:])
        ia, ib = ia + na, ib + nb
    assert (ia, ib) == (S, 17)
    return (torch.cat(got_a), torch.cat(got_b)), (want_a, want_b)


@pytest.mark.parametrize("page", [1, 3, 8])
def test_chunked_extend_two_requests_matches_full_forward(pair, page):
    ref, cfg, w = pair
    got, want = _two_requests_chunked(ref, Driver(cfg, w, entry_page_size=page))
    for g, x in zip(got, want):
        _close(g, x)


def test_triton_extend_and_indexer_match_full_forward(monkeypatch):
    """impl=triton (CPU interpreter, float32): extend through the Triton extend kernel and the indexer through the
    DSA scoring kernel (index_head_dim 16, its smallest tile) in the chunked two-request schedule."""
    import backends.dsv4 as dsv4

    ref, cfg, w = tiny_pair(seed=0, index_head_dim=16)
    w32 = type(w).load({k: v.float() if v.is_floating_point() else v for k, v in ref.state_dict().items()},
                       cfg=cfg)
    calls = {"extend": 0, "triton": 0}
    extend, indexer = dsv4.dsv4_extend, dsv4.indexer_topk_paged

    def count_extend(*a, **k):
        calls["extend"] += 1
        return extend(*a, **k)

    def count_indexer(*a):
        calls["triton"] += a[10] == "triton"
        return indexer(*a)

    monkeypatch.setattr(dsv4, "dsv4_extend", count_extend)
    monkeypatch.setattr(dsv4, "indexer_topk_paged", count_indexer)
    d = Driver(cfg, w32, dtype=torch.float32, impl="triton")
    assert d.backend.indexer_impl == "triton"
    got, want = _two_requests_chunked(ref, d)
    for g, x in zip(got, want):
        assert g.dtype == torch.float32
        _close(g.double(), x, 1e-4)
    assert calls["extend"] == 4 * cfg.attention.num_layers and calls["triton"] > 0


def test_float32_pools_and_compute_stay_close(pair):
    ref, cfg, w = pair
    ids = _ids(4)
    want = _reference_logits(ref, ids)
    w32 = type(w).load({k: v.float() if v.is_floating_point() else v for k, v in ref.state_dict().items()},
                       cfg=cfg)
    d = Driver(cfg, w32, dtype=torch.float32)
    d.admit(1)
    got = torch.cat([d.logits(d.step([1], [ids[:9]])), d.logits(d.step([1], [ids[9:]]))])
    assert got.dtype == torch.float32
    _close(got.double(), want, 1e-4)


def test_greedy_tokens_match_generate(pair):
    ref, cfg, w = pair
    prompt = _ids(5, 6)
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=12, do_sample=False)[0, 6:]
    d = Driver(cfg, w)
    d.admit(0)
    nxt = d.logits(d.step([0], [prompt]))[-1].argmax()
    got = [int(nxt)]
    for _ in range(11):
        nxt = d.logits(d.step([0], [nxt.view(1)]))[-1].argmax()
        got.append(int(nxt))
    assert got == want.tolist()


def test_backend_declares_what_it_supports():
    caps = DSV4Backend.capabilities
    assert caps.forward_modes == {ForwardMode.EXTEND, ForwardMode.DECODE}
    assert caps.graph_level(ForwardMode.DECODE) == CudaGraphLevel.SINGLE_TOKEN_DECODE and caps.graph_impls == {"triton"}
    assert all(caps.graph_level(m) == CudaGraphLevel.NEVER for m in ForwardMode if m != ForwardMode.DECODE)
    assert not caps.sparse and caps.builds_own_kv_indices


def test_backend_implements_the_model_protocol(pair):
    _, cfg, w = pair
    assert isinstance(Driver(cfg, w).backend, DSV4AttentionBackend)


def test_window_ring_keeps_latest_window():
    ring = SlidingWindowKV([0, 5], max_requests=2, window=4, head_dim=3, dtype=torch.float64,
                           device=torch.device("cpu"))
    rows = torch.arange(10, dtype=torch.float64)[:, None].expand(10, 3)
    ring.write(5, 1, 0, rows[:7])  # 7 tokens at once: only 3..6 kept
    assert ring.read(5, 1, 3, 7)[:, 0].tolist() == [3, 4, 5, 6]
    ring.write(5, 1, 7, rows[7:8])
    assert ring.read(5, 1, 4, 8)[:, 0].tolist() == [4, 5, 6, 7]
    with pytest.raises(IndexError):
        ring.read(5, 1, 2, 8)
    with pytest.raises(KeyError, match="layer_id=1"):
        ring.ring(1)


def test_compressed_pool_pages_and_exhaustion():
    pool = CompressedKVPool(rate=4, layer_ids=[2], dims={"kv": 2}, num_pages=4, page_size=2, max_requests=2,
                            max_entries=8, dtype=torch.float64, device=torch.device("cpu"))
    pool.open(0)
    pool.reserve(0, 11)  # 2 entries: one page
    assert pool.pages.available == 2
    pool.write(2, "kv", 0, 0, torch.tensor([[1.0, 1], [2, 2]]))
    pool.reserve(0, 16)  # 4 entries: a second page
    pool.write(2, "kv", 0, 2, torch.tensor([[3.0, 3], [4, 4]]))
    assert pool.gather(2, "kv", 0, 4)[:, 0].tolist() == [1, 2, 3, 4]
    assert 0 not in (pool.slots(0, 0, 4) // 2).tolist()  # never the padding page
    pool.open(1)
    with pytest.raises(PoolExhausted):
        pool.reserve(1, 4 * 2 * 2)  # 2 pages, 1 free
    pool.release(0)
    assert pool.pages.available == 3
