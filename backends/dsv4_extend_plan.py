"""The index lists of one DeepSeek-V4 extend step for the Triton extend kernel
(:mod:`backends.kernels.dsv4.dsv4_extend`), built once per step with tensor ops on the batch's device tensors (no loop
per request, no host sync: the only host values used are the batch's host mirrors) and shared by every layer.

Query token ``t`` (absolute position ``t``) of request ``b`` (request-table row ``r``, ``P`` tokens cached before
the step, its new tokens at rows ``s ..`` of the step's ``q`` / ``kv``) sees window positions ``t - W < p <= t``:

* ring part: positions ``max(0, t - W + 1) .. P - 1`` (cached before the chunk), ring slot ``r * W + p % W`` of
  the layer's ring flattened; at most ``W - 1`` of them;
* new-rows part: positions ``max(P, t - W + 1) .. t`` (inside the chunk, ``t`` itself included), row
  ``s + p - P`` of the step's ``kv``; at most ``W``;
* compressed part, per layer kind: HCA: entries ``e < (t + 1) // rate``, read through the entry table's row ``r``
  (:meth:`ExtendPlan.hca_part`); CSA: the indexer's top-k for ``t`` mapped to slots, ``-1`` = none
  (:meth:`ExtendPlan.csa_part`); sliding: none.

Both window lists are left-aligned with their lengths, so the kernel walks only filled tiles. After attention the
step's last ``min(n_b, W)`` rows of each request go to the ring (:attr:`ExtendPlan.ring_src` -> ``ring_dst``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.kernels.dsv4.dsv4_extend import GatherPart
from runtime.core.batch import ForwardBatch
from runtime.core.dsv4_pools import CompressedKVPool


@dataclass(frozen=True)
class ExtendPlan:
    """Device tensors of one extend step (T tokens, window W).

    Attributes
    ----------
    tokens : [T] int32, ``arange(T)`` (each query reads its own row of a per-query index list).
    rows : [T] int64, the request-table row of each token.
    positions : [T] int64, each token's absolute position.
    ring_idx, ring_len : [T, max(W - 1, 1)] int32 ring slots (left-aligned, ``-1`` after), [T] int32 counts.
    new_idx, new_len : [T, W] int32 rows of the step's ``kv`` (left-aligned, ``-1`` after), [T] int32 counts.
    ring_src, ring_dst : [n] int64: kv row -> ring slot of each request's last ``min(n_b, W)`` new rows.
    """

    tokens: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor
    ring_idx: torch.Tensor
    ring_len: torch.Tensor
    new_idx: torch.Tensor
    new_len: torch.Tensor
    ring_src: torch.Tensor
    ring_dst: torch.Tensor

    def window_parts(self, ring: torch.Tensor, kv: torch.Tensor) -> tuple[GatherPart, GatherPart]:
        """ring [rows, W, D] of one layer, kv [T, D] (both in q's dtype) -> (ring part, new-rows part)."""
        return (GatherPart(ring.view(-1, ring.shape[-1]), self.ring_idx, self.tokens, self.ring_len),
                GatherPart(kv, self.new_idx, self.tokens, self.new_len))

    def hca_part(self, pool: CompressedKVPool, layer_id: int) -> GatherPart:
        """Every closed entry ``e < (t + 1) // rate``, through the request's row of the entry table."""
        length = ((self.positions + 1) // pool.rate).to(torch.int32)
        return GatherPart(pool.flat(layer_id, "kv"), pool.table, self.rows.to(torch.int32), length)

    def csa_part(self, pool: CompressedKVPool, layer_id: int, topk: torch.Tensor) -> GatherPart:
        """topk [T, K] entry ids (``-1`` = none) -> the entries' slots, one index row per query."""
        slots = torch.where(topk >= 0, pool.table[self.rows[:, None], topk.clamp_min(0)], -1).to(torch.int32)
        length = torch.full_like(self.tokens, topk.shape[1])
        return GatherPart(pool.flat(layer_id, "kv"), slots.contiguous(), self.tokens, length)

    def empty_part(self, rows: torch.Tensor) -> GatherPart:
        """Sliding layers: no compressed rows (length 0; ``rows`` [S, D] any tensor of the right width)."""
        return GatherPart(rows, self.ring_idx, self.tokens, torch.zeros_like(self.ring_len))


def plan_extend(batch: ForwardBatch, window: int) -> ExtendPlan:
    """The step's window lists and ring writes (see the module docstring)."""
    w, dev, n_tok = int(window), batch.positions.device, batch.num_tokens
    qo = batch.qo_indptr.long()
    ext = qo[1:] - qo[:-1]
    reqs = torch.arange(ext.shape[0], device=dev)
    tok_req = torch.repeat_interleave(reqs, ext, output_size=n_tok)
    pos = batch.positions.long()
    prefix = (batch.seq_lens.long() - ext)[tok_req]
    rows = batch.req_pool_indices.long()[tok_req]
    j = torch.arange(w, device=dev)
    lo = (pos - w + 1).clamp_min(0)
    ring_len = (prefix - lo).clamp_min(0)
    jr = j[: max(w - 1, 1)]
    ring_idx = torch.where(jr[None, :] < ring_len[:, None], rows[:, None] * w + (lo[:, None] + jr[None, :]) % w, -1)
    first = torch.maximum(prefix, pos - w + 1)
    new_len = pos - first + 1
    new_idx = torch.where(j[None, :] < new_len[:, None], (qo[:-1][tok_req] + first - prefix)[:, None] + j[None, :], -1)
    keep = ext.clamp(max=w)
    n_keep = int(batch.extend_lens_cpu.clamp(max=w).sum())
    kb = torch.repeat_interleave(reqs, keep, output_size=n_keep)
    src = qo[1:][kb] - keep[kb] + torch.arange(n_keep, device=dev) - (torch.cumsum(keep, 0) - keep)[kb]
    dst = batch.req_pool_indices.long()[kb] * w + pos[src] % w
    i32 = torch.int32
    return ExtendPlan(tokens=torch.arange(n_tok, device=dev, dtype=i32), rows=rows, positions=pos,
                      ring_idx=ring_idx.to(i32), ring_len=ring_len.to(i32), new_idx=new_idx.to(i32),
                      new_len=new_len.to(i32), ring_src=src, ring_dst=dst)
