"""Launchers of the fused mHC kernels (:mod:`backends.kernels.dsv4.hc_mix_kernels`): everything V4's ``hc_pre`` does
after its mixing linear (sigmoids, softmax, the Sinkhorn rounds, the collapse of the streams) in one launch, and
``hc_post`` (the expansion back to n streams) in one launch. Torch reference: :mod:`runtime.model.mhc`.

CUDA-graph safe: outputs come from ``torch.empty``, grids from shapes, no host sync. Each kernel runs with FMA
contraction off (``enable_fp_fusion=False``) so its float32 roundings are torch's.
"""

from __future__ import annotations

import torch
import triton

from backends.kernels.checks import interpreted, require
from backends.kernels.dsv4 import hc_mix_kernels as k
from backends.kernels.pdl import use_pdl

#: the stream counts (``hc_mult``) the kernels take: powers of two, a constexpr each
HC_MULTS = (1, 2, 4, 8, 16)
#: the streams' dtypes the kernels take
STREAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_WARPS = 4


def _check_streams(streams: torch.Tensor, what: str) -> int:
    """n of streams [T, n, hidden]; refuses a layout, dtype or n the kernels do not take."""
    require(streams.dim() == 3 and streams.stride(-1) == 1 and streams.dtype in STREAM_DTYPES,
            f"{what}: streams [T, n, hidden] with a contiguous last dim, dtype in "
            f"{[str(d).removeprefix('torch.') for d in STREAM_DTYPES]}; got {tuple(streams.shape)} "
            f"strides {streams.stride()} {streams.dtype}")
    n = streams.shape[1]
    if n not in HC_MULTS:
        raise ValueError(f"{what}: hc_mult (streams.shape[1]) got {n}; expected a power of two in {list(HC_MULTS)} "
                         "(a constexpr of the kernel). Fix: use the torch path (runtime.model.mhc, TorchOps) for "
                         "this hc_mult")
    return n


def _block(hidden: int, kernel, cap: int) -> int:
    """Hidden columns per step: 128 in the interpreter (small numpy arrays), else up to ``cap``."""
    return 128 if interpreted(kernel) else min(cap, triton.next_power_of_2(max(hidden, 1)))


def hc_mix(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor, iters: int,
           hc_eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`runtime.model.mhc.hc_mix` in one launch, one program per token.

    Parameters
    ----------
    mixed : [T, 2n + n * n] float32 (contiguous last dim): the mixing linear's output.
    base : [2n + n * n], scale : [3], contiguous, any float dtype (read as float32).
    streams : [T, n, hidden] bf16 / fp16 / float32, contiguous last dim; n in :data:`HC_MULTS`.
    iters, hc_eps : Sinkhorn rounds and epsilon, as :func:`runtime.model.mhc.sinkhorn`.

    Returns
    -------
    post [T, n] float32, comb [T, n, n] float32, collapsed [T, hidden] in the streams' dtype; all contiguous.
    """
    n = _check_streams(streams, "hc_mix")
    t, _, hidden = streams.shape
    width = 2 * n + n * n
    require(mixed.dim() == 2 and mixed.shape == (t, width) and mixed.dtype == torch.float32
            and mixed.stride(-1) == 1,
            f"hc_mix: mixed [T, 2n + n * n] = [{t}, {width}] float32 with a contiguous last dim; got "
            f"{tuple(mixed.shape)} {mixed.dtype} strides {mixed.stride()}")
    require(base.shape == (width,) and scale.shape == (3,) and base.is_contiguous() and scale.is_contiguous()
            and base.is_floating_point() and scale.is_floating_point(),
            f"hc_mix: base [{width}] and scale [3], contiguous floats; got base {tuple(base.shape)} {base.dtype}, "
            f"scale {tuple(scale.shape)} {scale.dtype}")
    require(mixed.device == base.device == scale.device == streams.device,
            f"hc_mix: every tensor on one device; got mixed {mixed.device}, base {base.device}, scale "
            f"{scale.device}, streams {streams.device}")
    dev = streams.device
    post = torch.empty(t, n, dtype=torch.float32, device=dev)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=dev)
    out = torch.empty(t, hidden, dtype=streams.dtype, device=dev)
    if t:
        p = use_pdl(pdl, k._hc_mix_kernel, dev)
        k._hc_mix_kernel[(t,)](mixed, base, scale, streams, post, comb, out, hidden, int(iters), float(hc_eps),
                               mixed.stride(0), streams.stride(0), streams.stride(1), out.stride(0), N=n,
                               BLOCK_H=_block(hidden, k._hc_mix_kernel, 1024), PDL=p, launch_pdl=p,
                               enable_fp_fusion=False, num_warps=_WARPS)
    return post, comb, out


def hc_post(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor,
            pdl: bool = False) -> torch.Tensor:
    """:func:`runtime.model.mhc.hc_post` in one launch: programs (token, block of hidden columns).

    Parameters
    ----------
    post : [T, n], comb : [T, n, n], contiguous, any float dtype (rounded to the streams' dtype first, as torch).
    block_out : [T, hidden] in the streams' dtype, contiguous last dim.
    streams : [T, n, hidden] bf16 / fp16 / float32, contiguous last dim; n in :data:`HC_MULTS`.

    Returns
    -------
    [T, n, hidden] contiguous in the streams' dtype: ``post_i * block_out + sum_j comb[j, i] * streams_j``.
    """
    n = _check_streams(streams, "hc_post")
    t, _, hidden = streams.shape
    require(post.shape == (t, n) and comb.shape == (t, n, n) and post.is_contiguous() and comb.is_contiguous()
            and post.is_floating_point() and comb.is_floating_point(),
            f"hc_post: post [T, n] = [{t}, {n}] and comb [T, n, n], contiguous floats; got post "
            f"{tuple(post.shape)} {post.dtype}, comb {tuple(comb.shape)} {comb.dtype}")
    require(block_out.shape == (t, hidden) and block_out.dtype == streams.dtype and block_out.stride(-1) == 1,
            f"hc_post: block_out [T, hidden] = [{t}, {hidden}] in the streams' dtype {streams.dtype} with a "
            f"contiguous last dim; got {tuple(block_out.shape)} {block_out.dtype} strides {block_out.stride()}")
    require(post.device == comb.device == block_out.device == streams.device,
            f"hc_post: every tensor on one device; got post {post.device}, comb {comb.device}, block_out "
            f"{block_out.device}, streams {streams.device}")
    out = torch.empty(t, n, hidden, dtype=streams.dtype, device=streams.device)
    if t and hidden:
        block = _block(hidden, k._hc_post_kernel, min(256, max(16, 2048 // n)))
        p = use_pdl(pdl, k._hc_post_kernel, streams.device)
        k._hc_post_kernel[(t, triton.cdiv(hidden, block))](
            post, comb, block_out, streams, out, hidden, block_out.stride(0), streams.stride(0), streams.stride(1),
            out.stride(0), out.stride(1), N=n, BLOCK_H=block, PDL=p, launch_pdl=p, enable_fp_fusion=False,
            num_warps=_WARPS)
    return out
