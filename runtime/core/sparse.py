"""What a sparse-attention backend receives: the interfaces of the indexer's key cache and of the HiSparse
coordinator.

Backends stand on ``runtime.core`` only, so they are typed against these Protocols; the implementations live
above them (:class:`runtime.model.indexer.IndexKeyPool`, :class:`runtime.engine.hisparse.HiSparseCoordinator`)
and the container injects them. A fake that implements the same methods can be swapped in by a test.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from runtime.core.batch import ForwardBatch


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
    """Host-offloaded sparse KV (HiSparse): the latent rows live in a host pool; a decode step swaps the rows the
    indexer selected into a per-request device buffer.

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
        """[(max_requests + 1) * device_buffer_size, kv_lora + rope] the device buffer of a sparse layer."""
        ...
