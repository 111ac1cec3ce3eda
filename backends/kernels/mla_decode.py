"""Launcher for the split-KV absorbed-MLA decode kernels (one query token per request).

CUDA-graph safe: no allocation, no host sync, no branching on tensor values. The host decides the grid from
shapes and Python ints only; how many splits each request gets is decided on the GPU from ``seq_lens``, so
a captured graph replays correctly for any lengths.

Split plan (both kernels compute it identically; see ``_split_plan``):

* ``splits_per_req`` (host): workspace slots per request. The workspace has ``partial_out.shape[0] *
  max_splits`` slots and request ``b`` owns slots ``b * splits_per_req ...``; so ``splits_per_req =
  slots // B`` (>= max_splits since ``partial_out.shape[0] >= B``): a workspace sized for a bigger batch
  than the current one gives small batches more splits. The grid's split dimension is splits_per_req;
  programs past a request's last split exit at once.
* ``target_splits`` (host) = ``target_programs // head_blocks``; on the device the batch's total length
  ``T = sum(seq_lens)`` gives a minimal split length ``min_len = max(min_tokens_per_split,
  cdiv(T, target_splits))``, and request ``b`` gets ``n_b = clamp(len_b // min_len, 1, splits_per_req)``
  splits of ``cdiv(len_b, n_b)`` tokens rounded up to ``block_n``. So the whole batch is cut into about
  ``target_programs`` equal pieces: long requests get many splits, short ones one, and a big uniform batch
  is not split more than needed to fill the GPU (each split costs a partial-output write and read).
"""

from __future__ import annotations

import functools

import torch
import triton

from backends.kernels.checks import require
from backends.kernels.mla_decode_kernels import _LOG2E, _mla_decode_stage1_kernel, _mla_decode_stage2_kernel

__all__ = [
    "DEFAULT_MAX_SPLITS",
    "MIN_WORKSPACE_SLOTS",
    "decode_workspace_bytes",
    "decode_workspace_shapes",
    "default_decode_config",
    "mla_decode",
]

#: Default split slots per request row of the workspace (batch 256 x 16 heads -> 64 MiB of partials).
DEFAULT_MAX_SPLITS = 8
#: decode_workspace_shapes gives the workspace at least this many split slots in all (for small batches).
MIN_WORKSPACE_SLOTS = 512
#: Upper bound on the grid's split dimension (CUDA limits grid.z to 65535).
MAX_GRID_SPLITS = 4096
#: Stage-1 programs (B * head_blocks * splits) aimed at per streaming multiprocessor, by block_h: small
#: memory-bound programs (2 fit on an SM) want about 2 waves; fat compute-bound ones (1 per SM) one wave.
PROGRAMS_PER_SM = {16: 4, 32: 2, 64: 1}
_BLOCK_B = 256  # seq_lens summed in chunks of this many requests


def programs_per_sm(block_h: int) -> int:
    return PROGRAMS_PER_SM.get(block_h, 4 if block_h < 16 else 1)


def decode_workspace_shapes(batch: int, heads: int, max_splits: int = DEFAULT_MAX_SPLITS, kv_lora_rank: int = 512):
    """Shapes of (partial_out, partial_lse), both float32, for up to ``batch`` requests.

    The first dimension is ``max(batch, cdiv(MIN_WORKSPACE_SLOTS, max_splits))`` so that small batches
    (batch 1 with one very long request) still get enough split slots to fill the GPU."""
    rows = max(int(batch), triton.cdiv(MIN_WORKSPACE_SLOTS, int(max_splits)))
    return (rows, int(heads), int(max_splits), int(kv_lora_rank)), (rows, int(heads), int(max_splits))


def decode_workspace_bytes(
    batch: int, heads: int, max_splits: int = DEFAULT_MAX_SPLITS, kv_lora_rank: int = 512
) -> int:
    """Bytes of the float32 workspace (partial_out + partial_lse) that decode_workspace_shapes describes."""
    po, pl = decode_workspace_shapes(batch, heads, max_splits, kv_lora_rank)
    return 4 * (po[0] * po[1] * po[2] * po[3] + pl[0] * pl[1] * pl[2])


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _interpreting() -> bool:
    """Whether the kernels were built for the CPU interpreter (decided when they were decorated)."""
    return _mla_decode_stage1_kernel.__class__.__name__ == "InterpretedFunction"


