"""The indexer top-k of an extend step (prefill, chunked prefill): every query token over its own causal prefix.

Token ``t`` at position ``p`` sees key positions ``0 .. p`` (the cached prefix, the chunk's earlier tokens and
itself) and keeps the ``top_k`` best by ``sum_h w_h relu(q_h . k)``, all of them when ``p + 1 <= top_k`` (then
the selection is every visible position, in score order, -1 after). Semantics and outputs are those of
:func:`~backends.kernels.sparse.indexer.indexer_topk_reference`, which already takes many tokens per request.

:func:`indexer_topk_extend` runs the Triton scoring kernel and top-k of :mod:`~backends.kernels.sparse.indexer`
over the step's tokens in *tiles of query tokens*, each tile's scores ``[tile, max_len]`` in one bounded scratch
(the logits of a long prompt are never materialized whole: a 128k-token prompt with a 64 MiB scratch scores
128 query rows at a time). The loop is over tiles of the step's token list, not over requests: the kernel finds
each token's request from ``qo_indptr`` itself, so a tile may span requests. No host sync.
"""

from __future__ import annotations

import torch

from backends.kernels.checks import require
from backends.kernels.sparse.indexer import _scratch_layout, indexer_topk

__all__ = ["extend_tile_tokens", "indexer_topk_extend"]


def extend_tile_tokens(scratch_bytes: int, max_len: int, top_k: int) -> int:
    """Query tokens one tile may hold so that its scores and top-k fit ``scratch_bytes`` (0: not even one)."""
    per = _scratch_layout(1, max_len, top_k)[3]
    n = max(0, scratch_bytes // per)
    while n > 0 and _scratch_layout(n, max_len, top_k)[3] > scratch_bytes:
        n -= 1
    return n


def indexer_topk_extend(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    positions: torch.Tensor,
    qo_indptr: torch.Tensor,
    top_k: int,
    *,
    max_len: int,
    scratch: torch.Tensor,
    out_pos: torch.Tensor | None = None,
    out_scores: torch.Tensor | None = None,
    tile_tokens: int | None = None,
    **kernel,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k positions of every extend token, the inputs and outputs of
    :func:`~backends.kernels.sparse.indexer.indexer_topk_reference`.

    Parameters (beyond the reference's)
    ----------
    max_len : int
        A bound on ``positions + 1`` over the step (its longest sequence, known on the host).
    scratch : uint8 (or float32) contiguous tensor
        Scores of one tile of query tokens and their top-k; its size sets the tile (:func:`extend_tile_tokens`;
        at least one token must fit).
    out_pos : [T, top_k] int32, optional; out_scores : [T, top_k] float32, optional
    tile_tokens : query tokens per tile (None: as many as the scratch holds)
    kernel : forwarded to :func:`~backends.kernels.sparse.indexer.indexer_topk` (tiling, ``topk_impl``)
    """
    t_all = q.shape[0]
    dev = q.device
    fit = extend_tile_tokens(scratch.numel() * scratch.element_size(), max_len, top_k)
    require(fit >= 1, f"a scratch of >= indexer_scratch_bytes(1, {max_len}, {top_k}) bytes; got "
                      f"{scratch.numel() * scratch.element_size()}")
    tile = fit if tile_tokens is None else max(1, min(int(tile_tokens), fit))
    if out_pos is None:
        out_pos = torch.empty(t_all, top_k, dtype=torch.int32, device=dev)
    if out_scores is None:
        out_scores = torch.empty(t_all, top_k, dtype=torch.float32, device=dev)
    for s in range(0, t_all, tile):
        e = min(s + tile, t_all)
        # the kernel counts the requests whose end is <= the token's index: shifting qo_indptr by s keeps that
        # count for tile-local indices (entries may go negative)
        indptr = qo_indptr if s == 0 else qo_indptr - s
        indexer_topk(q[s:e], weights[s:e], k_cache, req_to_token, req_rows, positions[s:e], indptr, top_k,
                     max_len=max_len, out_pos=out_pos[s:e], out_scores=out_scores[s:e], scratch=scratch, **kernel)
    return out_pos, out_scores
