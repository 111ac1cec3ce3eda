"""Launcher for the split-KV absorbed-MLA decode kernels (one query token per request).

CUDA-graph safe: no allocation, no host sync, no branching on tensor values. The host decides the grid from
shapes and Python ints only; which program handles which tokens is decided on the GPU from ``seq_lens``, so
a captured graph replays correctly for any lengths.

Work plan (see :mod:`backends.kernels.mla_decode.mla_decode_kernels` for the details): the batch's tokens are laid end
to end and cut into ``num_programs`` equal chunks (at least ``min_tokens_per_split`` tokens each); stage-1
program ``p`` (x head blocks) processes whatever falls in chunk ``p``: several whole short requests, or a
slice of a long one. Every program therefore does the same work whatever the length distribution (a
request twice the mean gets twice the programs), and with ``num_programs`` = the number of programs the
GPU holds at once there is a single wave with no tail. Requests cut by chunk boundaries leave normalized
partial outputs in a *flat* slot space shared by the whole batch (``partial_out.shape[0] * max_splits``
slots; at most ``min(2 * (P - 1), P - 1 + B)`` are used, which bounds ``num_programs``), merged by stage 2
over a grid of (request, head block, column block). (The Gluon stage 1 of
:mod:`backends.kernels.mla_decode.mla_decode_wgmma` reads a plan written once, possibly by an earlier layer's call, and
its merge reads that plan's rows over a fixed grid: :func:`rows_merge_config`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from backends.kernels.checks import interpreted, require
from backends.kernels.mla_decode.mla_decode_kernels import _LOG2E, _mla_decode_stage1_kernel, _mla_decode_stage2_kernel
from backends.kernels.mla_decode.mla_decode_plan_kernels import _mla_decode_merge_rows_kernel, plan_ints
from backends.kernels.mla_decode.mla_decode_wgmma import (
    WGMMA_BLOCK_H,
    WGMMA_BLOCK_N,
    launch_wgmma_stage1,
    seesaw_by_default,
    stage1_merge_max,
    wgmma_block_h,
    wgmma_by_default,
    wgmma_problems,
)
from backends.kernels.mla_decode.mla_decode_workspace import (
    DEFAULT_MAX_SPLITS,
    MAX_GRID_PROGRAMS,
    MIN_WORKSPACE_SLOTS,
    DecodeWorkspace,
    DecodeWorkspaceShapes,
    decode_work_ints,
    decode_workspace_bytes,
    decode_workspace_shapes,
)
from backends.kernels.pdl import use_pdl
from backends.kernels.sm_count import capability_major, sm_count

__all__ = [
    "DEFAULT_MAX_SPLITS",
    "DecodePlan",
    "DecodeWorkspace",
    "DecodeWorkspaceShapes",
    "MAX_GRID_PROGRAMS",
    "MERGE_PROGRAMS_PER_SM",
    "MIN_WORKSPACE_SLOTS",
    "PROGRAMS_PER_SM",
    "PROGRAMS_PER_SM_TMA",
    "choose_stage1",
    "decode_programs",
    "decode_work_ints",
    "decode_workspace_bytes",
    "decode_workspace_shapes",
    "default_decode_config",
    "merge_config",
    "mla_decode",
    "programs_per_sm",
    "rows_merge_config",
    "stage1_capability",
]

#: Stage-1 programs (head_blocks * num_programs) aimed at per streaming multiprocessor with pointer loads, by
#: block_h: as many as fit on an SM at once, i.e. one wave of equal programs (block_h 16, block_n 64, 8 warps,
#: 2 stages: 92 KiB of shared memory and 107 registers, so 2 fit; block_h 64: 216 KiB, 1 fits). The TMA
#: path (see default_decode_config) holds 1 per SM (block_h 16: 162 KiB, 226 registers).
PROGRAMS_PER_SM = {16: 2, 32: 2, 64: 1}
PROGRAMS_PER_SM_TMA = 1
#: Programs per SM of the wgmma path's merge kernel (128 registers x 128 threads and little shared memory each): as
#: many as fit beside a 16 / 32-head stage 1 program (228 registers x 128 threads), so under PDL they are all
#: resident before the stage 1 ends.
MERGE_PROGRAMS_PER_SM = 2
_ROWS_TILE, _ROWS_REGS = 2048, 128  # its default tile (floats per piece batch) and register cap, for the 2 per SM
_BLOCK_B = 256  # seq_lens summed in chunks of this many requests


def programs_per_sm(block_h: int, use_tma: bool = False) -> int:
    if use_tma:
        return PROGRAMS_PER_SM_TMA
    return PROGRAMS_PER_SM.get(block_h, 2 if block_h < 16 else 1)


def default_decode_config(heads: int, dtype: torch.dtype, kv_fp8: bool = False) -> dict:
    """Default kernel parameters for ``heads`` query heads (see bench/triton_mla_kernels_gpu.py and
    docs/kernels.md to retune). ``use_tma``: TMA tile loads where the cache allows them (Hopper,
    bf16/fp16, page_size % block_n == 0); the launcher falls back to pointer loads otherwise. ``dtype``: the
    products' dtype; ``kv_fp8``: the cache is fp8 (half the bytes per tile, so 16 heads keep 3 tiles in flight:
    891.6 against 966.5 us with 2 at 64x32768 on an H100, ``python -m bench.mla_decode_grid --heads 16
    --shapes 64x32768 --dtypes fp8 --variants default,tma.s3``; 128 heads were 1.4x slower with 3)."""
    if heads <= 16:
        cfg = dict(block_h=16, block_n=64, num_warps=8, num_stages=3 if kv_fp8 else 2, use_tma=True)
    elif heads <= 32:
        cfg = dict(block_h=32, block_n=64, num_warps=8, num_stages=2, use_tma=True)
    else:
        cfg = dict(block_h=64, block_n=64, num_warps=8, num_stages=2, use_tma=True)
    if dtype == torch.float32:  # twice the bytes per tile; no TMA path
        cfg.update(block_n=16, num_stages=1, use_tma=False)
    return cfg


@dataclass(frozen=True)
class DecodePlan:
    """What the wgmma path's plan kernel wrote into ``work`` (returned by :func:`mla_decode`): the work and lengths
    tensors (by address) and every host choice the rows depend on. A later call given an equal plan skips the plan
    kernel and reads the rows already there, as every layer of one decode step can (one plan per step, as FlashInfer
    plans once for all layers); the caller vouches that ``seq_lens``' values have not changed since."""

    work_ptr: int
    seq_lens_ptr: int
    batch: int
    head_blocks: int
    programs: int
    min_chunk: int
    snap: bool
    merge_max: int


