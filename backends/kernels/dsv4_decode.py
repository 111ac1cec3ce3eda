"""DeepSeek-V4 decode attention over gathered rows: the Triton launcher (:func:`dsv4_decode`) and the torch
fallback with the same arguments (:func:`dsv4_decode_torch`, on :func:`backends.kernels.dsv4_reference.sink_attention`).

Arguments (B requests, one query token each, H heads, D = the shared KV row width):

* ``q`` [B, H, D] (RoPE applied), last dim contiguous;
* ``win_rows`` [Sw, D] and ``win_idx`` [B, Nw] int32: the window rows each query sees (the ring of one layer
  flattened, ``row * W + p % W``), ``-1`` = none;
* ``cmp_rows`` [Sc, D] and ``cmp_idx`` [B, Nc] int32: the compressed entries (CSA: the indexer's top-k slots; HCA:
  every closed entry's slot), ``-1`` = none; ``Nc`` may be 0 (sliding-only layers);
* ``sinks`` [H] (natural-log logits, not scaled), ``sm_scale``.

Returns [B, H, D] in q's dtype. Triton is imported lazily (the fallback works without it).
"""

from __future__ import annotations

import torch

from backends.kernels.checks import require
from backends.kernels.dsv4_reference import sink_attention


def _check(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks) -> None:
    require(q.dim() == 3, f"q [B, H, D]; got shape {tuple(q.shape)}")
    b, h, d = q.shape
    for name, rows in (("win_rows", win_rows), ("cmp_rows", cmp_rows)):
        require(rows.dim() == 2 and rows.shape[1] == d and rows.is_contiguous(), f"{name} contiguous [S, {d}]")
        require(rows.dtype == q.dtype, f"{name} in q's dtype {q.dtype}; got {rows.dtype}")
    for name, idx in (("win_idx", win_idx), ("cmp_idx", cmp_idx)):
        require(idx.dim() == 2 and idx.shape[0] == b and idx.dtype == torch.int32 and idx.stride(-1) == 1,
                f"{name} int32 [B={b}, N] with a contiguous last dim; got {idx.dtype} {tuple(idx.shape)}")
    require(sinks.shape == (h,), f"sinks [H={h}]; got {tuple(sinks.shape)}")


def dsv4_decode_torch(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks, sm_scale: float,
                      compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The fallback (and the kernel's oracle in float64): gather, then one joint softmax with the sinks."""
    _check(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks)
    parts = []
    for rows, idx in ((win_rows, win_idx), (cmp_rows, cmp_idx)):
        if idx.shape[1]:
            parts.append((rows[idx.long().clamp_min(0)].to(compute_dtype), idx >= 0))
    out = sink_attention(q.to(compute_dtype), parts, sinks.to(compute_dtype), sm_scale)
    return out.to(q.dtype)


def tile_options(kernel, q: torch.Tensor, block_h: int, block_n: int, num_warps: int, num_stages: int) -> dict:
    """The V4 kernels' compile-time tile arguments and launch options for ``q`` [.., H, D], after checking them:
    D a power of two, tiles of at least 16 (tl.dot). The CPU interpreter takes no warps / stages and gets fp32
    operands for non-fp32 dots (it computes those wrong)."""
    import triton

    d = q.shape[-1]
    require(triton.next_power_of_2(d) == d, f"a power-of-two row width; got {d}")
    require(block_h >= 16 and block_n >= 16, f"tiles of at least 16 (tl.dot); got {block_h}, {block_n}")
    interp = kernel.__class__.__name__ == "InterpretedFunction"
    extra = {} if interp else dict(num_warps=num_warps, num_stages=num_stages)
    return dict(D=d, BLOCK_H=block_h, BLOCK_N=block_n, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST=interp and q.dtype != torch.float32, **extra)


def dsv4_decode(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks, sm_scale: float, out: torch.Tensor | None = None,
                block_h: int = 16, block_n: int = 32, num_warps: int = 8, num_stages: int = 2) -> torch.Tensor:
    """The Triton kernel (:mod:`backends.kernels.dsv4_decode_kernels`); see the module docstring. Tiles:
    ``block_h`` heads x ``block_n`` rows (both >= 16, tl.dot); D must be a power of two. No host sync, no
    allocation given ``out``."""
    import triton

    from backends.kernels import dsv4_decode_kernels as kern

    _check(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks)
    b, h, _ = q.shape
    require(q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"q bf16, fp16 or fp32; got {q.dtype}")
    require(q.stride(-1) == 1, "q with a contiguous last dim")
    tiles = tile_options(kern._dsv4_decode_kernel, q, block_h, block_n, num_warps, num_stages)
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    kern._dsv4_decode_kernel[(triton.cdiv(h, block_h), b)](
        q, win_rows, win_idx, cmp_rows, cmp_idx, sinks, out, float(sm_scale) * kern.LOG2E,
        q.stride(0), q.stride(1), win_idx.stride(0), cmp_idx.stride(0), out.stride(0), out.stride(1),
        h, win_idx.shape[1], cmp_idx.shape[1], **tiles,
    )  # fmt: skip
    return out