def default_decode_config(heads: int, dtype: torch.dtype) -> dict:
    """Default kernel parameters for ``heads`` query heads (see bench/triton_mla_kernels_gpu.py to retune)."""
    if heads <= 16:
        cfg = dict(block_h=16, block_n=32, num_warps=4, num_stages=2)
    elif heads <= 32:
        cfg = dict(block_h=32, block_n=32, num_warps=4, num_stages=2)
    else:
        cfg = dict(block_h=64, block_n=32, num_warps=8, num_stages=2)
    if dtype == torch.float32:  # twice the bytes per tile
        cfg["block_n"] = 16
        cfg["num_stages"] = 1
    return cfg


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    *,
    max_splits: int = DEFAULT_MAX_SPLITS,
    min_tokens_per_split: int = 256,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    target_programs: int | None = None,
    merge_block_dv: int = 128,
    merge_block_s: int = 16,
    merge_num_warps: int = 4,
) -> None:
    """Absorbed-MLA decode: ``out[b, h] = softmax_l((q_nope.ckv_l + q_pe.kpe_l) * sm_scale) @ ckv``.

    Parameters
    ----------
    q_nope : [B, H, D_CKV]; q_pe : [B, H, D_PE] (last dims contiguous; any dtype, cast to the cache's)
    kv_cache : [num_pages, page_size, D_CKV + D_PE] bf16/fp16/fp32, last dim contiguous
    page_table : int32 [B, max_pages]; seq_lens : int32 [B] (device)
    out : [B, H, D_CKV] written in place (any float dtype)
    partial_out : float32 [R >= B, H, max_splits, D_CKV]; partial_lse : float32 [R, H, max_splits]
        Caller-owned workspace (see :func:`decode_workspace_shapes`); pass the whole buffer, not a slice
        ``[:B]``: spare rows become extra split slots for small batches.
    max_splits : the workspace's split dimension (``partial_out.shape[2]``).
    min_tokens_per_split : a split has at least this many tokens (a request of ``L`` tokens gets at most
        ``max(1, L // min_tokens_per_split)`` splits).
    block_n, block_h, num_warps, num_stages : kernel tiling (defaults from :func:`default_decode_config`).
    target_programs : stage-1 programs to aim at over the whole batch (see the module doc); None ->
        ``programs_per_sm(block_h) * SMs`` on CUDA, 0 (no balancing: splits from min_tokens_per_split
        only) when interpreting on the CPU; <= 0 -> no balancing.
    merge_block_dv, merge_block_s, merge_num_warps : tiling of the merge kernel.
    """
    B, H, D_CKV = q_nope.shape
    D_PE = q_pe.shape[-1]
    require(q_pe.shape[:2] == (B, H), "q_pe must be [B, H, D_PE]")
    require(kv_cache.dim() == 3 and kv_cache.shape[-1] == D_CKV + D_PE, "kv_cache must be [pages, page, D_CKV+D_PE]")
    require(out.shape == (B, H, D_CKV), "out must be [B, H, D_CKV]")
    require(
        triton.next_power_of_2(D_CKV) == D_CKV and triton.next_power_of_2(D_PE) == D_PE,
        "triton.next_power_of_2(D_CKV) == D_CKV and triton.next_power_of_2(D_PE) == D_PE",
    )
    require(
        kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32), "kv_cache dtype bfloat16, float16 or float32"
    )
    require(
        page_table.dtype == torch.int32 and seq_lens.dtype == torch.int32,
        "page_table.dtype == torch.int32 and seq_lens.dtype == torch.int32",
    )
    require(
        page_table.dim() == 2 and page_table.shape[0] >= B and seq_lens.shape[0] >= B,
        "page_table.dim() == 2 and page_table.shape[0] >= B and seq_lens.shape[0] >= B",
    )
    require(
        partial_out.dtype == torch.float32 and partial_lse.dtype == torch.float32,
        "partial_out.dtype == torch.float32 and partial_lse.dtype == torch.float32",
    )
    require(
        partial_out.dim() == 4 and partial_out.shape[0] >= B and partial_out.shape[1] >= H,
        "partial_out.dim() == 4 and partial_out.shape[0] >= B and partial_out.shape[1] >= H",
    )
    require(partial_out.shape[2] == max_splits and partial_out.shape[3] == D_CKV, "partial_out [R, H, max_splits, D]")
    require(
        partial_lse.shape[0] == partial_out.shape[0] and partial_lse.shape[1] >= H,
        "partial_lse.shape[0] == partial_out.shape[0] and partial_lse.shape[1] >= H",
    )
    require(partial_lse.shape[2] == max_splits, "partial_lse [R, H, max_splits]")
    for t in (q_nope, q_pe, kv_cache, out, partial_out):
        require(t.stride(-1) == 1, "last dims must be contiguous")
    require(min_tokens_per_split >= 1 and max_splits >= 1, "min_tokens_per_split >= 1 and max_splits >= 1")
    require(B <= 65535, "grid.y limit: at most 65535 requests per call")
    if B == 0:
        return

    cfg = default_decode_config(H, kv_cache.dtype)
    block_h = cfg["block_h"] if block_h is None else block_h
    block_n = cfg["block_n"] if block_n is None else block_n
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    require(block_h >= 16 and block_n >= 16, "tl.dot needs tiles of at least 16")
    require(
        triton.next_power_of_2(block_h) == block_h and triton.next_power_of_2(block_n) == block_n,
        "triton.next_power_of_2(block_h) == block_h and triton.next_power_of_2(block_n) == block_n",
    )
    require(D_CKV % merge_block_dv == 0, "D_CKV % merge_block_dv == 0")

    head_blocks = triton.cdiv(H, block_h)
    splits_per_req = max(1, min((partial_out.shape[0] * max_splits) // B, MAX_GRID_SPLITS))
    if target_programs is None:
        target_programs = (
            programs_per_sm(block_h) * _sm_count(q_nope.device.index or 0)
            if q_nope.is_cuda and not _interpreting()
            else 0
        )
    target_splits = max(1, target_programs // head_blocks) if target_programs > 0 else 0
    num_reqs_for_total = B if target_splits > 0 else 0

    interp = _interpreting()
    upcast = interp and kv_cache.dtype == torch.bfloat16
    prec = "ieee" if kv_cache.dtype == torch.float32 else "tf32"
    qk_scale = float(sm_scale) * _LOG2E
    page_size = kv_cache.shape[1]
    extra = {} if interp else dict(num_warps=num_warps, num_stages=num_stages)

    _mla_decode_stage1_kernel[(head_blocks, B, splits_per_req)](
        q_nope,
        q_pe,
        kv_cache,
        page_table,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        qk_scale,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        page_table.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        partial_lse.stride(2),
        out.stride(0),
        out.stride(1),
        H,
        num_reqs_for_total,
        target_splits,
        min_tokens_per_split,
        splits_per_req,
        max_splits,
        PAGE_SIZE=page_size,
        D_CKV=D_CKV,
        D_PE=D_PE,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_B=_BLOCK_B,
        PREC=prec,
        UPCAST=upcast,
        **extra,
    )
    extra2 = {} if interp else dict(num_warps=merge_num_warps, num_stages=2)
    _mla_decode_stage2_kernel[(B, H, D_CKV // merge_block_dv)](
        partial_out,
        partial_lse,
        seq_lens,
        out,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        partial_lse.stride(2),
        out.stride(0),
        out.stride(1),
        num_reqs_for_total,
        target_splits,
        min_tokens_per_split,
        splits_per_req,
        max_splits,
        BLOCK_N=block_n,
        BLOCK_B=_BLOCK_B,
        BLOCK_S=merge_block_s,
        BLOCK_DV=merge_block_dv,
        **extra2,
    )
