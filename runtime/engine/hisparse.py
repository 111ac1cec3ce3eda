"""HiSparse: the latent KV of sparse layers lives in pinned host memory; each request keeps a small device buffer
of the tokens its indexer selected recently.

Lifecycle of a request (every step is host-side bookkeeping plus device work queued on the current stream):

* **admission / prefill**: the engine reserves token slots through the coordinator, which hands out device
  pages (``kv_allocator``, the sparse prefill reads them) and, page for page, host pages; ``host_table`` maps
  each token position to its host slot. Each prefill chunk's latent rows are written through to the host pool
  as they are computed (``store_new_tokens``: a kernel writing pinned memory, asynchronous), so when prefill
  ends the host already holds the whole prompt.
* **first decode step**: ``begin_step`` returns the request's device pages to the allocator. Nothing waits:
  every later use of those pages is a kernel queued after the write-through on the same stream.
* **each decode step, per sparse layer**: the newest token's row goes into the device buffer (least recently
  used slot) and to its host slot (``store_new_tokens``); ``swap_in`` matches the indexer's top-k positions
  against the buffer (hits stay), copies misses from the host pool into the least recently used slots that
  were not hit (GPU-driven gather, ``backends/kernels/sparse/host_gather.py``) and returns device locations. No host
  sync, fixed shapes: CUDA-graph safe. Decode tokens take no device page (their ``out_cache_loc`` is slot 0 of
  the padding page); all of a model's attention layers must be sparse (validation).
* **finish / retraction**: ``release`` returns host pages, device pages and the buffer.

DeepSeek-V4 (``rows`` = :meth:`OffloadedRows.csa_entries`): the host rows are the CSA layers' compressed entries,
keyed by entry id (one per ``csa_rate`` tokens), host pages of ``ceil(page_size / rate)`` entries. The wrapped
allocator is the V4 one (:class:`runtime.core.dsv4_slots.DSV4TokenSlots`) and its pages are never returned early
(they carry the HCA entries and the indexer keys, read every step). The compressors write closed windows' entries
with ``store_rows``; extend reads its selections straight from the host (``read_rows``); decode goes through
``swap_in`` with entry ids as the keys, exactly as V3.2 does with token positions.

To the engine the coordinator *is* the token allocator (``open`` / ``pages_needed`` / ``reserve_many`` /
``release`` / ``pages`` of :class:`runtime.core.kv_pool.TokenSlots`): a step is admitted only if both pools hold it,
and host exhaustion raises :class:`PoolExhausted` where the engine already retracts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.device import to_device
from runtime.core.errors import PoolExhausted
from runtime.core.kv_pool import PageAllocator, ReqToTokenPool, TokenSlots
from runtime.core.parallel import SingleRank, TPGroup
from runtime.core.sparse import OffloadedRows

PADDING_SLOT = 0  # slot 0 is on the padding page of both pools


def host_page_count(device_pages: int, host_to_device_ratio: float) -> int:
    """Pages of the host pool: ``host_to_device_ratio`` x the device pool's usable pages, plus padding page 0."""
    return 1 + math.ceil((device_pages - 1) * host_to_device_ratio)


@dataclass(frozen=True)
class PoolCapacity:
    """The ``pages`` the engine reads: a prefill chunk takes as many host pages as device pages (both pools
    are paged alike from position 0), so what is available is the smaller of the two."""

    device: PageAllocator
    host: PageAllocator

    @property
    def available(self) -> int:
        return min(self.device.available, self.host.available)

    @property
    def capacity(self) -> int:
        return self.device.capacity

    @property
    def page_size(self) -> int:
        return self.device.page_size


