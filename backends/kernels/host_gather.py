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

from backends.kernels.checks import require

__all__ = ["gather_rows_from_host", "scatter_rows_to_host"]


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
    raise NotImplementedError("gather_rows_from_host: the CUDA kernel is not written yet")


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
    raise NotImplementedError("scatter_rows_to_host: the CUDA kernel is not written yet")
