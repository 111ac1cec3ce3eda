"""What HiSparse needs of its sizes, whatever it offloads (V3.2 latent rows of sparse layers, or DeepSeek-V4's
CSA entries): part of the one validation pass of :mod:`runtime.app.validation`. What each model needs besides
(the layers HiSparse serves, ``top_k`` equal to the indexer's) is checked beside the model's other rules."""

from __future__ import annotations

from typing import Any

from runtime.core.errors import Problem


def hisparse_size_problems(hs: dict[str, Any], rows: str, ratio_fix: float) -> list[Problem]:
    """``hisparse.top_k`` >= 1, a device buffer that holds one selection of ``top_k`` ``rows``, a host pool at
    least as large as the device one (``ratio_fix``: the ratio the fix suggests)."""
    out: list[Problem] = []
    if hs["top_k"] < 1:
        out.append(Problem("hisparse.top_k", str(hs["top_k"]), ">= 1", "set hisparse.top_k=2048"))
    if hs["device_buffer_size"] < hs["top_k"]:
        out.append(Problem("hisparse.device_buffer_size", f"{hs['device_buffer_size']} (< top_k {hs['top_k']})",
                           f"device_buffer_size >= top_k (every selected {rows} must fit on the device)",
                           f"set hisparse.device_buffer_size={max(hs['top_k'], 1) * 2}"))
    if hs["host_to_device_ratio"] < 1:
        out.append(Problem("hisparse.host_to_device_ratio", str(hs["host_to_device_ratio"]),
                           ">= 1 (the host pool holds at least what the device holds)",
                           f"set hisparse.host_to_device_ratio={ratio_fix:g}"))
    return out
