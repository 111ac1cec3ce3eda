"""Launch of the Gluon (wgmma) stage 1 of the absorbed-MLA decode: 64 heads per program on Hopper.

:func:`backends.kernels.mla_decode.mla_decode` picks it for caches it can read (see :func:`wgmma_problems`); the
plan and the merge stay the Triton ones, so the outputs (finished requests, split pieces in the flat slot space)
are the same as the Triton stage 1's. Gluon is imported only when this path launches: the rest of the package
imports on any Triton.
"""

from __future__ import annotations

import torch
import triton

from backends.kernels.mla_decode_plan_kernels import _mla_decode_plan_kernel

#: The kernel's fixed tiling: 64 heads x 64 tokens per tile, two warpgroups, ~224 KiB of shared memory.
WGMMA_BLOCK_H = 64
WGMMA_BLOCK_N = 64
WGMMA_WARPS = 8
_D_CKV, _D_PE = 512, 64


def wgmma_problems(q_nope: torch.Tensor, kv_cache: torch.Tensor, capability: int, work: torch.Tensor | None) -> list:
    """Why the wgmma stage 1 cannot run on these arguments (empty: it can). ``capability``: the GPU's compute
    capability major version (0 off the GPU or under Triton's interpreter)."""
    H, d_ckv = q_nope.shape[1], q_nope.shape[2]
    d_pe = kv_cache.shape[-1] - d_ckv
    out = []
    if capability != 9:
        out.append(f"a Hopper GPU (wgmma; compute capability 9), got {capability or 'no GPU'}")
    if kv_cache.dtype not in (torch.bfloat16, torch.float16):
        out.append(f"a bf16 / fp16 cache, got {kv_cache.dtype}")
    if H % WGMMA_BLOCK_H:
        out.append(f"a multiple of {WGMMA_BLOCK_H} heads, got {H}")
    if (d_ckv, d_pe) != (_D_CKV, _D_PE):
        out.append(f"DeepSeek's latent dims ({_D_CKV} + {_D_PE}), got {d_ckv} + {d_pe}")
    if kv_cache.shape[1] % WGMMA_BLOCK_N or kv_cache.stride(0) != kv_cache.shape[1] * kv_cache.stride(1):
        out.append(f"contiguous pages of a multiple of {WGMMA_BLOCK_N} tokens, got page size {kv_cache.shape[1]}")
    if work is None or work.dtype != torch.int32 or not work.is_contiguous():
        out.append("a contiguous int32 work list (mla_decode's work=)")
    return out


def launch_wgmma_stage1(
    q_nope, q_pe, kv_cache, page_table, seq_lens, work, partial_out, partial_lse, out, *, qk_scale: float,
    out_scale: float, programs: int, min_chunk: int, snap: bool, max_splits: int, block_b: int, pdl: bool,
) -> None:  # fmt: skip
    """The plan kernel (writes ``work``, :mod:`backends.kernels.mla_decode_plan_kernels`) then the wgmma stage 1
    over ``(H // 64, programs)``; the caller then launches the merge with ``BLOCK_N = WGMMA_BLOCK_N`` and the plan's
    per-request rows (``REQ = work[8 * programs:]``)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from backends.kernels.mla_decode_wgmma_kernels import _mla_decode_wgmma_kernel

    B, H, _ = q_nope.shape
    _mla_decode_plan_kernel[(programs,)](
        seq_lens, work, B, programs, min_chunk, int(bool(snap)),
        BLOCK_N=WGMMA_BLOCK_N, BLOCK_B=block_b, PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    gdt = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16
    rows = kv_cache.shape[0] * kv_cache.shape[1]
    shape, strides = [rows, kv_cache.shape[-1]], [kv_cache.stride(1), 1]
    lay_c = gl.NVMMASharedLayout.get_default_for([WGMMA_BLOCK_N, _D_CKV // 2], gdt)
    lay_pe = gl.NVMMASharedLayout.get_default_for([WGMMA_BLOCK_N, _D_PE], gdt)
    desc_c = TensorDescriptor(kv_cache, shape, strides, [WGMMA_BLOCK_N, _D_CKV // 2], lay_c)
    desc_pe = TensorDescriptor(kv_cache, shape, strides, [WGMMA_BLOCK_N, _D_PE], lay_pe)
    _mla_decode_wgmma_kernel[(triton.cdiv(H, WGMMA_BLOCK_H), programs)](
        q_nope, q_pe, desc_c, desc_pe, page_table, seq_lens, work, partial_out, partial_lse, out, qk_scale, out_scale,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), page_table.stride(0),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), partial_lse.stride(2), out.stride(0), out.stride(1), max_splits,
        PAGE_SIZE=kv_cache.shape[1], D_CKV=_D_CKV, D_PE=_D_PE, BLOCK_H=WGMMA_BLOCK_H, BLOCK_N=WGMMA_BLOCK_N,
        num_warps=WGMMA_WARPS,
    )  # fmt: skip
