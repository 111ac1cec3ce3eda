"""The engine's token allocator for a DeepSeek-V4 model.

V4 keeps no per-token KV: its memory is a window ring per request row (fixed size), compressed-entry pools
(paged) and compressor state per row (:mod:`runtime.core.dsv4_pools`). The engine still counts capacity in
token pages (``kv.num_pages`` x ``kv.page_size``: admission, queueing and retraction decide on them), so this
allocator keeps that ledger with the ordinary :class:`runtime.core.kv_pool.TokenSlots` and moves the V4 pools
along with it:

* ``open``: a request-table row, fresh compressor state and empty entry lists (re-admission after a retraction
  starts from nothing: the engine prefills the request's tokens again);
* ``reserve_many``: token pages first (all or nothing), then every compressed pool's entry pages; the pools are
  sized (:meth:`DSV4Pools.for_token_pages`) so that this second step cannot fail once the first succeeded;
* ``release``: entry pages, token pages and the row.

The slots it returns are token-ledger slots; the V4 model does not read them.
"""

from __future__ import annotations

from runtime.core.dsv4_pools import DSV4Pools
from runtime.core.kv_pool import TokenSlots


class DSV4TokenSlots:
    """What the engine reserves through for a V4 model (the interface of :class:`TokenSlots`)."""

    def __init__(self, token_slots: TokenSlots, pools: DSV4Pools):
        self.tokens, self.pools = token_slots, pools
        self.req_to_token_pool = token_slots.req_to_token_pool
        self.pages, self.page_size = token_slots.pages, token_slots.page_size

    def open(self) -> int:
        row = self.tokens.open()
        self.pools.admit(row)
        return row

    def pages_needed(self, row: int, new_len: int) -> int:
        return self.tokens.pages_needed(row, new_len)

    def reserve_many(self, spans: list[tuple[int, int, int]]) -> list[int]:
        slots = self.tokens.reserve_many(spans)  # raises PoolExhausted and takes nothing when it cannot
        for row, _, new in spans:
            self.pools.reserve(row, new)
        return slots

    def release(self, row: int) -> None:
        self.pools.release(row)
        self.tokens.release(row)
