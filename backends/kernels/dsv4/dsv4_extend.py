"""DeepSeek-V4 extend attention over gathered rows: the Triton launcher (:func:`dsv4_extend`).

T query tokens (any mix of requests), H heads, D = the shared KV row width. Each token attends independently over
three parts, softmaxed jointly with the per-head sink; a part is a :class:`GatherPart`:

* ``rows`` [S, D] in q's dtype, contiguous (a ring flattened, the chunk's new rows, a compressed pool flattened);
* ``idx`` [R, N] int32, last dim contiguous: index rows into ``rows``, ``-1`` = none;
* ``sel`` [T] int32: which row of ``idx`` query ``t`` reads (its own: ``arange(T)``; shared: a request's table row);
* ``length`` [T] int32: how many leading entries of that row it reads (``<= N``; 0 = the part is empty for it).

The backend's plan (:mod:`backends.dsv4_extend_plan`) gives: the ring part (window positions before the chunk),
the new-rows part (window positions inside the chunk, rows of ``kv``), and the compressed part (HCA: the entry
table's row of the request and ``(t + 1) // rate`` entries; CSA: the top-k slots, one row per query; sliding: length
0). Returns [T, H, D] in q's dtype. The oracle is the backend's torch path (and, per query, the reference's
:func:`backends.kernels.dsv4.dsv4_reference.sink_attention`). Triton is imported lazily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.kernels.checks import require
from backends.kernels.dsv4.dsv4_decode import tile_options


@dataclass(frozen=True)
class GatherPart:
    """Rows one query token reads: ``rows[idx[sel[t], :length[t]]]`` (``-1`` entries skipped); see the module
    docstring for shapes and dtypes."""

    rows: torch.Tensor
    idx: torch.Tensor
    sel: torch.Tensor
    length: torch.Tensor


def _check(q: torch.Tensor, parts: tuple[GatherPart, ...], sinks: torch.Tensor) -> None:
    require(q.dim() == 3 and q.stride(-1) == 1, f"q [T, H, D] with a contiguous last dim; got {tuple(q.shape)}")
    t, h, d = q.shape
    require(q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"q bf16, fp16 or fp32; got {q.dtype}")
    require(len(parts) == 3, f"three parts (ring, new rows, compressed); got {len(parts)}")
    for i, p in enumerate(parts):
        require(p.rows.dim() == 2 and p.rows.shape[1] == d and p.rows.is_contiguous() and p.rows.dtype == q.dtype,
                f"part {i} rows contiguous [S, {d}] in {q.dtype}; got {p.rows.dtype} {tuple(p.rows.shape)}")
        require(p.idx.dim() == 2 and p.idx.dtype == torch.int32 and p.idx.stride(-1) == 1 and p.idx.shape[0] >= 1,
                f"part {i} idx int32 [R >= 1, N] with a contiguous last dim; got {p.idx.dtype} {tuple(p.idx.shape)}")
        for name, x in (("sel", p.sel), ("length", p.length)):
            require(x.shape == (t,) and x.dtype == torch.int32 and x.is_contiguous(),
                    f"part {i} {name} int32 [T={t}]; got {x.dtype} {tuple(x.shape)}")
    require(sinks.shape == (h,) and sinks.is_floating_point() and sinks.is_contiguous(),
            f"sinks contiguous float [H={h}]; got {sinks.dtype} {tuple(sinks.shape)}")


def dsv4_extend(q: torch.Tensor, parts: tuple[GatherPart, GatherPart, GatherPart], sinks: torch.Tensor,
                sm_scale: float, out: torch.Tensor | None = None, block_h: int = 16, block_n: int = 32,
                num_warps: int = 8, num_stages: int = 2) -> torch.Tensor:
    """The Triton kernel (:mod:`backends.kernels.dsv4.dsv4_extend_kernels`); see the module docstring. Tiles:
    ``block_h`` heads x ``block_n`` rows (both >= 16, tl.dot); D a power of two. No host sync; allocates only
    ``out`` when not given. Lengths are trusted (``length[t] <= idx.shape[1]``, ``sel[t] < idx.shape[0]``)."""
    import triton

    from backends.kernels.dsv4 import dsv4_extend_kernels as kern
    from backends.kernels.dsv4.dsv4_decode_kernels import LOG2E  # the kernels' softmax runs in base 2

    _check(q, parts, sinks)
    t, h, _ = q.shape
    tiles = tile_options(kern._dsv4_extend_kernel, q, block_h, block_n, num_warps, num_stages)
    if out is None:
        out = torch.empty_like(q)
    if t == 0:
        return out
    args = [x for p in parts for x in (p.rows, p.idx, p.sel, p.length)]
    kern._dsv4_extend_kernel[(triton.cdiv(h, block_h), t)](
        q, sinks, out, *args, float(sm_scale) * LOG2E, q.stride(0), q.stride(1),
        *(p.idx.stride(0) for p in parts), out.stride(0), out.stride(1), h, **tiles,
    )  # fmt: skip
    return out
