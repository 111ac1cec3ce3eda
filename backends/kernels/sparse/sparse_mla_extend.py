"""Sparse absorbed-MLA extend (DeepSeek-V3.2 prefill): every query token attends only to its own indexer top-k.

Prefill, chunked prefill and extend tokens each carry a top-k of token positions (from the indexer over their
causal prefix, :mod:`~backends.kernels.sparse.indexer_extend`); attention reads exactly those latent rows of the
paged cache::

    out[t, h] = softmax_k((q_nope[t, h] . ckv[l] + q_pe[t, h] . kpe[l]) * sm_scale) @ ckv[l]
    l = req_to_token[row(t), topk_pos[t, k]]   (entries with topk_pos -1 are masked)

It is the decode math with one query row per token and its own row list, so the kernel is the sparse decode
kernel (:mod:`~backends.kernels.sparse.sparse_mla_decode`: programs ``(head block, split, token)``, bf16 / fp16 /
fp32 or fp8 caches), fed locations this module computes from the paged table on the device:

* :func:`token_rows`: the request-table row of each of the step's tokens (no host sync);
* :func:`topk_locations`: top-k positions -> device locations through the request table (-1 kept);
* :func:`sparse_mla_extend_reference`: torch, float32 math, bounded memory (tokens in tiles); the oracle;
* :func:`sparse_attention_rows`: the same math over rows already gathered (HiSparse: rows read from the host);
* :func:`sparse_mla_extend`: the Triton path (locations, then the sparse kernel; split-K only when there are
  too few tokens to fill the GPU).
"""

from __future__ import annotations

import torch

from backends.kernels.checks import require

__all__ = [
    "REF_TOKENS_PER_STEP",
    "rows_read",
    "sparse_attention_rows",
    "sparse_mla_extend",
    "sparse_mla_extend_reference",
    "token_rows",
    "topk_locations",
]

#: Query tokens per step of the torch reference (bounds its [tokens, K, Dc + Dr] float32 gather).
REF_TOKENS_PER_STEP = 128
#: Gathered rows per tile of the extend with more than 32 heads (the decode's default is 32): on an H200, 8192
#: tokens of 128 heads after a 24k prefix, top-2048, bf16, took 20.0 ms against 28.2 with 32 rows (234 against 165
#: TFLOP/s; ``python -m bench.dsa_prefill_bench --tilings`` times the alternatives).
EXTEND_BLOCK_N = 64


