"""What kernel launchers read of the GPU once per device: the SM count (grid sizes) and the compute capability's
major version (TMA loads need 9+)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str, fallback: int) -> int:
    """SMs of the CUDA ``device`` (read once per device; no index: the current one), else ``fallback`` (the CPU
    and Triton's interpreter: a fixed count, so a launcher's choice is reproducible there)."""
    device = torch.device(device)
    if device.type != "cuda":
        return fallback
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _cuda_capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def capability_major(device: torch.device | str) -> int:
    """The CUDA ``device``'s compute capability major version (read once per device); 0 off the GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return _cuda_capability_major(torch.cuda.current_device() if device.index is None else device.index)
