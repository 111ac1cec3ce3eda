"""Per-request page tables ("block tables") gathered from the request -> token table, eager and for CUDA graphs.

A part that the kernel backends which take ``[B, W]`` block tables own (composition, not a base class): the
backend builds its tables itself in its metadata step, so it declares ``builds_own_kv_indices``.
"""

from __future__ import annotations

import torch

from runtime.core.batch import ForwardBatch
from runtime.core.kv_pool import ReqToTokenPool


class BlockTables:
    """``[B, W]`` int32 page ids: row b, column k is ``req_to_token[req_b, k * page_size] // page_size``.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
    page_size : int
    align : int
        W is a multiple of it (TRT-LLM-gen wants ``W % (128 / page_size) == 0`` unless told otherwise).

    Columns past a request's ``ceil(seq_len / page_size)`` pages hold whatever the request row holds there (0:
    the padding page); the kernels never read them.

    It also keeps the step's metadata a kernel call reads: ``current`` (the step's table) and ``max_seq_len``
    (the batch's longest in eager steps; ``max_context``, a constant baked into the launch, under CUDA graphs),
    set by :meth:`for_step`, :meth:`for_capture` and :meth:`for_replay`.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, page_size: int, align: int = 1):
        self.req_to_token_pool, self.page_size, self.align = req_to_token_pool, page_size, max(1, align)
        table = req_to_token_pool.req_to_token
        self.max_width = self.width(req_to_token_pool.max_context)
        cols = torch.arange(0, self.max_width * page_size, page_size, device=table.device)
        self._cols = cols.clamp_max(table.shape[1] - 1)
        self._static = torch.zeros(0, self.max_width, dtype=torch.int32, device=table.device)
        self.max_context = req_to_token_pool.max_context
        self.current = torch.zeros(0, 0, dtype=torch.int32)
        self.max_seq_len = 0

    def width(self, max_seq_len: int) -> int:
        """Pages of the longest request, rounded up to ``align``."""
        pages = max(1, -(-max_seq_len // self.page_size))
        return -(-pages // self.align) * self.align

    def gather(self, batch: ForwardBatch, width: int | None = None) -> torch.Tensor:
        """[B, width] int32 on the device (one gather and one division; no host sync)."""
        w = self.width(batch.max_seq_len) if width is None else width
        table = self.req_to_token_pool.req_to_token
        return (table[batch.req_pool_indices[:, None], self._cols[None, :w]] // self.page_size).to(torch.int32)

    # ------------------------------------------------------------------------------------ CUDA graphs
    def init_graph_state(self, max_batch: int) -> None:
        """A static ``[max_batch, max_width]`` table (grown only, so one table serves every graphed mode)."""
        if max_batch > self._static.shape[0]:
            self._static = torch.zeros(max_batch, self.max_width, dtype=torch.int32, device=self._static.device)

    def static(self, batch_size: int) -> torch.Tensor:
        """The static table's first ``batch_size`` rows (what a captured graph reads)."""
        if not 0 < batch_size <= self._static.shape[0]:
            raise ValueError(
                f"block tables: a CUDA-graph batch of {batch_size} requests; expected 1..{self._static.shape[0]} "
                "(the size given to init_graph_state). Fix: call init_graph_state with the largest captured batch.")
        return self._static[:batch_size]

    def refresh(self, batch: ForwardBatch) -> torch.Tensor:
        """Write ``batch``'s pages into the static table in place (before a replay); returns its rows."""
        rows = self.static(batch.batch_size)
        w = self.width(batch.max_seq_len)
        rows[:, :w].copy_(self.gather(batch, w))
        return rows

    # ------------------------------------------------------------------------------- the step's metadata
    def for_step(self, batch: ForwardBatch) -> None:
        """An eager step: the batch's table and its longest sequence (from the host mirror)."""
        self.current, self.max_seq_len = self.gather(batch), batch.max_seq_len

    def for_capture(self, batch_size: int) -> None:
        """A capture: the static table's rows; ``max_context`` as the longest (the captured launch keeps it)."""
        self.current, self.max_seq_len = self.static(batch_size), self.max_context

    def for_replay(self, batch: ForwardBatch) -> None:
        """Before a replay: the batch's pages written into the static table in place."""
        self.current, self.max_seq_len = self.refresh(batch), self.max_context
