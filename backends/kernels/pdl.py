"""Programmatic dependent launch (PDL, Hopper+): a kernel launched with it is started while the kernel before it
in the stream is still running, and waits on the GPU (not in the launch queue) for that kernel's writes.

In a CUDA-graphed decode step at batch 1, most kernels run for a few microseconds, and between two of them the GPU
spends about as long again starting the next grid. With PDL the next grid's programs are already resident when
the previous grid ends. The kernels that take a ``PDL`` constexpr call :func:`pdl_enter` first: it waits for the
previous grid's memory to be visible (``griddepcontrol.wait``), then lets the next grid launch
(``griddepcontrol.launch_dependents``). Since every such kernel waits before it reads or writes anything, the
order of the stream is kept: a kernel's predecessor finished, and with it everything before the predecessor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends.kernels.checks import interpreted
from backends.kernels.sm_count import capability_major


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """With PDL: wait until the previous grid's writes are visible, then allow the next grid to launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def use_pdl(wanted: bool, kernel, device: torch.device | str) -> bool:
    """Whether to launch ``kernel`` with PDL: asked for, compiled for a GPU (not Triton's interpreter), and on a
    GPU of compute capability 9.0 or newer. The launch passes the result both as the kernel's ``PDL`` constexpr and
    as Triton's ``launch_pdl`` option."""
    return bool(wanted) and not interpreted(kernel) and capability_major(device) >= 9
