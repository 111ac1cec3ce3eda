"""DeepSeek-V4 lightning indexer for a whole batch at once, over the CSA pool's paged indexer keys.

The semantics are :func:`backends.kernels.dsv4.dsv4_reference.indexer_topk` applied to each request (the oracle):
query token ``t`` (absolute position ``t``) of the request in table row ``r`` scores entries ``e < (t + 1) //
rate`` as ``sum_h w[t, h] * relu(q[t, h] . key[table[r, e]])`` and returns the ``top_k`` best entry ids by
descending score, ``-1`` where fewer entries are visible (which of exactly equal scores wins is not defined, in the
reference either). Two implementations, one signature (:func:`indexer_topk_paged`):

* ``impl="torch"``: batched torch in ``compute_dtype``, no loop per request: the tokens run in chunks whose
  gathered keys ``[n, E, Di]`` and scores ``[n, Hi, E]`` stay under :data:`CHUNK_ELEMENTS`, every chunk scored
  over the batch's widest entry count ``E`` with the invisible columns masked.
* ``impl="triton"``: the DSA indexer's scoring kernel (:func:`backends.kernels.sparse.indexer.indexer_topk`: keys
  gathered through the table inside the kernel, float32 scores, ``torch.topk`` and its fix-up kernel) with the entry
  index as the "position": a query sees entries ``0 .. (t + 1) // rate - 1``. Needs ``Di`` a power of two >= 16. Token
  chunks keep its score buffer ``[n, E]`` under :data:`CHUNK_ELEMENTS`; no host sync. Ran on an H100 in a tiny
  served model (tests/test_dsv4_gpu.py, ``index_head_dim`` 16: transformers' tokens).
"""

from __future__ import annotations

import torch

from backends.kernels.checks import require
from backends.kernels.sparse.indexer import indexer_topk

IMPLS = ("torch", "triton")
#: Elements of the gathered keys / per-head scores one chunk of query tokens may hold (torch impl).
CHUNK_ELEMENTS = 1 << 24


def triton_indexer_fits(index_head_dim: int) -> bool:
    """Whether the DSA scoring kernel takes this indexer head width (a power of two >= 16, its tl.dot tile)."""
    d = int(index_head_dim)
    return d >= 16 and d & (d - 1) == 0


def _token_rows(req_rows: torch.Tensor, qo_indptr: torch.Tensor, n_tok: int) -> torch.Tensor:
    qo = qo_indptr.long()
    return torch.repeat_interleave(req_rows.long(), qo[1:] - qo[:-1], output_size=n_tok)


def indexer_topk_paged(index_q: torch.Tensor, index_weights: torch.Tensor, keys: torch.Tensor, table: torch.Tensor,
                       req_rows: torch.Tensor, qo_indptr: torch.Tensor, positions: torch.Tensor, rate: int,
                       top_k: int, max_entries: int, impl: str = "torch",
                       compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Top-k compressed entries of every query token of a batch.

    Parameters
    ----------
    index_q : [T, Hi, Di] indexer queries (RoPE applied); index_weights : [T, Hi] (every scale folded in).
    keys : [S, Di] the layer's indexer keys by entry slot (``CompressedKVPool.flat(layer, "index")``).
    table : [R, N] int32 slot of entry ``e`` of request-table row ``r``.
    req_rows : [B] int64 table rows; qo_indptr : [B + 1] int32 (tokens of request ``b``:
        ``qo_indptr[b] .. qo_indptr[b + 1] - 1``); positions : [T] int64 absolute positions.
    rate, top_k : int
    max_entries : int
        Host bound on the entries any query of the batch sees (``max_seq_len // rate``; ``<= N``).
    impl : "torch" or "triton"; compute_dtype : the torch impl's dtype (triton: float32).

    Returns
    -------
    torch.Tensor
        [T, top_k] int64 entry ids by descending score, -1 padding.
    """
    require(impl in IMPLS, f"impl one of {IMPLS}; got {impl!r}")
    require(index_q.dim() == 3 and index_weights.shape == index_q.shape[:2],
            f"index_q [T, Hi, Di] and index_weights [T, Hi]; got {tuple(index_q.shape)}, {tuple(index_weights.shape)}")
    require(0 <= max_entries <= table.shape[1], f"0 <= max_entries <= table.shape[1]={table.shape[1]}; got {max_entries}")
    n_tok, hi, di = index_q.shape
    out = torch.full((n_tok, top_k), -1, dtype=torch.int64, device=index_q.device)
    if n_tok == 0 or max_entries == 0:
        return out
    e = int(max_entries)
    if impl == "triton":
        require(triton_indexer_fits(di), f"impl='triton' needs Di a power of two >= 16; got {di}")
        step = max(1, CHUNK_ELEMENTS // e)  # the kernel's float32 score buffer [n, E]
        last = (positions.long() + 1) // rate - 1  # the DSA kernel's causal bound: it sees 0 .. last
        q, w, qo = index_q.contiguous(), index_weights.float().contiguous(), qo_indptr.to(torch.int32)
        for s in range(0, n_tok, step):
            t = slice(s, min(s + step, n_tok))
            qo_t = (qo - s).clamp(0, t.stop - s)  # the slice's tokens per request (requests outside it: empty)
            picked, _ = indexer_topk(q[t], w[t], keys, table, req_rows.long(), last[t], qo_t, top_k, max_len=e)
            out[t] = picked.long()
        return out
    rows = _token_rows(req_rows, qo_indptr, n_tok)
    limit = (positions.long() + 1) // rate
    k = min(top_k, e)
    cols = torch.arange(e, device=index_q.device)
    step = max(1, CHUNK_ELEMENTS // (e * max(hi, di)))
    for s in range(0, n_tok, step):
        t = slice(s, min(s + step, n_tok))
        gathered = keys[table[rows[t], :e].long()].to(compute_dtype)  # [n, E, Di]
        scores = torch.relu(torch.einsum("nhd,ned->nhe", index_q[t].to(compute_dtype), gathered))
        scores = (scores * index_weights[t].to(compute_dtype)[:, :, None]).sum(dim=1)  # [n, E]
        lim = limit[t][:, None]
        idx = scores.masked_fill(cols[None, :] >= lim, float("-inf")).topk(k, dim=-1).indices
        out[t, :k] = torch.where(idx >= lim, -1, idx)
    return out
