"""Launch of the Gluon (wgmma) stage 1 of the absorbed-MLA decode on Hopper, in seven kernels:

* 64 heads per program, heads as the matrix rows, both warpgroups on every tile
  (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_kernels`): a bf16 / fp16 cache (the default at 64 heads) or, with
  :data:`FP8_HEADS_KERNEL` False, an fp8 one (each tile widened to fp16 in shared memory first: fp16 products);
* the same layout over an fp8 cache with the scores as fp8 products of q split into two e4m3 parts and the tiles
  widened by warps of their own (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_heads_kernels`; the default for
  fp8 at 64 and 128 heads, 17-20% faster than the lock-step kernel at 64 x 32768);
* 64 heads per program in a seesaw, each warpgroup on its own tile of a pair
  (:mod:`backends.kernels.mla_decode.mla_decode_seesaw_kernels`): a bf16 / fp16 cache, the default from 128 heads;
* 16 or 32 heads per program, tokens as the matrix rows
  (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_tokens_kernels`): a bf16 / fp16 cache and fewer heads;
* 16 or 32 heads per program over an fp8 cache (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_kernels`): the
  scores as fp8 products of q split into two e4m3 parts, straight from the fp8 tile, and ``P @ V`` in fp16 over the tile
  widened in shared memory by warps of their own (one multiplier warpgroup per 16 heads);
* 32 heads per program over an fp8 cache from :data:`FP8_ROLES_MIN_BATCH` requests
  (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_roles_kernels`): the same products split by role, a scorer
  warpgroup (the heads as the rows of the fp8 scores, the softmax along them) and an accumulator warpgroup
  (``P @ V``), 20% faster than two multipliers at 64 x 32768.

:func:`backends.kernels.mla_decode.mla_decode.mla_decode` picks one for caches it can read (see :func:`wgmma_problems`
and :func:`wgmma_block_h`); the plan and the merge stay the Triton ones, so the outputs (finished requests, split
pieces in the flat slot space) are the same as the Triton stage 1's. Gluon is imported only when this path
launches: the rest of the package imports on any Triton.
"""

from __future__ import annotations

import torch

from backends.kernels.mla_decode.mla_decode_plan_kernels import _mla_decode_plan_kernel

#: The 64-head kernel's fixed tiling: 64 heads x 64 tokens per tile, two warpgroups, ~224 KiB of shared memory.
WGMMA_BLOCK_H = 64
WGMMA_BLOCK_N = 64
WGMMA_WARPS = 8
#: The seesaw kernel's warps at launch: warpgroup A (its worker partition, warpgroup B, adds 4 more).
SEESAW_WARPS = 4
#: The tokens kernel: one warpgroup, two bf16 / fp16 KV tiles (2 x 72 KiB) in flight.
TOKENS_WARPS = 4
TOKENS_STAGES = 2
#: The fp8 kernel: fp8 TMA stages (36 KiB each), widened buffers and, by heads per program, the parts a tile is
#: widened in (a buffer holds 64 / parts rows of the fp16 latent: 64 KiB / parts). 32 heads (two multipliers, 36 KiB of
#: split q) fit two stages and two half-tile buffers (177 KiB). H100, 32 heads, 64 x 32768 (docs/kernels.md):
#: 621.9 us against 639.2 with one whole-tile buffer, 632.0 with three half-tile buffers, 631.7 with three stages;
#: 16 heads: 455.4 against 457.1 with four half-tile buffers, 455.5 with three stages and two half-tile buffers.
FP8_STAGES = 2
FP8_WIDENED = 2
FP8_PARTS = {16: 1, 32: 2}
#: Columns per accumulator chain of the fp8 kernel's scores (see ``_wait_scores``): 128 is as precise as fp16
#: products and free at 16 heads; at 32 heads it spills (5.6% slower), so 256.
FP8_CHAIN = {16: 128, 32: 256}
#: 32 heads per program over an fp8 cache from this many requests: the roles kernel
#: (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_roles_kernels`: a scorer and an accumulator warpgroup share
#: each tile's work by role, the heads as the scores' rows) instead of the fp8 kernel's two multipliers (one per 16
#: heads). H100, graph replays, us two multipliers -> roles: 64 x 32768 630.5 -> 497-512, 128 x varied 8192 345.4 ->
#: 280-287, 64 x 4096 126.5 -> 118-119, 32 x 2048 62.8 -> 62.9, 32 x 4096 80.3 -> 80.4; below 32 requests 1-1.5 us
#: slower where a program has few tiles (8 x 2048 30.3 -> 31.7, 16 x 4096 48.2 -> 49.4) though faster at long contexts
#: (8 x 32768 101.1 -> 92.3), which the launcher cannot see (docs/kernels.md). Its fp8 stages, widened buffers
#: (of 64 / FP8_PARTS[32] rows) and ``P^T`` slots: 217 KiB.
FP8_ROLES_MIN_BATCH = 32
FP8_ROLES_STAGES = 3
FP8_ROLES_WIDENED = 2
FP8_ROLES_PB = 2
#: 64-head blocks over an fp8 cache: the warp-specialized kernel with fp8 score products
#: (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_heads_kernels`) when True, else the lock-step kernel widening
#: each tile itself (fp16 products). H100, 64 heads 64 x 32768 872.2 -> 722.5 us, 128 heads 1712.0 -> 1364.1
#: (docs/kernels.md). Like the 16 / 32-head fp8 kernel, its scores carry the fp8 accumulation's error, up to
#: 6e-4 of the largest score: for heads whose scores reach the thousands with near-tied maxima the output can be off
#: by percents (16% on one such problem of 64 heads; 8 random problems: at most 4.5e-3 here, 1.6e-2 for the 16-head
#: kernel), where fp16 products stay under 1e-3; False keeps those. Its fp8 stages and widened tiles (one: two do not
#: fit beside two stages).
FP8_HEADS_KERNEL = True
FP8_HEADS_STAGES = 2
FP8_HEADS_WIDENED = 1
_D_CKV, _D_PE = 512, 64
_HALF = (torch.bfloat16, torch.float16)