def _descriptor(kv_cache: torch.Tensor, rows: int, block_rows: int, block_cols: int):
    """Host TMA descriptor over the cache as [pages * page_size, D] rows, boxes of [block_rows, block_cols]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(kv_cache, [rows, kv_cache.shape[-1]], [kv_cache.stride(1), 1], [block_rows, block_cols])


def decode_programs(batch: int, slots: int, head_blocks: int, target_programs: int) -> int:
    """Stage-1 token chunks (the grid's program dimension) for ``batch`` requests and ``slots`` workspace
    slots: ``target_programs // head_blocks`` (<= 0: as many as the slots allow), capped so that the split
    pieces fit (``min(2 (P - 1), P - 1 + batch) <= slots``)."""
    cap = max(slots // 2 + 1, slots - batch + 1, 1)
    p = cap if target_programs <= 0 else max(1, target_programs // max(head_blocks, 1))
    return max(1, min(p, cap, MAX_GRID_PROGRAMS))


def merge_config(batch: int, heads: int, programs: int, sms: int, d_ckv: int = 512) -> dict:
    """Merge tiling: pieces per step (about the pieces of a request twice the mean length, so most requests
    take one step: the steps are a serial chain of loads), then heads and columns per program (tiles of
    <= 4096 floats, and enough programs to spread over the GPU)."""
    est = triton.cdiv(2 * programs, max(batch, 1)) + 1
    block_s = max(2, min(128, triton.next_power_of_2(est)))
    dv = min(d_ckv, 64 if block_s <= 64 else 32)
    bh = min(triton.next_power_of_2(heads), max(1, 4096 // (block_s * dv)))
    while bh > 1 and batch * triton.cdiv(heads, bh) * (d_ckv // dv) < 4 * sms:
        bh //= 2
    if bh == 1 and batch * heads * (d_ckv // dv) < 2 * sms and dv > 32:
        dv = 32
    return dict(merge_block_s=block_s, merge_block_h=bh, merge_block_dv=dv)


def rows_merge_config(
    batch: int, heads: int, programs: int, sms: int, merge_max: int, d_ckv: int = 512, kv_fp8: bool = False
) -> dict:
    """The wgmma path's merge (:mod:`backends.kernels.mla_decode.mla_decode_plan_kernels`): tiles of at most
    ``_ROWS_TILE`` floats (128 registers, so 2 programs fit beside a 16 / 32-head stage 1 program) and its grid.

    Where the stage 1 merges requests of up to ``merge_max`` pieces (bf16 / fp16), the merge kernel gets only the
    longer ones (and the empty), and at 16 / 32 heads 32 pieces x 1 head per tile (H100, ``bench.mla_decode_grid``
    graphs, 16 heads, one 70000-token request among 63 of 512: 74.5 us against 86.1 with 8 pieces x 4 heads; fa3
    78.6). Over a bf16 / fp16 cache the grid is :data:`MERGE_PROGRAMS_PER_SM` programs per SM (resident beside the
    stage 1 under PDL), also behind the seesaw kernel, which merges nothing itself (``merge_max`` 0; 128 heads
    64 x 4096: 173.0 -> 157.4 us against a program per job). Behind the 16 / 32-head fp8 kernels (``kv_fp8`` and
    ``merge_max`` 0) every split request comes here: a program per job of a batch whose every request is split (the
    fixed grid was 18 us slower at 64 x 32768, 16 heads)."""
    cfg = merge_config(batch, heads, programs, sms, d_ckv)
    if merge_max > 0 and heads <= 32:
        cfg.update(merge_block_s=32, merge_block_h=1, merge_block_dv=64)
    while cfg["merge_block_s"] * cfg["merge_block_h"] * cfg["merge_block_dv"] > _ROWS_TILE:
        key = "merge_block_h" if cfg["merge_block_h"] > 2 else "merge_block_s"
        cfg[key] //= 2
    jobs = batch * triton.cdiv(heads, cfg["merge_block_h"]) * (d_ckv // cfg["merge_block_dv"])
    cfg["merge_programs"] = jobs if kv_fp8 and merge_max == 0 else MERGE_PROGRAMS_PER_SM * sms
    return cfg


def stage1_capability(device: torch.device | str, interp: bool) -> int:
    """The compute capability major version the stage-1 choice reads: the CUDA device's, 0 off the GPU and under
    Triton's interpreter (where only the Triton stage 1 runs)."""
    return 0 if interp or torch.device(device).type != "cuda" else capability_major(device)


def choose_stage1(
    q_nope: torch.Tensor,
    kv_cache: torch.Tensor,
    work: torch.Tensor,
    capability: int,
    *,
    use_wgmma: bool | None = None,
    tiles_given: bool = False,
) -> str:
    """Which stage 1 :func:`mla_decode` runs: ``"wgmma"`` (the Gluon kernels, Hopper) or ``"triton"``.

    ``use_wgmma`` None (the default): ``"wgmma"`` where it can run on this device and problem
    (:func:`~backends.kernels.mla_decode.mla_decode_wgmma.wgmma_problems`: compute capability 9, a bf16 / fp16 / fp8
    cache, a multiple of 16 heads, DeepSeek's dims, pages of a multiple of 64 tokens) and measured faster
    (:func:`~backends.kernels.mla_decode.mla_decode_wgmma.wgmma_by_default`), unless Triton tiles were asked for
    (``tiles_given``); else ``"triton"``, the one stage 1 for the rest (the CPU and the interpreter: ``capability``
    0). ``use_wgmma`` True: ``"wgmma"``, or ValueError naming every reason it cannot run; False: ``"triton"``.
    ``capability``: :func:`stage1_capability` of the query's device."""
    why_not = wgmma_problems(q_nope, kv_cache, capability, work)
    if use_wgmma is None:
        fast = not why_not and not tiles_given and wgmma_by_default(q_nope.shape[1], kv_cache.dtype, q_nope.shape[0])
        return "wgmma" if fast else "triton"
    if use_wgmma and why_not:
        raise ValueError(
            "mla_decode(use_wgmma=True): the Gluon wgmma stage 1 cannot run on these arguments; expected "
            + "; expected ".join(why_not)
            + ". Fix: pass use_wgmma=None to run the fastest stage 1 this device and problem allow (the Triton stage 1"
            " where the wgmma kernels cannot run), or give arguments that meet the requirements above."
        )
    return "wgmma" if use_wgmma else "triton"


def _check_work(work: torch.Tensor, batch: int, heads: int, slots: int, device: torch.device) -> None:
    """ValueError (what, got, expected, fix) unless ``work`` can hold the decode plan of this call on any device."""
    need = decode_work_ints(batch, heads, slots)
    got = []
    if not isinstance(work, torch.Tensor):
        got.append(f"a {type(work).__name__}")
    else:
        if work.dtype != torch.int32:
            got.append(f"dtype {work.dtype}")
        if not work.is_contiguous():
            got.append("a non-contiguous tensor")
        if work.device != device:
            got.append(f"device {work.device} (the query is on {device})")
        if work.numel() < need:
            got.append(f"{work.numel()} elements")
    if got:
        raise ValueError(
            f"mla_decode: the decode plan space `work` cannot hold this call's plan: got {', '.join(got)}; expected a "
            f"contiguous int32 tensor on the query's device with at least {need} elements (decode_work_ints: {batch} "
            f"requests, {heads} heads, {slots} split slots = partial_out.shape[0] * max_splits). Fix: allocate the "
            f"workspace that decode_workspace_shapes(batch, heads, max_splits) gives (its .allocate(device), or its "
            f".work shape)."
        )


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
    work: torch.Tensor,
    *,
    max_splits: int = DEFAULT_MAX_SPLITS,
    min_tokens_per_split: int = 64,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    target_programs: int | None = None,
    merge_block_dv: int | None = None,
    merge_block_s: int | None = None,
    merge_block_h: int | None = None,
    merge_num_warps: int = 4,
    merge_programs: int | None = None,
    use_tma: bool | None = None,
    max_regs: int | None = None,
    snap: bool = True,
    kv_scale: float = 1.0,
    pdl: bool = False,
    use_wgmma: bool | None = None,
    plan: DecodePlan | None = None,
    seesaw: bool | None = None,
    fp8_scores: bool | None = None,
    _skip_merge: bool = False,
) -> DecodePlan | None:
    """Absorbed-MLA decode: ``out[b, h] = softmax_l((q_nope.ckv_l + q_pe.kpe_l) * sm_scale) @ ckv``.

    Parameters
    ----------
    q_nope : [B, H, D_CKV]; q_pe : [B, H, D_PE] (last dims contiguous; any dtype, cast to the cache's)
    kv_cache : [num_pages, page_size, D_CKV + D_PE] bf16/fp16/fp32, or float8_e4m3fn (dequantized in the
        kernel: products in fp16, fp32 for an fp32 q; ``kv_scale`` folded into the score scale and the
        output), last dim contiguous
    page_table : int32 [B, max_pages]; seq_lens : int32 [B] (device)
    out : [B, H, D_CKV] written in place (any float dtype)
    partial_out : float32 [R, H, max_splits, D_CKV]; partial_lse : float32 [R, H, max_splits]
        Caller-owned workspace (see :func:`decode_workspace_shapes`), used as one flat space of
        ``R * max_splits`` slots shared by the batch (any R >= 1); more slots allow more programs (see
        :func:`decode_programs`): a batch of B wants about ``2 * target_programs`` (or
        ``target_programs + B``) slots.
    work : int32 [>= decode_work_ints(B, H, R * max_splits)], contiguous, on the query's device
        The decode plan of the wgmma stage 1 (written by its plan kernel, read by its stage 1 and the merge;
        :mod:`backends.kernels.mla_decode.mla_decode_plan_kernels`), part of the workspace that
        :func:`decode_workspace_shapes` gives. Checked on every call (ValueError saying what it got and what it
        needs), whichever stage 1 runs: the Triton stage 1 plans inside its kernels and does not touch it.
    max_splits : the workspace's split dimension (``partial_out.shape[2]``).
    min_tokens_per_split : a stage-1 chunk has at least this many tokens (rounded up to block_n).
    block_n, block_h, num_warps, num_stages : kernel tiling (defaults from :func:`default_decode_config`).
    target_programs : stage-1 programs (x head blocks) to aim at; None -> ``programs_per_sm(block_h, use_tma)
        * SMs`` on CUDA (one wave), 0 (as many as the workspace slots allow) when interpreting on the CPU;
        <= 0 -> as many as the slots allow.
    merge_block_dv, merge_block_s, merge_block_h, merge_num_warps : tiling of the merge kernel (None:
        :func:`merge_config`).
    merge_programs : the wgmma path's merge grid (programs sharing the merge jobs out); None ->
        :func:`rows_merge_config`.
    use_tma : load KV tiles with TMA (Hopper+, bf16/fp16, page_size % block_n == 0, pages contiguous in the
        cache); None -> the config default where possible (on the GPU; never by default when interpreting).
    max_regs : register cap per thread for stage 1 (ptxas maxnreg; 128 with 8 warps lets 2 programs share
        an SM); None -> the config default.
    snap : a chunk of at least half the mean request length is rounded up to a multiple of it, so equal
        lengths are cut at request boundaries (no split pieces); see ``_chunk_len``.
    kv_scale : dequantization scale of an fp8 cache (real = stored * kv_scale); ignored otherwise.
    pdl : launch both stages with programmatic dependent launch where the GPU has it (sm_90+,
        :mod:`backends.kernels.pdl`).
    use_wgmma : stage 1 as a Gluon wgmma kernel (:mod:`backends.kernels.mla_decode.mla_decode_wgmma`: Hopper, a
        multiple of 16 heads, DeepSeek dims, pages of a multiple of 64 tokens; 64 heads per program for a multiple of
        64 heads, else 16 or 32 heads per program with tokens as the matrix rows; over an fp8 cache fp8 scores and
        ``P @ V`` over the tile widened by warps of their own); None -> where the device and problem allow it,
        measured faster (``wgmma_by_default``) and no Triton tiling (block_h, block_n, num_warps, num_stages) was
        given, else the Triton stage 1 (on the CPU and under the interpreter: compute capability 0); True where it
        cannot run is a ValueError naming every reason; False -> the Triton stage 1. :func:`choose_stage1` decides.
    plan : the plan an earlier call returned: where it equals this call's (same ``work`` and ``seq_lens`` tensors,
        batch, heads, cache dtype class and chunking), the plan kernel is not launched and ``work``'s rows are read
        as they are. Only for calls between which ``seq_lens``' values did not change (the layers of one step).
    seesaw : 64-head blocks of the wgmma path run the two-warpgroup seesaw kernel
        (:mod:`backends.kernels.mla_decode.mla_decode_seesaw_kernels`; every split request goes to the merge kernel);
        None -> where it measured faster (``seesaw_by_default``: 128 heads and more from 64 requests, bf16 / fp16
        caches), False -> the lock-step kernel (over an fp8 cache: see ``fp8_scores``).
    fp8_scores : 64-head blocks of the wgmma path over an fp8 cache: True -> the scores as fp8 products
        (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_heads_kernels`, faster), False -> fp16 products (the
        lock-step kernel, each tile widened first: for scores in the thousands, see
        ``mla_decode_wgmma.FP8_HEADS_KERNEL``), None -> ``FP8_HEADS_KERNEL``. Ignored for other caches and head blocks.
    _skip_merge : benchmarking only: launch stage 1 alone (split requests get no output).

    Returns
    -------
    DecodePlan or None
        The wgmma path's plan, written or reused (give it as ``plan`` to the next layer's call); None where the Triton
        stage 1 ran (it plans inside its kernels).

    Raises
    ------
    ValueError
        An argument of the wrong form, a ``work`` too small for the workspace's slots, or ``use_wgmma=True`` where
        the wgmma stage 1 cannot run; each says what it got, what it expected and the fix.

    Examples
    --------
    Allocate the workspace :func:`decode_workspace_shapes` gives and pass all of it; on a Hopper GPU the call then
    takes the wgmma stage 1 (and returns its plan), elsewhere the Triton one (and returns None):

    >>> import torch
    >>> from backends.kernels.mla_decode.mla_decode import decode_workspace_shapes, mla_decode
    >>> dev = "cuda" if torch.cuda.is_available() else "cpu"
    >>> B, H, page, pages = 2, 16, 64, 4
    >>> kv_cache = torch.randn(B * pages, page, 512 + 64, dtype=torch.bfloat16, device=dev)
    >>> page_table = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
    >>> seq_lens = torch.tensor([100, 37], dtype=torch.int32, device=dev)
    >>> q_nope = torch.randn(B, H, 512, dtype=torch.bfloat16, device=dev)
    >>> q_pe = torch.randn(B, H, 64, dtype=torch.bfloat16, device=dev)
    >>> out = torch.empty(B, H, 512, dtype=torch.bfloat16, device=dev)
    >>> workspace = decode_workspace_shapes(B, H).allocate(dev)  # partial_out, partial_lse, work
    >>> plan = mla_decode(q_nope, q_pe, kv_cache, page_table, seq_lens, 576**-0.5, out, *workspace)
    >>> bool(out.isfinite().all())
    True
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
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    require(
        kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32) or kv_fp8,
        "kv_cache dtype bfloat16, float16, float32 or float8_e4m3fn",
    )
    require(not kv_fp8 or q_nope.dtype in (torch.bfloat16, torch.float16, torch.float32),
            "an fp8 cache needs a bf16 / fp16 / fp32 query (the products run in fp16, or fp32 for an fp32 query)")
    # the dtype the products run in: the cache's; over an fp8 cache fp16 (fp32 for an fp32 q), see _q_to
    cdt = (torch.float32 if q_nope.dtype == torch.float32 else torch.float16) if kv_fp8 else kv_cache.dtype
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
        partial_out.dim() == 4 and partial_out.shape[0] >= 1 and partial_out.shape[1] >= H,
        "partial_out.dim() == 4 and partial_out.shape[0] >= 1 and partial_out.shape[1] >= H",
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
    require(B <= 65535, "grid.x limit: at most 65535 requests per call")
    slots = partial_out.shape[0] * max_splits
    _check_work(work, B, H, slots, q_nope.device)  # on every call: a workspace that runs here runs on Hopper too
    if B == 0:
        return None

    cfg = default_decode_config(H, cdt, kv_fp8)
    tiles_given = (block_h, block_n, num_warps, num_stages) != (None, None, None, None)
    block_h = cfg["block_h"] if block_h is None else block_h
    block_n = cfg["block_n"] if block_n is None else block_n
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    num_stages = cfg["num_stages"] if num_stages is None else num_stages
    require(block_h >= 16 and block_n >= 16, "tl.dot needs tiles of at least 16")
    require(
        triton.next_power_of_2(block_h) == block_h and triton.next_power_of_2(block_n) == block_n,
        "triton.next_power_of_2(block_h) == block_h and triton.next_power_of_2(block_n) == block_n",
    )

    interp = interpreted(_mla_decode_stage1_kernel)
    on_gpu = q_nope.is_cuda and not interp
    sms = sm_count(q_nope.device, 4) if on_gpu else 4
    capability = stage1_capability(q_nope.device, interp)
    stage1 = choose_stage1(q_nope, kv_cache, work, capability, use_wgmma=use_wgmma, tiles_given=tiles_given)
    use_wgmma = stage1 == "wgmma"
    if use_wgmma:  # its fixed tiling; one program (~180-225 KiB of shared memory) per SM
        block_h, block_n = wgmma_block_h(H, kv_cache.dtype), WGMMA_BLOCK_N
        target_programs = sms if target_programs is None else target_programs
    head_blocks = triton.cdiv(H, block_h)
    tma_ok = (
        cdt in (torch.bfloat16, torch.float16)
        and kv_cache.shape[1] % block_n == 0
        and kv_cache.stride(0) == kv_cache.shape[1] * kv_cache.stride(1)
        and D_CKV % 2 == 0
        and D_CKV // 2 <= 256
        and block_n <= 256
        # Hopper TMA on the GPU; the interpreter only for fp16 (it computes bf16 dots wrong)
        and (
            (on_gpu and capability_major(q_nope.device) >= 9)
            or (interp and kv_cache.dtype == torch.float16)
        )
    )
    if use_tma is None:  # the default: where possible, on the GPU only
        use_tma = bool(cfg.get("use_tma", False)) and tma_ok and not interp
    require(
        not use_tma or tma_ok, "use_tma needs a bf16/fp16 cache, page_size % block_n == 0, contiguous pages, sm_90+"
    )
    if target_programs is None:
        target_programs = programs_per_sm(block_h, use_tma) * sms if on_gpu else 0
    programs = decode_programs(B, slots, head_blocks, target_programs)
    # decode_work_ints bounds every call's plan (programs <= slots, head blocks of >= 16 heads), checked above
    require(not use_wgmma or work.numel() >= plan_ints(programs, B, head_blocks), "work of >= plan_ints(...) int32")
    min_chunk = triton.cdiv(min_tokens_per_split, block_n) * block_n

    if use_wgmma:
        require(not (seesaw and kv_fp8), "seesaw=True needs a bf16 / fp16 cache (the seesaw kernel has no fp8 path); "
                "leave seesaw=None for fp8 caches (64-head blocks run the 64-head fp8 kernel)")
        seesaw = block_h == WGMMA_BLOCK_H and (seesaw_by_default(H, kv_cache.dtype, B) if seesaw is None else seesaw)
        merge_max = stage1_merge_max(kv_cache.dtype, seesaw, block_h)
        mcfg = rows_merge_config(B, H, programs, sms, merge_max, D_CKV, kv_fp8)
        merge_programs = mcfg["merge_programs"] if merge_programs is None else merge_programs
    else:
        mcfg = merge_config(B, H, programs, sms, D_CKV)
    if interp:  # fewer, bigger merge programs: the interpreter pays per program
        mcfg.update(merge_block_dv=min(D_CKV, 128), merge_block_h=triton.next_power_of_2(H))
    merge_block_dv = mcfg["merge_block_dv"] if merge_block_dv is None else merge_block_dv
    merge_block_s = mcfg["merge_block_s"] if merge_block_s is None else merge_block_s
    merge_block_h = mcfg["merge_block_h"] if merge_block_h is None else merge_block_h
    require(D_CKV % merge_block_dv == 0, "D_CKV % merge_block_dv == 0")

    desc_c = desc_pe = None
    if use_tma and not use_wgmma:  # the Triton stage 1's descriptors (the wgmma launcher builds its own)
        rows = kv_cache.shape[0] * kv_cache.shape[1]
        desc_c = _descriptor(kv_cache, rows, block_n, D_CKV // 2)
        desc_pe = _descriptor(kv_cache, rows, block_n, D_PE)

    upcast = interp and cdt == torch.bfloat16
    prec = "ieee" if cdt == torch.float32 else "tf32"
    out_scale = float(kv_scale) if kv_fp8 else 1.0
    qk_scale = float(sm_scale) * _LOG2E * out_scale
    max_regs = cfg.get("max_regs") if max_regs is None else max_regs
    extra = {} if interp else dict(num_warps=num_warps, num_stages=num_stages)
    if max_regs and not interp:
        extra["maxnreg"] = int(max_regs)
    pdl = use_pdl(pdl, _mla_decode_stage1_kernel, q_nope.device)
    if pdl:
        extra["launch_pdl"] = True

    written = None
    if use_wgmma:
        written = DecodePlan(work.data_ptr(), seq_lens.data_ptr(), B, head_blocks, programs, min_chunk, bool(snap),
                             merge_max)  # fmt: skip
        launch_wgmma_stage1(
            q_nope, q_pe, kv_cache, page_table, seq_lens, work, partial_out, partial_lse, out, qk_scale=qk_scale,
            out_scale=out_scale, block_h=block_h, programs=programs, min_chunk=min_chunk, snap=snap,
            max_splits=max_splits, block_b=_BLOCK_B, pdl=pdl, merge_max=merge_max, run_plan=plan != written,
            seesaw=seesaw, fp8_scores=fp8_scores,
        )  # fmt: skip
    else:
        _mla_decode_stage1_kernel[(head_blocks, programs)](
            q_nope, q_pe, kv_cache, desc_c, desc_pe, page_table, seq_lens, partial_out, partial_lse, out, qk_scale,
            out_scale, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0),
            kv_cache.stride(1), page_table.stride(0), partial_out.stride(0), partial_out.stride(1),
            partial_out.stride(2), partial_lse.stride(0), partial_lse.stride(1), partial_lse.stride(2), out.stride(0),
            out.stride(1), H, B, programs, min_chunk, int(bool(snap)), max_splits,
            PAGE_SIZE=kv_cache.shape[1], D_CKV=D_CKV, D_PE=D_PE, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_B=_BLOCK_B,
            PREC=prec, UPCAST=upcast, USE_TMA=use_tma, KV_FP8=kv_fp8, PDL=pdl, **extra,
        )  # fmt: skip
    if _skip_merge:
        return written
    strides = (partial_out.stride(0), partial_out.stride(1), partial_out.stride(2), partial_lse.stride(0),
               partial_lse.stride(1), partial_lse.stride(2), out.stride(0), out.stride(1))  # fmt: skip
    merge_kw = dict(BLOCK_S=merge_block_s, BLOCK_HM=merge_block_h, BLOCK_DV=merge_block_dv, PDL=pdl)
    if use_wgmma:  # from the plan's rows (see rows_merge_config)
        extra2 = {} if interp else dict(num_warps=merge_num_warps, num_stages=1, launch_pdl=pdl, maxnreg=_ROWS_REGS)
        _mla_decode_merge_rows_kernel[(max(1, merge_programs),)](
            partial_out, partial_lse, seq_lens, work[8 * programs :], out, *strides, H, B, max_splits, D_CKV=D_CKV,
            BLOCK_B=_BLOCK_B, **merge_kw, **extra2,
        )  # fmt: skip
    else:
        extra2 = {} if interp else dict(num_warps=merge_num_warps, num_stages=2, launch_pdl=pdl)
        _mla_decode_stage2_kernel[(B, triton.cdiv(H, merge_block_h), D_CKV // merge_block_dv)](
            partial_out, partial_lse, seq_lens, out, *strides, H, B, programs, min_chunk, int(bool(snap)), max_splits,
            BLOCK_N=block_n, BLOCK_B=_BLOCK_B, **merge_kw, **extra2,
        )  # fmt: skip
    return written