def token_rows(req_pool_indices: torch.Tensor, qo_indptr: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] int64 request-table row of each query token (requests laid end to end by ``qo_indptr`` [B + 1]);
    ``num_tokens`` = T, known on the host (no sync)."""
    counts = (qo_indptr[1:] - qo_indptr[:-1]).long()
    return torch.repeat_interleave(req_pool_indices.long(), counts, output_size=num_tokens)


def topk_locations(topk_pos: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """topk_pos [T, K] int32 token positions (-1 padding), table [R, max_ctx] (the request table: positions ->
    device locations), rows [T] int64 -> [T, K] int32 locations (-1 where the position is -1)."""
    slots = table[rows[:, None], topk_pos.clamp_min(0).long()]
    return torch.where(topk_pos >= 0, slots.to(torch.int32), -1)


def rows_read(prefix_len: int, extend_len: int, top_k: int) -> tuple[int, int]:
    """(sparse, dense) key rows one request's extend of ``extend_len`` tokens after ``prefix_len`` cached ones
    reads: token at position p reads min(top_k, p + 1) rows sparsely, p + 1 densely."""
    lo, hi = prefix_len + 1, prefix_len + extend_len  # rows seen by the first and the last token
    dense = (lo + hi) * extend_len // 2
    full = max(0, min(hi, top_k) - lo + 1)  # tokens that still see fewer than top_k rows: all of them
    sparse = (lo + lo + full - 1) * full // 2 + (extend_len - full) * top_k
    return sparse, dense


def sparse_attention_rows(q_nope: torch.Tensor, q_pe: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                          sm_scale: float, kv_scale: float = 1.0, fp8: bool = False) -> torch.Tensor:
    """Attention of each token over its own gathered rows, float32 math.

    q_nope [T, H, Dc], q_pe [T, H, Dr]; rows [T, K, Dc + Dr] (any float dtype; ``fp8``: stored values, real =
    stored * kv_scale); valid [T, K] bool -> [T, H, Dc] float32 (zeros for a token without a valid row).
    """
    dc = q_nope.shape[2]
    rows = rows.float()
    if fp8:
        rows = rows * kv_scale
    scores = torch.einsum("thc,tkc->thk", q_nope.float(), rows[..., :dc])
    scores += torch.einsum("thr,tkr->thk", q_pe.float(), rows[..., dc:])
    scores = (scores * sm_scale).masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    return torch.einsum("thk,tkc->thc", probs, rows[..., :dc])


def _check(q_nope, q_pe, kv_rows, locs) -> None:
    require(q_nope.dim() == 3 and q_pe.dim() == 3 and q_pe.shape[:2] == q_nope.shape[:2],
            f"q_nope [T, H, Dc] and q_pe [T, H, Dr]; got {tuple(q_nope.shape)} and {tuple(q_pe.shape)}")
    require(kv_rows.dim() == 2 and kv_rows.shape[1] == q_nope.shape[2] + q_pe.shape[2],
            f"kv_rows [S, Dc + Dr = {q_nope.shape[2] + q_pe.shape[2]}]; got {tuple(kv_rows.shape)}")
    require(locs.dim() == 2 and locs.shape[0] == q_nope.shape[0], f"locs [T={q_nope.shape[0]}, K]; got {tuple(locs.shape)}")


def sparse_mla_extend_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_rows: torch.Tensor, locs: torch.Tensor,
                                sm_scale: float, kv_scale: float = 1.0) -> torch.Tensor:
    """Sparse extend in plain torch (float32 math; tokens in tiles of :data:`REF_TOKENS_PER_STEP`).

    Parameters
    ----------
    q_nope : [T, H, Dc] absorbed queries; q_pe : [T, H, Dr]
    kv_rows : [S, Dc + Dr] one layer's latent rows by device location (float8_e4m3fn: read with ``kv_scale``)
    locs : [T, K] int32 device locations of each token's selection (-1 = none; :func:`topk_locations`)

    Returns
    -------
    out : [T, H, Dc] in q_nope's dtype
    """
    _check(q_nope, q_pe, kv_rows, locs)
    out = torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    fp8 = kv_rows.dtype == torch.float8_e4m3fn
    for s in range(0, q_nope.shape[0], REF_TOKENS_PER_STEP):
        e = min(s + REF_TOKENS_PER_STEP, q_nope.shape[0])
        loc = locs[s:e]
        rows = kv_rows[loc.long().clamp_min(0)]
        out[s:e] = sparse_attention_rows(q_nope[s:e], q_pe[s:e], rows, loc >= 0, sm_scale, kv_scale, fp8).to(out.dtype)
    return out


def sparse_mla_extend(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_rows: torch.Tensor, locs: torch.Tensor,
                      sm_scale: float, scratch: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
                      kv_scale: float = 1.0, **tiling) -> torch.Tensor:
    """Sparse extend with Triton: the inputs and output of :func:`sparse_mla_extend_reference`.

    ``scratch`` (float32 or a uint8 ledger buffer) holds split-K partials when the step has too few tokens to fill
    the GPU; a prefill of many tokens runs one program per (head block, token) and never touches it (too small a
    scratch only means fewer splits). ``tiling``: block_h, block_n, num_warps, num_stages, target_programs (see
    :func:`~backends.kernels.sparse.sparse_mla_decode.sparse_mla_decode`; block_n defaults to
    :data:`EXTEND_BLOCK_N` with 16-bit queries of more than 32 heads). No host sync, no allocation given
    ``scratch`` and ``out``.
    """
    from backends.kernels.sparse.sparse_mla_decode import sparse_mla_decode

    _check(q_nope, q_pe, kv_rows, locs)
    if q_nope.shape[1] > 32 and q_nope.dtype in (torch.bfloat16, torch.float16):
        tiling.setdefault("block_n", EXTEND_BLOCK_N)
    return sparse_mla_decode(q_nope, q_pe, kv_rows, locs.contiguous(), sm_scale, scratch, out=out, kv_scale=kv_scale,
                             **tiling)