def wgmma_block_h(heads: int, kv_dtype: torch.dtype) -> int:
    """Heads per program of the wgmma stage 1 for this head count and cache (0: no kernel tiles it): 64 (the 64-head
    kernels) for a multiple of 64 heads, else 32 or 16 (the tokens kernel, or over an fp8 cache the fp8 kernel)."""
    if kv_dtype in (*_HALF, torch.float8_e4m3fn) and heads % WGMMA_BLOCK_H == 0:
        return WGMMA_BLOCK_H
    if heads % 32 == 0 and kv_dtype in (*_HALF, torch.float8_e4m3fn):
        return 32
    return 16 if heads % 16 == 0 else 0


#: Over a bf16 / fp16 cache, split requests of at most this many pieces are merged by the stage 1 itself (the program
#: that finishes the last piece reads the others' partials back from L2; one round trip per piece, so more pieces
#: are left to the merge kernel, which spreads them over the GPU). H100, docs/kernels.md: 16 heads 64 x 4096
#: 137.5 -> 128.2 us, 64 heads 189.9 -> 147.9; with no merge kernel at all 125.2, but a request of 70000 tokens
#: among short ones took 123.6 us against 67.9. The fp8 kernel keeps the merge kernel (6% slower at 64 x 32768
#: with the merge in it).
MERGE_MAX_PIECES = 4
#: The seesaw kernel (two warpgroups, for 64-head blocks over bf16 / fp16) is the default from SEESAW_MIN_HEADS heads
#: and SEESAW_MIN_BATCH requests. H100, ``bench.mla_decode_grid --graph``, plan reused, us lock-step -> seesaw:
#: 128 heads 64 x 1024 67.8 -> 63.9, 64 x 4096 199.5 -> 171.6, 64 x 32768 1531.6 -> 1268.3, 128 x varied 8192
#: 771.2 -> 673.8, but 16 x 2048 56.9 -> 109.3, 16 x 4096 79.2 -> 128.9, 32 x 2048 75.9 -> 145.5 (why: not
#: measured); 64 heads slower everywhere (142.1 -> 213.1 at 64 x 4096, 868.4 -> 932.1 at 64 x 32768): one head block
#: per tile, so nothing else reads it from L2, and the seesaw's loads, issued only as its boxes free up, keep fewer
#: bytes in flight than the lock-step kernel's second stage where the bytes are the bound.
SEESAW_MIN_HEADS = 128
SEESAW_MIN_BATCH = 64
#: Where each kernel is the default: H100, ``bench.mla_decode_grid --graph --no-fi --variants
#: triton.pdl,wgmma.pdl.reuse`` (the plan reused, as by a decode step's later layers; docs/kernels.md), us
#: Triton -> wgmma stage 1:
#: - 16-head blocks, bf16: faster at every batch measured but one: 1 x 1024 18.6 -> 13.6, 1 x 4096 20.4 -> 17.4,
#:   2 x 2048 20.7 -> 16.4, 4 x 4096 28.7 -> 24.9, 8 x 2048 30.9 -> 28.9 (slower at 16 x 1024, 31.1 -> 35.9). The
#:   batch-1 decode step (16 layers of ``h100_triton_tp8``) took 1760.4 -> 1699.6 us of kernels with it.
#: - 32-head blocks, bf16: faster at 1 x 1024 (21.0 -> 17.0) but slower at 1 x 8192 (25.2 -> 26.9), 2 x 4096, 8 x 2048
#:   (39.7 -> 42.1) and 16 x 1024 (42.1 -> 60.2); faster at 32 x 4096 and 128 x 1024 in an earlier session, before
#:   the plan was reused (108.5 -> 95.5, 95.9 -> 82.7): the default from 32 requests.
#: - fp8 up to 32 heads (one program per 16 or 32 heads, each tile read once per program): faster at every shape
#:   measured, from 1 x 1024 (16 heads 19.7 -> 15.3, 15.4-16.2 with the fp8 scores; 32 heads 22.5 -> 17.1 with the
#:   kernel before) to 64 x 32768 (887 -> 455 at 16 heads); 16-head programs lost at 64 and 128
#:   heads (1849 vs 1472, 3713 vs 2812, with fp16 scores), so :data:`FP8_MAX_HEADS`.
#: - 64-head blocks (bf16 / fp16 and fp8): from :data:`WGMMA_MIN_JOBS` (request, head block) pairs. bf16 64 heads
#:   4 x 4096 52.2 -> 64.5, 8 x 2048 58.5 -> 62.8, 16 x 2048 73.5 -> 74.4, 16 x 4096 94.4 -> 90.4, 32 x 2048
#:   108.6 -> 66.9; 128 heads 4 x 4096 67.0 -> 65.1, 8 x 2048 70.3 -> 68.3, 16 x 2048 103.9 -> 56.9. fp8 64 heads
#:   4 x 2048 45.2 -> 59.9, 8 x 4096 70.1 -> 68.7, 16 x 4096 97.2 -> 84.4 (16 x 1024 60.8 -> 65.3); 128 heads
#:   4 x 2048 56.3 -> 60.5, 8 x 4096 94.6 -> 83.2, 16 x 1024 84.3 -> 48.4.
WGMMA_MIN_JOBS = 16
#: bf16 / fp16 caches: requests from which the tokens kernel runs, by heads per program
TOKENS_MIN_BATCH = {16: 1, 32: 32}
FP8_MAX_HEADS = 32


