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

from backends.kernels.checks import interpreted, require
from backends.kernels.sm_count import sm_count

__all__ = [
    "default_sparse_decode_config",
    "sparse_decode_scratch_bytes",
    "sparse_decode_splits",
    "sparse_mla_decode",
    "sparse_mla_decode_reference",
]

#: Stage-1 programs aimed at per streaming multiprocessor (one wave). See bench/bench_dsa.py to retune.
PROGRAMS_PER_SM = 2
#: A split covers at least this many selected entries (shorter pieces cost more in merge than they gain).
MIN_ENTRIES_PER_SPLIT = 128


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
    q_nope: torch.Tensor, q_pe: torch.Tensor, kv_rows: torch.Tensor, locs: torch.Tensor, sm_scale: float,
    kv_scale: float = 1.0,
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
    kv_scale : dequantization scale of a float8_e4m3fn ``kv_rows`` (real = stored * kv_scale)

    Returns
    -------
    out : [T, H, Dc] in q_nope's dtype (zeros for a token without valid entries)
    """
    _check_args(q_nope, q_pe, kv_rows, locs)
    Dc = q_nope.shape[2]
    valid = locs >= 0  # [T, K]
    rows = kv_rows[locs.long().clamp_min(0)].float()  # [T, K, Dc + Dr]
    if kv_rows.dtype == torch.float8_e4m3fn:
        rows = rows * kv_scale
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


def _as_float32(scratch: torch.Tensor) -> torch.Tensor:
    """The scratch as a flat float32 tensor (a ledger buffer is uint8 [nbytes])."""
    require(scratch.is_contiguous(), "a contiguous scratch tensor")
    if scratch.dtype == torch.uint8:
        n = scratch.numel() // 4 * 4
        return scratch[:n].view(torch.float32)
    require(scratch.dtype == torch.float32, f"scratch float32 or uint8 (a ledger buffer); got {scratch.dtype}")
    return scratch.view(-1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_sparse_decode_config(heads: int, dtype: torch.dtype) -> dict:
    """Kernel tiling for ``heads`` query heads: BLOCK_H heads share each gathered KV tile."""
    block_h = 16 if heads <= 16 else (32 if heads <= 32 else 64)
    cfg = dict(block_h=block_h, block_n=64 if block_h <= 32 else 32, num_warps=8, num_stages=2)
    if dtype == torch.float32:
        cfg.update(block_n=16, num_stages=1)
    return cfg


def sparse_decode_splits(
    tokens: int, head_blocks: int, k: int, block_n: int, target_programs: int, capacity: int | None,
    min_entries: int = MIN_ENTRIES_PER_SPLIT,
) -> tuple[int, int]:  # fmt: skip
    """(num_splits, split_len) for ``tokens`` x ``head_blocks`` programs per split over ``k`` entries: enough
    splits to reach ``target_programs``, pieces of at least ``min_entries`` (a multiple of ``block_n``), at most
    ``capacity`` splits (the scratch's; None: no limit)."""
    want = max(1, _cdiv(target_programs, max(tokens * head_blocks, 1)))
    want = min(want, max(1, k // max(min_entries, block_n)))
    if capacity is not None:
        want = max(1, min(want, capacity))
    split_len = _cdiv(_cdiv(k, want), block_n) * block_n
    return max(1, _cdiv(k, split_len)), split_len


def sparse_mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_rows: torch.Tensor,
    locs: torch.Tensor,
    sm_scale: float,
    scratch: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    target_programs: int | None = None,
    min_entries_per_split: int = MIN_ENTRIES_PER_SPLIT,
    max_splits: int | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Sparse absorbed-MLA decode with Triton (same math as :func:`sparse_mla_decode_reference`).

    Parameters
    ----------
    q_nope : [T, H, Dc]; q_pe : [T, H, Dr]; last dims contiguous, any float dtype (cast to the KV dtype)
    kv_rows : [S, Dc + Dr] bf16 / fp16 / fp32, or float8_e4m3fn read with ``kv_scale`` (real = stored *
        kv_scale), rows contiguous (any row stride)
    locs : [T, K] int32 (or int64) device locations, -1 = masked; last dim contiguous
    sm_scale : float
    scratch : float32 (or uint8 ledger buffer) tensor, optional
        Partial outputs and LSEs of the split pieces; its size bounds the number of splits (see
        :func:`sparse_decode_scratch_bytes`; zero bytes -> one split, no merge). None -> allocated here.
    out : [T, H, Dc], optional
        Written in place (any float dtype); None -> a new tensor in q_nope's dtype.
    block_h, block_n, num_warps, num_stages : tiling (None: :func:`default_sparse_decode_config`).
    target_programs : stage-1 programs to aim at (None: ``PROGRAMS_PER_SM`` x SMs on the GPU, 8 interpreted).
    min_entries_per_split, max_splits : split limits (see :func:`sparse_decode_splits`).

    Returns
    -------
    out : [T, H, Dc]

    No host sync and, given ``scratch`` and ``out``, no allocation: CUDA-graph safe. The split count depends
    only on shapes, the scratch size and the GPU.
    """
    import triton

    from backends.kernels.sparse import sparse_mla_decode_kernels as kern

    _check_args(q_nope, q_pe, kv_rows, locs)
    T, H, Dc = q_nope.shape
    Dr = q_pe.shape[2]
    K = locs.shape[1]
    kv_fp8 = kv_rows.dtype == torch.float8_e4m3fn
    require(
        kv_rows.dtype in (torch.bfloat16, torch.float16, torch.float32) or kv_fp8,
        f"kv_rows bfloat16, float16, float32 or float8_e4m3fn; got {kv_rows.dtype}",
    )
    cdt = q_nope.dtype if kv_fp8 else kv_rows.dtype
    require(
        triton.next_power_of_2(Dc) == Dc and triton.next_power_of_2(Dr) == Dr,
        f"power-of-two Dc and Dr; got {Dc} and {Dr}",
    )
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("kv_rows", kv_rows), ("locs", locs)):
        require(x.stride(-1) == 1, f"{name} with a contiguous last dim")
    if out is None:
        out = torch.empty(T, H, Dc, dtype=q_nope.dtype, device=q_nope.device)
    require(out.shape == (T, H, Dc) and out.stride(-1) == 1, f"out [T, H, Dc] = {(T, H, Dc)}, last dim contiguous")
    if T == 0:
        return out

    cfg = default_sparse_decode_config(H, cdt)
    block_h = cfg["block_h"] if block_h is None else block_h
    block_n = cfg["block_n"] if block_n is None else block_n
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    require(block_h >= 16 and block_n >= 16, f"tl.dot needs tiles of at least 16; got {block_h}, {block_n}")
    interp = interpreted(kern._sparse_decode_stage1_kernel)
    on_gpu = q_nope.is_cuda and not interp
    if target_programs is None:
        sms = sm_count(q_nope.device, 4) if on_gpu else 4
        target_programs = PROGRAMS_PER_SM * sms

    per_split = T * H * (Dc + 1)  # floats of one split's partials + LSEs
    if scratch is not None:
        scratch = _as_float32(scratch)
        capacity = scratch.numel() // per_split
    else:
        capacity = None
    if max_splits is not None:
        capacity = max_splits if capacity is None else min(capacity, max_splits)
    head_blocks = triton.cdiv(H, block_h)
    num_splits, split_len = sparse_decode_splits(
        T, head_blocks, max(K, 1), block_n, target_programs, capacity, min_entries_per_split
    )
    if num_splits > 1 and scratch is None:
        scratch = torch.empty(num_splits * per_split, dtype=torch.float32, device=q_nope.device)
    if num_splits > 1:
        po = scratch[: T * H * num_splits * Dc].view(T, H, num_splits, Dc)
        pl = scratch[T * H * num_splits * Dc : num_splits * per_split].view(T, H, num_splits)
    else:
        po = pl = out  # unused (SPLIT=False)

    upcast = interp and cdt == torch.bfloat16
    prec = "ieee" if cdt == torch.float32 else "tf32"
    out_scale = float(kv_scale) if kv_fp8 else 1.0
    extra = {} if interp else dict(num_warps=num_warps, num_stages=num_stages)
    kern._sparse_decode_stage1_kernel[(head_blocks, num_splits, T)](
        q_nope, q_pe, kv_rows, locs, po, pl, out, float(sm_scale) * kern.LOG2E * out_scale, out_scale,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv_rows.stride(0), locs.stride(0),
        po.stride(0), po.stride(1), po.stride(2) if num_splits > 1 else 0,
        pl.stride(0), pl.stride(1), pl.stride(2) if num_splits > 1 else 0,
        out.stride(0), out.stride(1), H, K, split_len,
        D_CKV=Dc, D_PE=Dr, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT=num_splits > 1, PREC=prec, UPCAST=upcast,
        KV_FP8=kv_fp8, **extra,
    )  # fmt: skip
    if num_splits > 1:
        block_s = triton.next_power_of_2(num_splits)
        block_dv = max(16, min(Dc, 4096 // (block_s * 16)))
        block_hm = min(triton.next_power_of_2(H), 16)
        if interp:
            block_dv = Dc
        extra2 = {} if interp else dict(num_warps=4)
        kern._sparse_decode_merge_kernel[(T, triton.cdiv(H, block_hm), Dc // block_dv)](
            po, pl, out, po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1), pl.stride(2),
            out.stride(0), out.stride(1), H, num_splits,
            BLOCK_S=block_s, BLOCK_HM=block_hm, BLOCK_DV=block_dv, **extra2,
        )  # fmt: skip
    return out
