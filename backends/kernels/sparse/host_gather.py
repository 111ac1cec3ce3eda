"""Row copies between a pinned host KV pool and device rows, driven by index lists that live on the device.

HiSparse keeps every token's latent KV row in pinned host memory and a small device buffer of recently
selected rows. A decode step's misses are a list of (host row, device row) pairs built on the device (padded
with ``src_idx = -1``, so no host sync is needed to know how many there are). Copying them with a CPU-side
gather and one ``copy_`` reaches only a few GB/s for scattered 1152-byte rows, so on CUDA the copy is a Triton
kernel that reads the pinned host memory directly (unified addressing: a pinned host pointer is valid on the
device) with many rows in flight per program.

* :func:`gather_rows_from_host`: ``dst_rows[dst_idx[i]] = host_rows[src_idx[i]]`` for ``src_idx[i] >= 0``.
* :func:`scatter_rows_to_host`: ``host_rows[dst_idx[i]] = src_rows[src_idx[i]]`` for ``src_idx[i] >= 0``
  (device -> host offload).

When the destination (gather) or the source (scatter) is a CPU tensor, both run as torch index copies on the
CPU; that path is the reference the kernels are tested against. Triton is imported lazily.
"""

from __future__ import annotations

import torch

from backends.kernels.checks import interpreted, require

__all__ = ["copy_rows", "gather_rows_from_host", "scatter_rows_to_host"]

#: Segments per tile and tiles per program of the copy kernel (see bench/bench_dsa.py to retune).
BLOCK_SEG = 64
ITERS = 4
NUM_WARPS = 4


