"""Which device the config resolves to, probed without allocating anything."""

from __future__ import annotations

from dataclasses import dataclass

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
