"""Launcher for the absorbed-MLA extend / prefill kernel (causal, bottom-right aligned, paged KV).

New token ``i`` of request ``b`` (``n_b`` new tokens, ``L_b = seq_lens[b]`` keys in all, the new ones already
in the cache) sits at position ``L_b - n_b + i`` and sees keys ``0 .. L_b - n_b + i``.
"""

from __future__ import annotations

import torch
import triton

from backends.kernels.checks import interpreted, require
from backends.kernels.mla_decode.mla_decode_kernels import _LOG2E
from backends.kernels.mla_extend.mla_extend_kernels import _mla_extend_kernel

__all__ = ["default_extend_config", "mla_extend"]


def default_extend_config(heads: int, dtype: torch.dtype) -> dict:
    """Default kernel parameters (see bench/triton_mla_kernels_gpu.py to retune).

    block_m: query rows per tile (tokens x heads); block_h: heads per tile (rows are head-fastest)."""
    cfg = dict(
        block_m=64,
        block_h=min(16, triton.next_power_of_2(max(1, heads))),
        block_n=32,
        num_warps=8,
        num_stages=2,
    )
    if dtype == torch.float32:
        cfg.update(block_m=16, block_n=16, num_warps=4, num_stages=1)
    cfg["block_h"] = min(cfg["block_h"], cfg["block_m"])
    return cfg


def mla_extend(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    qo_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    *,
    max_q_len: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scale: float = 1.0,
) -> None:
    """Causal absorbed-MLA attention of the new tokens of each request over its whole paged KV.

    Parameters
    ----------
    q_nope : [T, H, D_CKV]; q_pe : [T, H, D_PE], packed by request (last dims contiguous)
    kv_cache : [num_pages, page_size, D_CKV + D_PE] bf16/fp16/fp32, or float8_e4m3fn read with ``kv_scale``
        (real = stored * kv_scale; products in q's dtype) (last dim contiguous)
    page_table : int32 [B, max_pages]; qo_indptr : int32 [B + 1]; seq_lens : int32 [B] (total KV lengths,
        new tokens included; seq_lens[b] >= n_b)
    out : [T, H, D_CKV] written in place (rows of the T tokens only)
    max_q_len : host int >= max_b n_b; None reads it from qo_indptr (a device->host sync).
    block_m : query rows per tile (= tokens per tile x block_h); block_h : heads per tile (power of 2,
        divides block_m); block_n : keys per tile. Defaults from :func:`default_extend_config`.
    """
    T, H, D_CKV = q_nope.shape
    D_PE = q_pe.shape[-1]
    B = qo_indptr.shape[0] - 1
    require(
        q_pe.shape[:2] == (T, H) and out.shape == (T, H, D_CKV),
        "q_pe.shape[:2] == (T, H) and out.shape == (T, H, D_CKV)",
    )
    require(
        kv_cache.dim() == 3 and kv_cache.shape[-1] == D_CKV + D_PE,
        "kv_cache.dim() == 3 and kv_cache.shape[-1] == D_CKV + D_PE",
    )
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    require(
        kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32) or kv_fp8,
        "kv_cache dtype bfloat16, float16, float32 or float8_e4m3fn",
    )
    cdt = q_nope.dtype if kv_fp8 else kv_cache.dtype
    require(
        triton.next_power_of_2(D_CKV) == D_CKV and triton.next_power_of_2(D_PE) == D_PE,
        "triton.next_power_of_2(D_CKV) == D_CKV and triton.next_power_of_2(D_PE) == D_PE",
    )
    require(
        page_table.dtype == torch.int32 and qo_indptr.dtype == torch.int32 and seq_lens.dtype == torch.int32,
        "page_table.dtype == torch.int32 and qo_indptr.dtype == torch.int32 and seq_lens.dtype == torch.int32",
    )
    require(page_table.shape[0] >= B and seq_lens.shape[0] >= B, "page_table.shape[0] >= B and seq_lens.shape[0] >= B")
    require(B <= 65535, "grid.z limit: at most 65535 requests per call")
    for t in (q_nope, q_pe, kv_cache, out):
        require(t.stride(-1) == 1, "last dims must be contiguous")
    if B <= 0 or T == 0:
        return
    if max_q_len is None:
        max_q_len = int((qo_indptr[1 : B + 1] - qo_indptr[:B]).max().item())
    if max_q_len <= 0:
        return

    cfg = default_extend_config(H, cdt)
    block_m = cfg["block_m"] if block_m is None else block_m
    block_n = cfg["block_n"] if block_n is None else block_n
    block_h = min(cfg["block_h"], block_m) if block_h is None else block_h
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    for v in (block_m, block_n, block_h):
        require(triton.next_power_of_2(v) == v, "block sizes must be powers of 2")
    require(
        block_m >= 16 and block_n >= 16 and block_m % block_h == 0,
        "block_m >= 16 and block_n >= 16 and block_m % block_h == 0",
    )

    tokens_per_tile = block_m // block_h
    num_m_tiles = triton.cdiv(max_q_len, tokens_per_tile)
    require(num_m_tiles <= 65535, "grid.y limit: raise block_m or lower block_h")
    interp = interpreted(_mla_extend_kernel)
    upcast = interp and cdt == torch.bfloat16
    prec = "ieee" if cdt == torch.float32 else "tf32"
    out_scale = float(kv_scale) if kv_fp8 else 1.0
    extra = {} if interp else dict(num_warps=num_warps, num_stages=num_stages)

    _mla_extend_kernel[(triton.cdiv(H, block_h), num_m_tiles, B)](
        q_nope,
        q_pe,
        kv_cache,
        page_table,
        qo_indptr,
        seq_lens,
        out,
        float(sm_scale) * _LOG2E * out_scale,
        out_scale,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        H,
        num_m_tiles,
        PAGE_SIZE=kv_cache.shape[1],
        D_CKV=D_CKV,
        D_PE=D_PE,
        BLOCK_M=block_m,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        PREC=prec,
        UPCAST=upcast,
        KV_FP8=kv_fp8,
        **extra,
    )
