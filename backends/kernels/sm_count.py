"""The SM count kernel launchers size their grids by, read once per GPU."""

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