def wgmma_by_default(heads: int, kv_dtype: torch.dtype, batch: int) -> bool:
    """Whether ``mla_decode(use_wgmma=None)`` takes the wgmma stage 1 where it can run: where it measured faster
    than the Triton stage 1 on an H100 (the measurements above :data:`WGMMA_MIN_JOBS`): 64-head blocks from
    :data:`WGMMA_MIN_JOBS` (request, head block) pairs; 16 / 32-head blocks over a bf16 / fp16 cache from
    :data:`TOKENS_MIN_BATCH` requests, over an fp8 cache with at most :data:`FP8_MAX_HEADS` heads at every batch."""
    block_h = wgmma_block_h(heads, kv_dtype)
    if not block_h:
        return False
    if block_h == WGMMA_BLOCK_H:
        return batch * (heads // WGMMA_BLOCK_H) >= WGMMA_MIN_JOBS
    if kv_dtype == torch.float8_e4m3fn:
        return heads <= FP8_MAX_HEADS
    return kv_dtype in _HALF and batch >= TOKENS_MIN_BATCH[block_h]


def fp8_roles(block_h: int, batch: int) -> bool:
    """Whether a 16 / 32-head block over an fp8 cache runs the roles kernel (32 heads from
    :data:`FP8_ROLES_MIN_BATCH` requests) rather than the fp8 kernel."""
    return block_h == 32 and batch >= FP8_ROLES_MIN_BATCH


def seesaw_by_default(heads: int, kv_dtype: torch.dtype, batch: int) -> bool:
    """Whether 64-head blocks run the seesaw kernel when ``mla_decode`` is not told: from :data:`SEESAW_MIN_HEADS`
    heads and :data:`SEESAW_MIN_BATCH` requests over a bf16 / fp16 cache, where it measured faster (it has no fp8
    path)."""
    return heads >= SEESAW_MIN_HEADS and batch >= SEESAW_MIN_BATCH and kv_dtype in _HALF


def stage1_merge_max(kv_dtype: torch.dtype, seesaw: bool = False, block_h: int = WGMMA_BLOCK_H) -> int:
    """Split requests of at most this many pieces the wgmma stage 1 merges itself (0: the merge kernel does them
    all): :data:`MERGE_MAX_PIECES` in the 64-head lock-step and fp8 kernels (any cache) and the tokens kernel (16 / 32
    heads, bf16 / fp16), 0 in the 16 / 32-head fp8 kernels and the seesaw kernel."""
    if seesaw:
        return 0
    return MERGE_MAX_PIECES if kv_dtype in _HALF or block_h == WGMMA_BLOCK_H else 0


def wgmma_problems(q_nope: torch.Tensor, kv_cache: torch.Tensor, capability: int, work: torch.Tensor | None) -> list:
    """Why the wgmma stage 1 cannot run on these arguments (empty: it can). ``capability``: the GPU's compute
    capability major version (0 off the GPU or under Triton's interpreter)."""
    H, d_ckv = q_nope.shape[1], q_nope.shape[2]
    d_pe = kv_cache.shape[-1] - d_ckv
    out = []
    if capability != 9:
        out.append(f"a Hopper GPU (wgmma; compute capability 9), got {capability or 'no GPU'}")
    if kv_cache.dtype not in (*_HALF, torch.float8_e4m3fn):
        out.append(f"a bf16 / fp16 / fp8 e4m3 cache, got {kv_cache.dtype}")
    if kv_cache.dtype == torch.float8_e4m3fn and q_nope.dtype not in _HALF:
        out.append(f"a bf16 / fp16 query over an fp8 cache (fp16 products), got {q_nope.dtype}")
    if not wgmma_block_h(H, kv_cache.dtype):
        out.append(f"a multiple of 16 heads, got {H}")
    if (d_ckv, d_pe) != (_D_CKV, _D_PE):
        out.append(f"DeepSeek's latent dims ({_D_CKV} + {_D_PE}), got {d_ckv} + {d_pe}")
    if kv_cache.shape[1] % WGMMA_BLOCK_N or kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        out.append(f"contiguous pages of a multiple of {WGMMA_BLOCK_N} tokens, got page size {kv_cache.shape[1]}")
    if work is None or work.dtype != torch.int32 or not work.is_contiguous():
        out.append("a contiguous int32 work list (mla_decode's work=)")
    return out


def launch_wgmma_stage1(
    q_nope, q_pe, kv_cache, page_table, seq_lens, work, partial_out, partial_lse, out, *, qk_scale: float,
    out_scale: float, block_h: int, programs: int, min_chunk: int, snap: bool, max_splits: int, block_b: int,
    pdl: bool, merge_max: int, run_plan: bool = True, seesaw: bool = False, fp8_scores: bool | None = None,
) -> None:  # fmt: skip
    """The plan kernel (writes ``work``, :mod:`backends.kernels.mla_decode.mla_decode_plan_kernels`) then the wgmma
    stage 1 over ``(H // block_h, programs)`` (``block_h``: :func:`wgmma_block_h`'s choice), which merges split requests
    of at most ``merge_max`` pieces itself (0: none). The caller then launches the merge from the plan's per-request
    rows (``work[8 * programs:]``, :func:`backends.kernels.mla_decode.mla_decode.rows_merge_config`), for the other
    split requests and the empty ones. With ``pdl`` the plan kernel and the 16 / 32-head stage 1 (tokens and fp8
    kernels) are launched with programmatic dependent launch (each waits on the GPU for its predecessor's writes,
    then lets its successor launch): about 1 us less per call at 16 heads. The 64-head kernels are not (see the
    launch below). ``run_plan`` False: ``work`` already holds this plan (an earlier call of the same step wrote it;
    the stage 1 re-arms the piece counters it uses), so the plan kernel is not launched. ``seesaw``: 64-head blocks
    run the two-warpgroup seesaw kernel (:mod:`backends.kernels.mla_decode.mla_decode_seesaw_kernels`; ``merge_max``
    must be 0). ``fp8_scores``: 64-head blocks over an fp8 cache run the fp8-scores kernel (True) or the lock-step one
    (False); None: :data:`FP8_HEADS_KERNEL`. 32-head blocks over an fp8 cache run the roles kernel from
    :data:`FP8_ROLES_MIN_BATCH` requests (:func:`fp8_roles`)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from backends.kernels.mla_decode.mla_decode_seesaw_kernels import _mla_decode_seesaw_kernel
    from backends.kernels.mla_decode.mla_decode_wgmma_fp8_heads_kernels import _mla_decode_wgmma_fp8_heads_kernel
    from backends.kernels.mla_decode.mla_decode_wgmma_fp8_kernels import _mla_decode_wgmma_fp8_kernel
    from backends.kernels.mla_decode.mla_decode_wgmma_fp8_roles_kernels import _mla_decode_wgmma_fp8_roles_kernel
    from backends.kernels.mla_decode.mla_decode_wgmma_kernels import _mla_decode_wgmma_kernel
    from backends.kernels.mla_decode.mla_decode_wgmma_tokens_kernels import _mla_decode_wgmma_tokens_kernel

    B, H, _ = q_nope.shape
    if run_plan:
        _mla_decode_plan_kernel[(programs,)](
            seq_lens, work, B, programs, min_chunk, int(bool(snap)), H // block_h,
            BLOCK_N=WGMMA_BLOCK_N, BLOCK_B=block_b, MERGE_MAX=merge_max, PDL=pdl, num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float8_e4m3fn: gl.float8e4nv}[kv_cache.dtype]
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    shape, strides = [rows, kv_cache.shape[-1]], [kv_cache.stride(1), 1]
    lay_c = gl.NVMMASharedLayout.get_default_for([WGMMA_BLOCK_N, _D_CKV // 2], gdt)
    lay_pe = gl.NVMMASharedLayout.get_default_for([WGMMA_BLOCK_N, _D_PE], gdt)
    desc_c = TensorDescriptor(kv_cache, shape, strides, [WGMMA_BLOCK_N, _D_CKV // 2], lay_c)
    desc_pe = TensorDescriptor(kv_cache, shape, strides, [WGMMA_BLOCK_N, _D_PE], lay_pe)
    args = (
        q_nope, q_pe, desc_c, desc_pe, page_table, seq_lens, work, partial_out, partial_lse, out, qk_scale, out_scale,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), page_table.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), partial_lse.stride(2), out.stride(0), out.stride(1), max_splits,
        B,
    )  # fmt: skip
    dims = dict(PAGE_SIZE=kv_cache.shape[1], D_CKV=_D_CKV, D_PE=_D_PE, BLOCK_H=block_h, BLOCK_N=WGMMA_BLOCK_N,
                MERGE=merge_max)
    if block_h == WGMMA_BLOCK_H and seesaw:  # one warpgroup per tile of a pair (its own launch: 4 + 4 warps)
        _mla_decode_seesaw_kernel[(H // block_h, programs)](*args, **dims, num_warps=SEESAW_WARPS)
    elif block_h == WGMMA_BLOCK_H and kv_cache.dtype == torch.float8_e4m3fn and (
        FP8_HEADS_KERNEL if fp8_scores is None else fp8_scores
    ):
        _mla_decode_wgmma_fp8_heads_kernel[(H // block_h, programs)](
            *args, **dims, STAGES=FP8_HEADS_STAGES, WIDENED=FP8_HEADS_WIDENED, num_warps=WGMMA_WARPS
        )
    elif block_h == WGMMA_BLOCK_H:  # without PDL: with it, 128 heads at long contexts measured 1-4% slower (H100)
        _mla_decode_wgmma_kernel[(H // block_h, programs)](*args, **dims, num_warps=WGMMA_WARPS)
    elif kv_cache.dtype == torch.float8_e4m3fn and fp8_roles(block_h, B):  # a scorer and an accumulator warpgroup
        _mla_decode_wgmma_fp8_roles_kernel[(H // block_h, programs)](
            *args, **dims, STAGES=FP8_ROLES_STAGES, WIDENED=FP8_ROLES_WIDENED, PARTS=FP8_PARTS[block_h],
            PB=FP8_ROLES_PB, PDL=pdl, launch_pdl=pdl, num_warps=TOKENS_WARPS,
        )  # fmt: skip
    elif kv_cache.dtype == torch.float8_e4m3fn:  # tokens as the matrix rows, widened from TMA stages by own warps
        _mla_decode_wgmma_fp8_kernel[(H // block_h, programs)](
            *args, **dims, STAGES=FP8_STAGES, WIDENED=FP8_WIDENED, PARTS=FP8_PARTS[block_h],
            CHAIN=FP8_CHAIN[block_h], PDL=pdl, launch_pdl=pdl, num_warps=TOKENS_WARPS,
        )  # fmt: skip
    else:  # tokens as the matrix rows
        _mla_decode_wgmma_tokens_kernel[(H // block_h, programs)](*args, **dims, STAGES=TOKENS_STAGES, PDL=pdl,
                                                                  launch_pdl=pdl, num_warps=TOKENS_WARPS)
