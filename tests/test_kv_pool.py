"""Pools: pages and rows come back, exhaustion is a typed error that changes nothing."""

from __future__ import annotations

import pytest
import torch

from runtime.core.errors import PoolExhausted
from runtime.core.kv_pool import PADDING_PAGE, MLAKVPool, PageAllocator, ReqToTokenPool, TokenSlots


def test_page_allocator_never_hands_out_the_padding_page():
    pages = PageAllocator(9, 4)
    got = pages.alloc(8)
    assert PADDING_PAGE not in got and sorted(got) == list(range(1, 9))
    with pytest.raises(PoolExhausted) as e:
        pages.alloc(1)
    assert e.value.requested == 1 and e.value.available == 0 and "kv.num_pages" in str(e.value)


def test_token_slots_reserve_release_roundtrip():
    slots = TokenSlots(ReqToTokenPool(4, 64, torch.device("cpu")), PageAllocator(10, 4))
    row = slots.open()
    s1 = slots.reserve(row, 0, 5)
    s2 = slots.reserve(row, 5, 11)
    all_slots = torch.cat([s1, s2])
    assert len(set(all_slots.tolist())) == 11
    assert torch.equal(slots.req_to_token_pool.req_to_token[row, :11].long(), all_slots)
    assert (all_slots // 4 != PADDING_PAGE).all()
    assert slots.pages.available == 9 - 3
    slots.release(row)
    assert slots.pages.available == 9 and slots.req_to_token_pool.available == 4


def test_exhaustion_changes_nothing():
    slots = TokenSlots(ReqToTokenPool(2, 64, torch.device("cpu")), PageAllocator(3, 4))
    row = slots.open()
    slots.reserve(row, 0, 8)
    with pytest.raises(PoolExhausted):
        slots.reserve(row, 8, 9)
    assert slots.pages.available == 0
    slots.open()
    with pytest.raises(PoolExhausted):
        slots.open()


def test_kv_pool_layout_and_roundtrip():
    kv = MLAKVPool([0, 2], num_pages=5, page_size=4, kv_lora_rank=512, qk_rope_head_dim=64,
                   dtype=torch.bfloat16, device=torch.device("cpu"))
    assert kv.buffer(2).shape == (5, 4, 576) and kv.nbytes == 2 * 5 * 4 * 576 * 2
    slots = torch.tensor([5, 17, 6])
    ckv, kpe = torch.randn(3, 512), torch.randn(3, 64)
    kv.write(2, slots, ckv, kpe)
    rows = kv.gather(2, slots)
    assert torch.equal(rows[:, :512], ckv.bfloat16()) and torch.equal(rows[:, 512:], kpe.bfloat16())
    assert kv.buffer(0).abs().sum() == 0


def test_reserve_many_equals_one_by_one_and_fails_atomically():
    def fresh():
        return TokenSlots(ReqToTokenPool(4, 64, torch.device("cpu")), PageAllocator(12, 4))

    a, b = fresh(), fresh()
    rows_a = [a.open() for _ in range(3)]
    rows_b = [b.open() for _ in range(3)]
    spans = [(0, 5), (0, 1), (0, 9)]
    one = torch.cat([a.reserve(r, s, e) for r, (s, e) in zip(rows_a, spans)])
    many = b.reserve_many([(r, s, e) for r, (s, e) in zip(rows_b, spans)])
    assert one.tolist() == many
    assert torch.equal(a.req_to_token_pool.req_to_token, b.req_to_token_pool.req_to_token)
    free = b.pages.available
    with pytest.raises(PoolExhausted):
        b.reserve_many([(rows_b[0], 5, 8), (rows_b[1], 1, 60)])
    assert b.pages.available == free  # nothing taken


def test_padding_row_is_never_handed_out_and_points_at_the_padding_page():
    r2t = ReqToTokenPool(3, 16, torch.device("cpu"))
    rows = [r2t.alloc() for _ in range(3)]
    assert r2t.padding_row == 3 and r2t.padding_row not in rows
    with pytest.raises(PoolExhausted):
        r2t.alloc()
    slots = TokenSlots(ReqToTokenPool(2, 16, torch.device("cpu")), PageAllocator(5, 4))
    for _ in range(2):
        slots.reserve(slots.open(), 0, 8)
    table = slots.req_to_token_pool.req_to_token
    assert (table[slots.req_to_token_pool.padding_row] // 4 == PADDING_PAGE).all()
