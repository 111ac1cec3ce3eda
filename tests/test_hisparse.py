"""HiSparse: the coordinator's swap-in against a float64 oracle, eviction leaves results unchanged, and every
host and device slot comes back when requests finish or are retracted."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from mla_harness import KV_LORA, ROPE, rel_err

import containers
from runtime.app.parity import compare
from runtime.core.batch import ForwardMode, make_batch
from runtime.core.kv_pool import MLAKVPool, PageAllocator, ReqToTokenPool, TokenSlots
from runtime.core.parallel import SingleRank
from runtime.core.sparse import OffloadedRows
from runtime.engine.hisparse import HiSparseCoordinator

W = KV_LORA + ROPE
LAYERS = [0, 1]
SM_SCALE = 0.07


def make_coordinator(top_k: int, buf: int, page_size: int = 4, num_pages: int = 96, ratio: float = 2.0,
                     max_requests: int = 6, max_context: int = 256):
    r2t = ReqToTokenPool(max_requests, max_context, torch.device("cpu"))
    slots = TokenSlots(r2t, PageAllocator(num_pages, page_size))
    kv = MLAKVPool(LAYERS, num_pages, page_size, KV_LORA, ROPE, torch.float32, torch.device("cpu"))
    c = HiSparseCoordinator(r2t, slots, top_k, buf, ratio, torch.device("cpu"), SingleRank(torch.device("cpu")),
                            rows=OffloadedRows.latent(kv), layer_ids=LAYERS)
    return c, kv


class Requests:
    """Requests prefilled through the coordinator; ``rows[layer][rid]`` keeps every token's latent row by
    position (the oracle's copy, independent of where the runtime put it)."""

    def __init__(self, c: HiSparseCoordinator, kv: MLAKVPool, lengths: list[int], gen: torch.Generator):
        self.c, self.kv, self.gen = c, kv, gen
        self.row = [c.open() for _ in lengths]
        self.len = list(lengths)
        self.rows = {layer: [torch.randn(n, W, generator=gen) for n in lengths] for layer in LAYERS}
        locs = c.reserve_many([(r, 0, n) for r, n in zip(self.row, lengths)])
        batch = make_batch(ForwardMode.EXTEND, self.row, [0] * len(lengths), lengths, locs, torch.device("cpu"))
        c.begin_step(batch)
        for layer in LAYERS:
            new = torch.cat(self.rows[layer])
            kv.flat(layer)[batch.out_cache_loc] = new  # the model's prefill write
            c.store_new_tokens(layer, batch, new, c.new_token_slots(batch))

    def decode_step(self, pick, freed_pages_to_nan: bool = True):
        """One decode step: a new token per request, then per layer ``pick(b, visible) -> positions`` as the
        indexer's selection; returns [(layer, batch, topk, locs)]."""
        locs = self.c.reserve_many([(r, n, n + 1) for r, n in zip(self.row, self.len)])
        batch = make_batch(ForwardMode.DECODE, self.row, self.len, [1] * len(self.row), locs, torch.device("cpu"))
        self.c.begin_step(batch)
        if freed_pages_to_nan:  # the device pages went back to the allocator: HiSparse must never read them
            for layer in LAYERS:
                self.kv.flat(layer).fill_(float("nan"))
        out = []
        for layer in LAYERS:
            new = torch.randn(len(self.row), W, generator=self.gen)
            for b in range(len(self.row)):
                self.rows[layer][b] = torch.cat([self.rows[layer][b], new[b : b + 1]])
            self.c.store_new_tokens(layer, batch, new, self.c.new_token_slots(batch))
            k = self.c.top_k
            topk = torch.full((len(self.row), k), -1, dtype=torch.int32)
            for b, n in enumerate(self.len):
                chosen = pick(b, n + 1)
                topk[b, torch.randperm(k, generator=self.gen)[: len(chosen)]] = chosen.to(torch.int32)
            out.append((layer, batch, topk, self.c.swap_in(batch, topk, layer)))
        self.len = [n + 1 for n in self.len]
        return out


def oracle(q_nope, q_pe, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 [H, 512]: softmax attention of one query over ``rows[positions]``."""
    kv = rows[positions.long()].double()
    s = (q_nope.double() @ kv[:, :KV_LORA].T + q_pe.double() @ kv[:, KV_LORA:].T) * SM_SCALE
    return torch.softmax(s, dim=-1) @ kv[:, :KV_LORA]


def check_step(reqs: Requests, steps, gen) -> None:
    from backends.kernels.sparse.sparse_mla_decode import sparse_mla_decode_reference

    for layer, _batch, topk, locs in steps:
        b, heads = topk.shape[0], 3
        q_nope, q_pe = torch.randn(b, heads, KV_LORA, generator=gen), torch.randn(b, heads, ROPE, generator=gen)
        assert ((locs >= 0) == (topk >= 0)).all()
        out = sparse_mla_decode_reference(q_nope, q_pe, reqs.c.device_rows(layer), locs, SM_SCALE)
        for i in range(b):
            chosen = topk[i][topk[i] >= 0]
            assert rel_err(out[i], oracle(q_nope[i], q_pe[i], reqs.rows[layer][i], chosen)) < 1e-5


def random_pick(gen, k):
    def pick(b, visible):
        return torch.randperm(visible, generator=gen)[: min(k, visible)]
    return pick


@pytest.mark.parametrize("buf", [64, 8])  # 64 >= every context (nothing evicted); 8 == top_k (heavy eviction)
def test_swap_in_equals_attention_over_the_selected_tokens(buf):
    gen = torch.Generator().manual_seed(7)
    c, kv = make_coordinator(top_k=8, buf=buf)
    reqs = Requests(c, kv, [1, 7, 16, 23], gen)  # one token, odd, a page boundary (page 4), past top_k
    for _ in range(4):
        check_step(reqs, reqs.decode_step(random_pick(gen, 8)), gen)
    st = c.stats()
    assert st["hits"] + st["swap_ins"] == sum(min(8, n) for n0 in (1, 7, 16, 23) for n in range(n0 + 1, n0 + 5)) * 2
    if buf == 64:  # a position is swapped in at most once: misses <= distinct positions ever selected
        assert st["swap_ins"] <= sum(n0 + 4 for n0 in (1, 7, 16, 23)) * 2


def test_eviction_only_grows_swap_counts():
    counts = {}
    for buf in (64, 8):
        gen = torch.Generator().manual_seed(11)
        c, kv = make_coordinator(top_k=8, buf=buf)
        reqs = Requests(c, kv, [30, 45], gen)
        for _ in range(6):
            check_step(reqs, reqs.decode_step(random_pick(gen, 8)), gen)
        counts[buf] = c.stats()
    assert counts[8]["swap_ins"] > counts[64]["swap_ins"] > 0
    assert counts[8]["hits"] + counts[8]["swap_ins"] == counts[64]["hits"] + counts[64]["swap_ins"]


def test_repeated_selection_hits_and_recent_tokens_stay():
    gen = torch.Generator().manual_seed(3)
    c, kv = make_coordinator(top_k=8, buf=16)
    reqs = Requests(c, kv, [40], gen)
    fixed = torch.tensor([0, 5, 9, 17, 22, 31, 38, 39])
    reqs.decode_step(lambda b, visible: fixed)
    before = c.stats()
    assert before["swap_ins"] == 2 * 8 and before["hits"] == 0  # first step: everything from the host
    check_step(reqs, reqs.decode_step(lambda b, visible: fixed), gen)
    after = c.stats()
    assert after["swap_ins"] == before["swap_ins"] and after["hits"] == 2 * 8  # second step: all hits
    newest = lambda b, visible: torch.tensor([visible - 1])  # noqa: E731  the token just mapped in
    check_step(reqs, reqs.decode_step(newest), gen)
    assert c.stats()["swap_ins"] == after["swap_ins"]


def test_release_returns_every_slot():
    c, kv = make_coordinator(top_k=8, buf=8)
    start = c.free_counts()
    gen = torch.Generator().manual_seed(5)
    reqs = Requests(c, kv, [13, 30, 2], gen)
    during_prefill = c.free_counts()
    assert during_prefill["device_pages"] < start["device_pages"] and during_prefill["host_pages"] < start["host_pages"]
    reqs.decode_step(random_pick(gen, 8))
    after_first_decode = c.free_counts()
    assert after_first_decode["device_pages"] == start["device_pages"]  # prefill pages returned, KV on the host
    assert after_first_decode["buffer_slots_held"] > 0
    for row in reqs.row:
        c.release(row)
    assert c.free_counts() == start


def _run(*overrides):
    rt = containers.build(compose_config("+deploy=cpu_dsa_hisparse", *overrides))
    return rt, rt.engine.run()


@pytest.fixture(scope="module")
def off():
    """The same sparse model with everything in the paged device pool (no HiSparse)."""
    return _run("hisparse=off", "check=off")[1]


def test_engine_outputs_do_not_depend_on_the_device_buffer_size(off):
    runs = {buf: _run(f"hisparse.device_buffer_size={buf}") for buf in (8, 1024)}
    for buf, (_rt, res) in runs.items():
        assert res.outputs == off.outputs, buf
        assert compare(res, off, "float32").max_rel_err < 1e-5
    tiny, big = (runs[b][0].container.hisparse_coordinator().stats() for b in (8, 1024))
    assert tiny["swap_ins"] > big["swap_ins"] > 0 and tiny["hits"] < big["hits"]
    assert tiny["hits"] + tiny["swap_ins"] == big["hits"] + big["swap_ins"]


def test_top_k_really_selects_a_subset(off):
    sparse = off
    _, wide = _run("hisparse=off", "check=off", "model.index_topk=1024")  # >= every context: dense attention
    assert compare(sparse, wide, "float32").max_rel_err > 1e-3


def test_finish_and_retraction_return_every_host_and_device_slot():
    # host pool = device pool (ratio 1), and device pages return after prefill: more requests are admitted
    # than the host holds, so decode runs out of host pages and the engine retracts.
    small = ("kv.num_pages=40", "hisparse.host_to_device_ratio=1.0", "workload.max_running_requests=6")
    for topk in ([], ["model.index_topk=80", "hisparse.top_k=80", "hisparse.device_buffer_size=80"]):
        rt, res = _run(*small, *topk)
        c = rt.container.hisparse_coordinator()
        assert res.retracted > 0 and res.lost == 0 and res.finished == rt.config["workload"]["num_requests"]
        assert c.free_counts() == {"host_pages": c.host_allocator.capacity, "rows": rt.config["kv"]["max_requests"],
                                   "device_pages": c.kv_allocator.pages.capacity, "buffer_slots_held": 0}
    # A retracted request's recomputed (sparse) prefill selects what its decode steps selected: same tokens as a
    # run that never retracts (at top-k 80 >= every context here; tests/test_dsa_sparse_prefill.py checks top-k 8).
    _, roomy = _run("workload.max_running_requests=6", *topk)
    assert roomy.retracted == 0 and roomy.outputs == res.outputs
