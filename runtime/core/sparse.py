"""What a sparse-attention backend receives: the interfaces of the indexer's key cache and of the HiSparse
coordinator.

Backends stand on ``runtime.core`` only, so they are typed against these Protocols; the implementations live
above them (:class:`runtime.model.indexer.IndexKeyPool`, :class:`runtime.engine.hisparse.HiSparseCoordinator`)
and the container injects them. A fake that implements the same methods can be swapped in by a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from runtime.core.batch import ForwardBatch
from runtime.core.dsv4_pools import DSV4Pools
from runtime.core.kv_pool import MLAKVPool


@dataclass(frozen=True)
class OffloadedRows:
    """What the HiSparse coordinator keeps in its host pool, injected by the container.

    Attributes
    ----------
    row_dim : int
        Elements per row (V3.2: the latent row, kv_lora + rope; V4: a compressed CSA entry, head_dim).
    dtype : torch.dtype
    tokens_per_row : int
        Tokens one row stands for: 1 (a latent row per token) or the CSA compression rate (an entry per closed
        window). Host rows are keyed by ``token_position // tokens_per_row``; a request of ``n`` tokens holds
        ``n // tokens_per_row`` of them.
    rows_per_page : int
        Host page size in rows: ``ceil(kv.page_size / tokens_per_row)``, so a request never needs more host
        pages than token pages.
    release_prefill_pages : bool
        V3.2: the device latent pages are read by prefill only, so at the first decode step they
        return to the allocator. V4: the token pages carry the HCA entries and the CSA indexer keys, read at
        every step, so they stay until the request ends.
    """

    row_dim: int
    dtype: torch.dtype
    tokens_per_row: int
    rows_per_page: int
    release_prefill_pages: bool

    @classmethod
    def latent(cls, kv_pool: MLAKVPool) -> OffloadedRows:
        """DeepSeek-V3.2 sparse layers: every token's latent row."""
        return cls(kv_pool.row_dim, kv_pool.dtype, 1, kv_pool.page_size, True)

    @classmethod
    def csa_entries(cls, pools: DSV4Pools, page_size: int) -> OffloadedRows:
        """DeepSeek-V4 CSA layers: the compressed entries the indexer's top-k selects (the HCA entries are
        attended in full every step and the window is a ring: both stay on the device)."""
        rate = pools.spec.csa_rate
        return cls(pools.spec.head_dim, pools.window.dtype, rate, -(-page_size // rate), False)


@runtime_checkable
class IndexKeyCache(Protocol):
    """The indexer keys of every sparse layer, one row per token slot."""

    def buffer(self, layer_id: int) -> torch.Tensor:
        """[num_slots, index_head_dim] keys of sparse layer ``layer_id``."""
        ...

    def write(self, layer_id: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Store ``keys`` [T, index_head_dim] at ``slots`` [T] int64 (device)."""
        ...


@runtime_checkable
class SparseKVCoordinator(Protocol):
    """Host-offloaded sparse KV (HiSparse): the rows (:class:`OffloadedRows`) live in a host pool; a decode step
    swaps the rows the indexer selected into a per-request device buffer.

    Attributes
    ----------
    host_table : torch.Tensor
        [max_requests + 1, max_context] int32 on the device: host slot of each request row's token positions.
    """

    host_table: torch.Tensor

    def begin_step(self, batch: ForwardBatch) -> None:
        """Host-side bookkeeping once per step, before the first layer runs."""
        ...

    def new_token_slots(self, batch: ForwardBatch) -> torch.Tensor:
        """[T] int64 host slots of the step's new tokens."""
        ...

    def store_new_tokens(self, layer_id: int, batch: ForwardBatch, kv_rows: torch.Tensor,
                         host_slots: torch.Tensor) -> None:
        """Write the new tokens' latent rows ``kv_rows`` [T, kv_lora + rope] to the host pool (and, in decode,
        to the device buffer)."""
        ...

    def swap_in(self, batch: ForwardBatch, topk_indices: torch.Tensor, layer: int) -> torch.Tensor:
        """Bring the selected positions ``topk_indices`` [B, top_k] int32 (-1 padding) into the device buffer;
        returns their [B, top_k] int32 row locations in :meth:`device_rows` (-1 padding)."""
        ...

    def device_rows(self, layer_id: int) -> torch.Tensor:
        """[(max_requests + 1) * device_buffer_size, row_dim] the device buffer of a sparse layer."""
        ...

    def store_rows(self, layer_id: int, row: int, first: int, values: torch.Tensor) -> None:
        """Write rows ``first .. first + n - 1`` (keys) of request row ``row`` (values [n, row_dim]) to the host
        pool (V4: the CSA entries whose windows closed in this step)."""
        ...

    def read_rows(self, layer_id: int, row: int, keys: torch.Tensor) -> torch.Tensor:
        """keys [n, K] int64 (-1 padding) of request row ``row`` -> [n, K, row_dim] on the device, copied
        straight from the host pool (V4 extend: many queries per request, each with its own top-k; padding
        rows are zeros)."""
        ...