def _check_rows(a: torch.Tensor, b: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    require(a.dim() == 2 and b.dim() == 2, f"row tensors [N, W]; got {tuple(a.shape)} and {tuple(b.shape)}")
    require(
        a.shape[1] == b.shape[1] and a.dtype == b.dtype,
        f"same row width and dtype; got [*, {a.shape[1]}] {a.dtype} and [*, {b.shape[1]}] {b.dtype}",
    )
    require(
        src_idx.dim() == 1 and dst_idx.shape == src_idx.shape,
        f"src_idx and dst_idx [M]; got {tuple(src_idx.shape)} and {tuple(dst_idx.shape)}",
    )
    require(
        src_idx.dtype in (torch.int32, torch.int64) and dst_idx.dtype in (torch.int32, torch.int64),
        f"int32/int64 indices; got {src_idx.dtype} and {dst_idx.dtype}",
    )
    require(a.stride(1) == 1 and b.stride(1) == 1, "row tensors with contiguous rows (stride(1) == 1)")


def _first(count, m: int, device: torch.device) -> torch.Tensor:
    """Mask [M] of the entries before ``count`` (None: all; an int; or a 1-element integer tensor)."""
    if count is None:
        return torch.ones(m, dtype=torch.bool, device=device)
    if isinstance(count, torch.Tensor):
        count = count.to(device).reshape(())
    return torch.arange(m, device=device) < count


def _copy_rows_torch(src_rows, src_idx, dst_rows, dst_idx, count) -> None:
    """dst_rows[dst_idx[i]] = src_rows[src_idx[i]] for the valid entries, with torch ops on the CPU."""
    dev = src_rows.device
    src_idx, dst_idx = src_idx.to(dev), dst_idx.to(dev)
    keep = (src_idx >= 0) & _first(count, src_idx.shape[0], dev)
    s, d = src_idx[keep].long(), dst_idx[keep].long()
    dst_rows.index_copy_(0, d.to(dst_rows.device), src_rows[s].to(dst_rows.device))


def _require_pinned(t: torch.Tensor, name: str) -> None:
    if t.device.type != "cpu" or not t.is_pinned():
        raise ValueError(
            f"{name}: expected a pinned CPU tensor (the kernel reads it over PCIe through unified addressing); "
            f"got device={t.device}, pinned={t.device.type == 'cpu' and t.is_pinned()}. "
            "Fix: allocate it with torch.empty(..., pin_memory=True)"
        )


def _require_on(device: torch.device, **tensors) -> None:
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(
                f"{name}: expected a tensor on {device} (the index lists are read by the kernel); got {t.device}. "
                f"Fix: build it on the device (no host sync is needed: pad with src_idx = -1)"
            )


def _words(rows: torch.Tensor) -> torch.Tensor:
    """The rows viewed as the widest of int32 / int16 / uint8 words that divides the row, stride and base."""
    nbytes = rows.element_size()
    for word in (torch.int32, torch.int16, torch.uint8):
        size = torch.tensor([], dtype=word).element_size()
        ok = (rows.shape[1] * nbytes) % size == 0 and (rows.stride(0) * nbytes) % size == 0
        if ok and rows.data_ptr() % size == 0 and size >= nbytes:
            return rows.view(torch.uint8).view(word) if nbytes == 1 else rows.view(word)
    return rows


def copy_rows(
    src_rows: torch.Tensor,
    src_idx: torch.Tensor,
    dst_rows: torch.Tensor,
    dst_idx: torch.Tensor,
    count: int | torch.Tensor | None = None,
    *,
    block_seg: int = BLOCK_SEG,
    iters: int = ITERS,
    num_warps: int = NUM_WARPS,
) -> None:
    """The Triton row copy behind both directions: ``dst_rows[dst_idx[i]] = src_rows[src_idx[i]]`` for the
    entries before ``count`` with ``src_idx[i] >= 0``. Either row tensor may be pinned host memory; the index
    lists and ``count`` are on the GPU (under TRITON_INTERPRET=1 everything is on the CPU). No checks beyond
    shapes: call :func:`gather_rows_from_host` or :func:`scatter_rows_to_host`."""
    import triton

    from backends.kernels.sparse import host_gather_kernels as kern

    _check_rows(src_rows, dst_rows, src_idx, dst_idx)
    m = src_idx.shape[0]
    if m == 0 or (isinstance(count, int) and count <= 0):
        return
    if isinstance(count, int):
        m, count = min(m, count), None
    src_w, dst_w = _words(src_rows), _words(dst_rows)
    require(src_w.dtype == dst_w.dtype, "src and dst rows with the same word view (alignment)")
    words = src_w.shape[1]
    seg = 1
    while seg < 32 and words % (2 * seg) == 0:
        seg *= 2
    segs_per_row = words // seg
    block_seg = max(1, int(block_seg))
    per_prog = block_seg * int(iters)
    grid = (triton.cdiv(m * segs_per_row, per_prog),)
    interp = interpreted(kern._copy_rows_kernel)
    extra = {} if interp else dict(num_warps=num_warps)
    kern._copy_rows_kernel[grid](
        src_w, src_idx, dst_w, dst_idx, count if count is not None else src_idx, m,
        src_w.stride(0), dst_w.stride(0),
        SEG=seg, SEGS_PER_ROW=segs_per_row, BLOCK_SEG=block_seg, ITERS=int(iters), HAS_COUNT=count is not None,
        **extra,
    )  # fmt: skip


def gather_rows_from_host(
    host_rows: torch.Tensor,
    src_idx: torch.Tensor,
    dst_rows: torch.Tensor,
    dst_idx: torch.Tensor,
    count: int | torch.Tensor | None = None,
) -> None:
    """Copy host rows to device rows: ``dst_rows[dst_idx[i]] = host_rows[src_idx[i]]``.

    Parameters
    ----------
    host_rows : [N, W] CPU tensor (pinned when ``dst_rows`` is on CUDA), e.g. bf16 W = 576 (1152-byte rows)
    src_idx : [M] int64 (or int32), on ``dst_rows``'s device
        Host row per entry; entries with ``src_idx < 0`` are skipped (padding).
    dst_rows : [D, W] same dtype as ``host_rows``; written in place
    dst_idx : [M] int64 (or int32), on ``dst_rows``'s device
        Destination row per entry (ignored where ``src_idx < 0``). Distinct among valid entries.
    count : int or 1-element integer device tensor, optional
        Only the first ``count`` entries are copied (None: all ``M``).

    CUDA path: one kernel launch, no allocation, no host sync (graph-safe).
    """
    _check_rows(host_rows, dst_rows, src_idx, dst_idx)
    if dst_rows.device.type != "cuda":
        _copy_rows_torch(host_rows, src_idx, dst_rows, dst_idx, count)
        return
    _require_pinned(host_rows, "host_rows")
    _require_on(dst_rows.device, src_idx=src_idx, dst_idx=dst_idx, count=count)
    copy_rows(host_rows, src_idx, dst_rows, dst_idx, count)


def scatter_rows_to_host(
    src_rows: torch.Tensor,
    src_idx: torch.Tensor,
    host_rows: torch.Tensor,
    dst_idx: torch.Tensor,
    count: int | torch.Tensor | None = None,
) -> None:
    """Copy device rows to host rows: ``host_rows[dst_idx[i]] = src_rows[src_idx[i]]`` (``src_idx[i] >= 0``).

    Parameters
    ----------
    src_rows : [D, W] device rows (e.g. one layer's latent KV by slot)
    src_idx : [M] int64 (or int32), on ``src_rows``'s device; entries < 0 skipped
    host_rows : [N, W] CPU tensor (pinned when ``src_rows`` is on CUDA), same dtype; written in place
    dst_idx : [M] int64 (or int32), on ``src_rows``'s device; distinct among valid entries
    count : int or 1-element integer device tensor, optional; only the first ``count`` entries

    CUDA path: one kernel launch writing the pinned memory directly, asynchronous on the current stream
    (synchronize, or wait on an event, before reading ``host_rows`` on the CPU).
    """
    _check_rows(src_rows, host_rows, src_idx, dst_idx)
    if src_rows.device.type != "cuda":
        _copy_rows_torch(src_rows, src_idx, host_rows, dst_idx, count)
        return
    _require_pinned(host_rows, "host_rows")
    _require_on(src_rows.device, src_idx=src_idx, dst_idx=dst_idx, count=count)
    copy_rows(src_rows, src_idx, host_rows, dst_idx, count)
