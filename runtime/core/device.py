"""Which device the config resolves to, probed without allocating anything."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DeviceInfo:
    requested: str  # auto | cpu | cuda
    kind: str  # cpu | cuda: what `requested` resolves to here
    index: int
    cuda_available: bool
    compute_capability: tuple[int, int] | None
    name: str
    sm_count: int = 0  # streaming multiprocessors of the GPU (0 on the CPU)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind, self.index) if self.kind == "cuda" else torch.device("cpu")


def probe_device(requested: str, index: int = 0) -> DeviceInfo:
    """Resolve ``auto`` (cuda if a GPU is visible, else cpu) and read the GPU's compute capability."""
    available = torch.cuda.is_available()
    kind = ("cuda" if available else "cpu") if requested == "auto" else requested
    cc, name, sms = None, "cpu", 0
    if kind == "cuda" and available and index < torch.cuda.device_count():
        cc = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        sms = torch.cuda.get_device_properties(index).multi_processor_count
    return DeviceInfo(requested, kind, index, available, cc, name, sms)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to ``device`` without blocking the host.

    A copy from *pageable* host memory makes CUDA synchronize the stream first (so the host would wait for
    every kernel already queued: the previous step). Staging through pinned memory keeps the step path
    asynchronous; torch's pinned allocator keeps the buffer alive until the copy has run."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def packed_to_device(i64: list, i32: list, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Integer arrays to ``device`` in ONE host-to-device copy and no kernel: ``i64`` (sequences of ints, or
    int arrays) become int64 tensors, ``i32`` int32 tensors, all views of one int64 host buffer (pinned on
    CUDA: the copy needs no staging copy and does not block the host) holding the int32 arrays two to a word.

    Returns (host views, device views), each in the order ``[*i64, *i32]``; on the CPU they are the same
    tensors. The host views are the mirrors a step reads without a device-to-host copy."""
    n64 = [len(a) for a in i64]
    n32 = [len(a) for a in i32]
    w64, w32 = sum(n64), (sum(n32) + 1) // 2
    host = torch.empty(w64 + w32, dtype=torch.int64, pin_memory=device.type == "cuda")
    words = host.numpy()
    at = 0
    for a, n in zip(i64, n64):
        words[at : at + n] = a
        at += n
    halves, at = words[w64:].view(np.int32), 0
    for a, n in zip(i32, n32):
        halves[at : at + n] = a
        at += n
    views = _views(host, n64, n32, w32)
    if device.type != "cuda":
        return views, views
    return views, _views(host.to(device, non_blocking=True), n64, n32, w32)


def _views(buf: torch.Tensor, n64: list[int], n32: list[int], w32: int) -> list[torch.Tensor]:
    *v64, rest = buf.split_with_sizes([*n64, w32])
    return [*v64, *rest.view(torch.int32).split_with_sizes([*n32, 2 * w32 - sum(n32)])[: len(n32)]]
