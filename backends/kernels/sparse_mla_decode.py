"""Sparse absorbed-MLA decode: each query token attends only to the KV rows its indexer selected.

``out[t, h] = softmax_k((q_nope[t, h] . ckv[l] + q_pe[t, h] . kpe[l]) * sm_scale) @ ckv[l]`` over the valid
entries ``l = locs[t, k] >= 0`` (``-1`` entries are masked); a token with no valid entry outputs zeros. One
layer's latent KV is ``kv_rows[S, Dc + Dr]`` addressed by device location: the first ``Dc`` columns are both
the key-nope part and the value, the last ``Dr`` the rope key.

* :func:`sparse_mla_decode_reference`: torch, float32 math, any device (the oracle, and the CPU path).
* :func:`sparse_mla_decode`: Triton, split over the K selected entries for occupancy (programs
  ``(token, split, head block)``; one KV tile is loaded once per head block), merged with log-sum-exp by a
  second kernel. Graph-safe given ``scratch`` (see :func:`sparse_decode_scratch_bytes`) and ``out``.

Triton is imported lazily, so the reference works where Triton is not installed.
"""

from __future__ import annotations

import torch

from backends.kernels.checks import require

__all__ = ["sparse_decode_scratch_bytes", "sparse_mla_decode_reference"]


def _check_args(q_nope, q_pe, kv_rows, locs) -> None:
    require(q_nope.dim() == 3, f"q_nope [T, H, Dc]; got shape {tuple(q_nope.shape)}")
    T, H, Dc = q_nope.shape
    require(
        q_pe.dim() == 3 and q_pe.shape[:2] == (T, H), f"q_pe [T={T}, H={H}, Dr]; got shape {tuple(q_pe.shape)}"
    )
    Dr = q_pe.shape[2]
    require(
        kv_rows.dim() == 2 and kv_rows.shape[1] == Dc + Dr,
        f"kv_rows [S, Dc + Dr = {Dc + Dr}]; got shape {tuple(kv_rows.shape)}",
    )
    require(locs.dim() == 2 and locs.shape[0] == T, f"locs [T={T}, K]; got shape {tuple(locs.shape)}")
    require(locs.dtype in (torch.int32, torch.int64), f"locs int32 (or int64); got {locs.dtype}")


def sparse_mla_decode_reference(
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_rows: torch.Tensor, locs: torch.Tensor, sm_scale: float
) -> torch.Tensor:
    """Sparse absorbed-MLA decode in plain torch (float32 math).

    Parameters
    ----------
    q_nope : [T, H, Dc] (absorbed query, Dc = kv_lora_rank); q_pe : [T, H, Dr] rope part; same dtype
    kv_rows : [S, Dc + Dr]
        One layer's latent KV rows by device location.
    locs : [T, K] int32
        Device locations each token attends to; -1 = unused entry.
    sm_scale : float

    Returns
    -------
    out : [T, H, Dc] in q_nope's dtype (zeros for a token without valid entries)
    """
    _check_args(q_nope, q_pe, kv_rows, locs)
    Dc = q_nope.shape[2]
    valid = locs >= 0  # [T, K]
    rows = kv_rows[locs.long().clamp_min(0)].float()  # [T, K, Dc + Dr]
    scores = torch.einsum("thc,tkc->thk", q_nope.float(), rows[..., :Dc])
    scores += torch.einsum("thr,tkr->thk", q_pe.float(), rows[..., Dc:])
    scores = (scores * sm_scale).masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # all-masked rows: NaN -> 0
    out = torch.einsum("thk,tkc->thc", probs, rows[..., :Dc])
    return out.to(q_nope.dtype)


def sparse_decode_scratch_bytes(max_tokens: int, heads: int, kv_lora_rank: int, max_splits: int) -> int:
    """Bytes of the float32 scratch :func:`sparse_mla_decode` needs for up to ``max_tokens`` tokens split
    ``max_splits`` ways: partial outputs [max_tokens, heads, max_splits, kv_lora_rank] and their LSEs
    [max_tokens, heads, max_splits]."""
    return 4 * max_tokens * heads * max_splits * (kv_lora_rank + 1)
