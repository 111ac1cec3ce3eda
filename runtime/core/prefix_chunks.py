"""Split the cached prefixes of an EXTEND batch into chunks for the MHA chunked-prefix prefill."""

from __future__ import annotations

import torch

from runtime.core.batch import ForwardBatch, PrefixChunk
from runtime.core.device import to_device
from runtime.core.kv_pool import ReqToTokenPool


def plan_prefix_chunks(batch: ForwardBatch, req_to_token_pool: ReqToTokenPool, chunk_tokens: int) -> list[PrefixChunk]:
    """Chunk k covers prefix positions ``[k*L, (k+1)*L)`` of every request, with
    ``L = chunk_tokens // (requests that have a prefix)``, so one chunk decompresses at most ``chunk_tokens``
    latent rows. Requests with an empty prefix have empty ranges in every chunk. Host-side planning; the
    slot gather runs on the device."""
    prefix = batch.prefix_lens_cpu.tolist()
    with_prefix = sum(1 for p in prefix if p > 0)
    if with_prefix == 0:
        return []
    per_req = max(1, chunk_tokens // with_prefix)
    table = req_to_token_pool.req_to_token
    rows = batch.req_pool_indices_cpu.tolist()
    chunks = []
    for start in range(0, max(prefix), per_req):
        spans = [(start, min(start + per_req, p)) if p > start else (0, 0) for p in prefix]
        lens = torch.tensor([e - s for s, e in spans], dtype=torch.int32)
        indptr = torch.zeros(len(spans) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(lens, 0)
        slots = torch.cat([table[r, s:e] for r, (s, e) in zip(rows, spans)]).long()
        chunks.append(PrefixChunk(slots, to_device(indptr, table.device), indptr))
    return chunks
