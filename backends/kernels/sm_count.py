"""What kernel launchers read of the GPU once per device: the SM count (grid sizes) and the compute capability's
major version (TMA loads and programmatic dependent launch need 9+)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _cuda_index(device: torch.device | str) -> int | None:
    """The CUDA device's index (no index: the current one); None off the GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


def sm_count(device: torch.device | str, fallback: int) -> int:
    """SMs of the CUDA ``device`` (read once per device), else ``fallback`` (the CPU and Triton's interpreter: a
    fixed count, so a launcher's choice is reproducible there)."""
    index = _cuda_index(device)
    return fallback if index is None else _cuda_sm_count(index)


@functools.cache
def _cuda_capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def capability_major(device: torch.device | str) -> int:
    """The CUDA ``device``'s compute capability major version (read once per device); 0 off the GPU."""
    index = _cuda_index(device)
    return 0 if index is None else _cuda_capability_major(index)