class HiSparseCoordinator:
    """Host KV pool, per-request device buffers, and the token allocator the engine uses when HiSparse is on.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
    kv_allocator : TokenSlots or DSV4TokenSlots
        Device pages and the request table; wrapped, so the engine reserves both pools at once.
    top_k : int
        Tokens the indexer selects per query (columns of ``swap_in``'s input).
    device_buffer_size : int
        Device slots per request and sparse layer (>= top_k).
    host_to_device_ratio : float
        Host pool pages / device pool pages (>= 1).
    device : torch.device
    tp_group : SingleRank or TPGroup
        The tensor-parallel group. Each rank owns a coordinator over the full latent KV (MLA's cache is the same
        for every head, so every rank holds all of it) and makes the same swap-in decisions without exchanging
        anything: the indexer is replicated and its inputs (hidden states after an all-reduce, which gives every
        rank the same bits) are equal, so its top-k, and with it every hit, miss and eviction, are equal. Nothing
        is sent per step; :meth:`disagreement` gathers every rank's :meth:`agreement_digest` (counters and
        checksums of the buffers' position and LRU tables) once, at the end of the run, which fails if they differ.
    rows : OffloadedRows
        What a host row is: width, dtype, tokens per row, host page size, whether prefill pages return early.
    layer_ids : list of int
        The sparse layers (V4: the CSA layers).

    Attributes
    ----------
    host_pool : torch.Tensor
        [num_sparse_layers, host_slots, row_dim] model dtype, pinned when ``device`` is CUDA.
    host_table : torch.Tensor
        [max_requests + 1, max_context // tokens_per_row] int32 on ``device``: host slot of each request row's
        keys (token positions; V4 entry ids) (V3.2: the indexer's slot table: indexer keys are stored by host
        slot, so they outlive device pages).
    device_kv : list of torch.Tensor
        Per sparse layer [(max_requests + 1) * device_buffer_size, row_dim]: request row ``r`` owns rows
        ``r * device_buffer_size ...`` (the padding row too, for padded CUDA-graph entries).
    buf_pos : torch.Tensor
        [num_sparse_layers, max_requests + 1, device_buffer_size] int32: key (token position, V4 entry id) held
        by each buffer slot, -1 empty.
    buf_stamp : torch.Tensor
        [num_sparse_layers, max_requests + 1, device_buffer_size] int64: position of the query that last used
        the slot (the LRU clock: a request's decode positions only grow), -1 empty.
    """

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_allocator: TokenSlots,
        top_k: int,
        device_buffer_size: int,
        host_to_device_ratio: float,
        device: torch.device,
        tp_group: SingleRank | TPGroup,
        *,
        rows: OffloadedRows,
        layer_ids: list[int],
    ):
        problems = []
        if not 1 <= top_k <= device_buffer_size:
            problems.append(f"top_k={top_k}, device_buffer_size={device_buffer_size}: expected 1 <= top_k <= "
                            "device_buffer_size. Fix: set hisparse.device_buffer_size >= hisparse.top_k")
        if host_to_device_ratio < 1:
            problems.append(f"host_to_device_ratio={host_to_device_ratio}: expected >= 1. Fix: set it to 4")
        if problems:
            raise ValueError("HiSparseCoordinator: " + "; ".join(problems))
        self.req_to_token_pool, self.kv_allocator, self.group = req_to_token_pool, kv_allocator, tp_group
        self.top_k, self.buf = int(top_k), int(device_buffer_size)
        self.device, self.layer_ids = torch.device(device), list(layer_ids)
        self._layer = {layer: i for i, layer in enumerate(self.layer_ids)}
        self.rows, self.per_row = rows, int(rows.tokens_per_row)
        self.page_size = kv_allocator.page_size  # token pages (the engine's unit)
        self.host_page_size = int(rows.rows_per_page)  # host pages, in rows
        self.padding_row = req_to_token_pool.padding_row
        self.host_allocator = PageAllocator(host_page_count(kv_allocator.pages.num_pages, host_to_device_ratio),
                                            self.host_page_size)
        self.row_bytes = rows.row_dim * rows.dtype.itemsize
        n, table_rows = len(self.layer_ids), req_to_token_pool.max_requests + 1
        host_slots = self.host_allocator.num_pages * self.host_page_size
        self.host_pool = torch.zeros(n, host_slots, rows.row_dim, dtype=rows.dtype,
                                     pin_memory=self.device.type == "cuda")
        keys = max(1, req_to_token_pool.max_context // self.per_row)
        self.host_table = torch.zeros(table_rows, keys, dtype=torch.int32, device=device)
        self.device_kv = [torch.zeros(table_rows * self.buf, rows.row_dim, dtype=rows.dtype, device=device)
                          for _ in range(n)]
        self.buf_pos = torch.full((n, table_rows, self.buf), -1, dtype=torch.int32, device=device)
        self.buf_stamp = torch.full((n, table_rows, self.buf), -1, dtype=torch.int64, device=device)
        self._counters = torch.zeros(2, dtype=torch.int64, device=device)  # hits, misses (real requests)
        self._host_pages: dict[int, list[int]] = {}
        self._host_only: set[int] = set()  # rows past prefill: device pages returned, KV on the host
        self.decode_steps = 0
        self.host_rows_written = 0

    # ------------------------------------------------------------------ the engine's token allocator
    @property
    def pages(self) -> PoolCapacity:
        return PoolCapacity(self.kv_allocator.pages, self.host_allocator)

    @property
    def host_slots(self) -> int:
        return self.host_pool.shape[1]

    def open(self) -> int:
        row = self.kv_allocator.open()
        self._host_pages[row] = []
        return row

    def pages_needed(self, row: int, new_len: int) -> int:
        """Pages a prefill chunk of ``row`` up to ``new_len`` takes from each pool (0 once the row decodes)."""
        return 0 if row in self._host_only else self.kv_allocator.pages_needed(row, new_len)

    def reserve(self, row: int, old_len: int, new_len: int) -> torch.Tensor:
        return torch.tensor(self.reserve_many([(row, old_len, new_len)]), dtype=torch.int64)

    def reserve_many(self, spans: list[tuple[int, int, int]]) -> list[int]:
        """Device slots for the spans (slot 0 for rows past prefill) and host slots for the keys the spans'
        tokens bring (into ``host_table``, one device write). Checks both pools first: on exhaustion nothing is
        taken."""
        ps, per = self.host_page_size, self.per_row
        grows = [-(-(new // per) // ps) - len(self._host_pages[row]) for row, _, new in spans]
        need = sum(g for g in grows if g > 0)
        if need > self.host_allocator.available:
            raise PoolExhausted("HiSparse host KV pool", need, self.host_allocator.available, "pages")
        device_slots = iter(self.kv_allocator.reserve_many([s for s in spans if s[0] not in self._host_only]))
        width = self.host_table.shape[1]
        slots: list[int] = []
        index: list[int] = []
        host: list[int] = []
        for (row, old, new), grow in zip(spans, grows):
            pages = self._host_pages[row]
            if grow > 0:
                pages.extend(self.host_allocator.alloc(grow))
            pos = np.arange(old // per, new // per)  # keys: token positions, or the entries that close
            host.extend((np.asarray(pages, dtype=np.int64)[pos // ps] * ps + pos % ps).tolist())
            index.extend((row * width + pos).tolist())
            if row in self._host_only:
                slots.extend([PADDING_SLOT] * (new - old))
            else:
                slots.extend(next(device_slots) for _ in range(new - old))
        if host:
            idx, val = to_device(torch.tensor([index, host], dtype=torch.int64), self.device)
            self.host_table.view(-1)[idx] = val.to(torch.int32)
        return slots

    def release(self, row: int) -> None:
        """Finish or retraction: host pages, device pages, the buffer and the request row all return."""
        self.host_allocator.free(self._host_pages.pop(row))
        self._host_only.discard(row)
        self.buf_pos[:, row] = -1
        self.buf_stamp[:, row] = -1
        self.kv_allocator.release(row)

    # --------------------------------------------------------------------------- per step (host)
    def begin_step(self, batch: ForwardBatch) -> None:
        """Host bookkeeping before a step's kernels (eager, or before a graph replay): a DECODE step returns
        the device pages of requests that just finished prefill (their KV was written through to the host)."""
        rows = [r for r in batch.req_pool_indices_cpu.tolist() if r != self.padding_row]
        one_per_token = self.per_row == 1  # else store_rows counts the entries it writes
        if batch.mode == ForwardMode.DECODE:
            if self.rows.release_prefill_pages:
                for row in rows:
                    if row not in self._host_only:
                        self.kv_allocator.release_pages(row)
                        self._host_only.add(row)
            self.decode_steps += 1
            self.host_rows_written += len(rows) * len(self.layer_ids) * one_per_token
        else:
            self.host_rows_written += batch.num_tokens * len(self.layer_ids) * one_per_token

    # ------------------------------------------------------------------- per layer (device, graph-safe)
    def new_token_slots(self, batch: ForwardBatch) -> torch.Tensor:
        """[T] int64 on the device: host slot of each of the step's new tokens (where its indexer key goes)."""
        if batch.mode == ForwardMode.DECODE:
            rows = batch.req_pool_indices
        else:
            counts = batch.qo_indptr[1:] - batch.qo_indptr[:-1]
            rows = torch.repeat_interleave(batch.req_pool_indices, counts, output_size=batch.num_tokens)
        return self.host_table[rows, batch.positions].long()

    def device_rows(self, layer_id: int) -> torch.Tensor:
        """[(max_requests + 1) * device_buffer_size, kv_lora + rope]: what ``swap_in``'s locations address."""
        return self.device_kv[self._layer[layer_id]]

    def store_new_tokens(self, layer_id: int, batch: ForwardBatch, kv_rows: torch.Tensor,
                         host_slots: torch.Tensor) -> None:
        """The step's new latent rows (kv_rows [T, kv_lora + rope], model dtype) of sparse layer ``layer_id``:
        written to their host slots (host_slots [T] int64, from :meth:`new_token_slots`); in DECODE also
        mapped into the request's device buffer, in its least recently used slot."""
        from backends.kernels.sparse.host_gather import scatter_rows_to_host

        li = self._layer[layer_id]
        t = kv_rows.shape[0]
        src = torch.arange(t, device=kv_rows.device)
        if batch.mode == ForwardMode.DECODE:
            req, pos = batch.req_pool_indices, batch.positions
            victim = self.buf_stamp[li][req].argmin(dim=1)  # empty slots (-1) first, else least recently used
            self.device_kv[li].index_copy_(0, req * self.buf + victim, kv_rows)
            self.buf_pos[li][req, victim] = pos.to(torch.int32)
            self.buf_stamp[li][req, victim] = pos
            src = torch.where(req == self.padding_row, -1, src)  # padded graph entries write nothing
        scatter_rows_to_host(kv_rows, src, self.host_pool[li], host_slots)

    def store_rows(self, layer_id: int, row: int, first: int, values: torch.Tensor) -> None:
        """Rows ``first .. first + n - 1`` (keys) of request row ``row``: values [n, row_dim] to their host slots
        (host loop, outside graphs: V4's compressors call it with the entries whose windows closed)."""
        from backends.kernels.sparse.host_gather import scatter_rows_to_host

        n = values.shape[0]
        if n:
            slots = self.host_table[row, first: first + n].long()
            src = torch.arange(n, device=values.device)
            scatter_rows_to_host(values.to(self.rows.dtype).contiguous(), src, self.host_pool[self._layer[layer_id]],
                                 slots)
            self.host_rows_written += n

    def read_rows(self, layer_id: int, row: int, keys: torch.Tensor) -> torch.Tensor:
        """keys [n, K] int64 of request row ``row`` (-1 padding) -> [n, K, row_dim] on the device, gathered
        from the host pool (zeros where padded). For extend, where each query has its own selection."""
        from backends.kernels.sparse.host_gather import gather_rows_from_host

        n, k = keys.shape
        out = torch.zeros(n * k, self.rows.row_dim, dtype=self.rows.dtype, device=self.device)
        flat = keys.reshape(-1).to(self.device)
        src = torch.where(flat >= 0, self.host_table[row, flat.clamp_min(0)].long(), -1)
        gather_rows_from_host(self.host_pool[self._layer[layer_id]], src, out,
                              torch.arange(n * k, device=self.device))
        return out.view(n, k, -1)

    def swap_in(self, batch: ForwardBatch, topk_indices: torch.Tensor, layer: int) -> torch.Tensor:
        """Device locations of the selected tokens of a DECODE batch, copying the misses in from the host.

        Parameters
        ----------
        batch : DECODE ForwardBatch (one query per request)
        topk_indices : [B, K] int32 keys: token positions (V4: entry ids), -1 padding; K <= device_buffer_size
        layer : sparse layer id

        Returns
        -------
        locs : [B, K] int32 rows of :meth:`device_rows` (-1 where ``topk_indices`` is -1).
        """
        from backends.kernels.sparse.host_gather import gather_rows_from_host

        li, buf = self._layer[layer], self.buf
        req, now = batch.req_pool_indices, batch.positions
        b = req.shape[0]
        want = topk_indices.to(torch.int32).contiguous()
        valid = want >= 0
        held = self.buf_pos[li][req]  # [B, buf]
        held_sorted, order = held.sort(dim=1)
        at = torch.searchsorted(held_sorted, want).clamp_max(buf - 1)
        hit = valid & (held_sorted.gather(1, at) == want)
        hit_slot = order.gather(1, at)
        # misses take the least recently used slots among those not hit this step (empty ones first)
        dummy = torch.full_like(hit_slot, buf)
        protected = torch.zeros(b, buf + 1, dtype=torch.bool, device=want.device)
        protected.scatter_(1, torch.where(hit, hit_slot, dummy), True)
        stamp = self.buf_stamp[li][req]
        lru = torch.where(protected[:, :buf], torch.iinfo(torch.int64).max, stamp).argsort(dim=1)
        miss = valid & ~hit
        victim = lru.gather(1, (miss.cumsum(dim=1) - 1).clamp(0, buf - 1))
        slot = torch.where(hit, hit_slot, victim)
        locs = req[:, None] * buf + slot
        src = self.host_table[req[:, None], want.clamp_min(0).long()].long()
        gather_rows_from_host(self.host_pool[li], torch.where(miss, src, -1).view(-1), self.device_kv[li],
                              locs.view(-1))
        held = torch.cat([held, held.new_zeros(b, 1)], dim=1).scatter_(1, torch.where(miss, victim, dummy), want)
        stamp = torch.cat([stamp, stamp.new_zeros(b, 1)], dim=1)
        stamp.scatter_(1, torch.where(valid, slot, dummy), now[:, None].expand(b, want.shape[1]).contiguous())
        self.buf_pos[li].index_copy_(0, req, held[:, :buf])
        self.buf_stamp[li].index_copy_(0, req, stamp[:, :buf])
        real = (req != self.padding_row)[:, None]
        self._counters += torch.stack([(hit & real).sum(), (miss & real).sum()])
        return torch.where(valid, locs, -1).to(torch.int32)

    # -------------------------------------------------------------------------------- the report
    @property
    def device_bytes(self) -> int:
        """Device memory the coordinator holds: buffers, their position/LRU tables, the host-slot table."""
        tensors = [*self.device_kv, self.buf_pos, self.buf_stamp, self.host_table]
        return sum(t.numel() * t.element_size() for t in tensors)

    def stats(self) -> dict:
        """Counters (one device read) and memory, for the report."""
        hits, misses = (int(v) for v in self._counters.tolist())
        device_buffer = sum(t.numel() * t.element_size() for t in self.device_kv)
        meta = sum(t.numel() * t.element_size() for t in (self.buf_pos, self.buf_stamp, self.host_table))
        return {
            "host_kv_bytes": self.host_pool.numel() * self.host_pool.element_size(),
            "host_tokens": self.host_slots - self.host_page_size,  # host rows without the padding page
            "host_tokens_per_row": self.per_row,
            "row_bytes": self.row_bytes,
            "layers": len(self.layer_ids),
            "device_buffer_bytes": device_buffer,
            "device_metadata_bytes": meta,
            "swap_ins": misses,
            "hits": hits,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "decode_steps": self.decode_steps,
            "bytes_copied_per_decode_step": misses * self.row_bytes / self.decode_steps if self.decode_steps else 0.0,
            "host_bytes_written": self.host_rows_written * self.row_bytes,
        }

    def agreement_digest(self) -> tuple[int, ...]:
        """Hits, misses, and checksums of every buffer's positions and LRU stamps (one device read): equal on
        every tensor-parallel rank iff they made the same swap-in decisions (checked at the end of a run)."""
        pos = self.buf_pos.long()
        weights = torch.arange(1, pos[0].numel() + 1, device=pos.device).view(pos.shape[1:])
        sums = torch.stack([(pos * weights).sum(), (self.buf_stamp * weights).sum()])
        return tuple(int(v) for v in torch.cat([self._counters, sums]).tolist())

    def disagreement(self) -> str | None:
        """None when every tensor-parallel rank made the same swap-in decisions, else what differs (a collective:
        every rank calls it)."""
        digests = self.group.gather_objects(self.agreement_digest())
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        return None if not bad else (f"ranks {bad} made different HiSparse swap-in decisions than rank 0 "
                                     f"(hits, misses, position and LRU checksums: {digests})")

    def free_counts(self) -> dict:
        """Free host pages, device pages and request rows, and the buffer slots still holding a token (for
        tests: after every request finished they are back to the start)."""
        return {"host_pages": self.host_allocator.available, "device_pages": self.kv_allocator.pages.available,
                "rows": self.req_to_token_pool.available, "buffer_slots_held": int((self.buf_pos[:, : self.padding_row] >= 0).sum())}
