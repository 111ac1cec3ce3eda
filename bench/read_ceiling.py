"""A ceiling for memory-bound kernels of a few megabytes: the time to only *read* the same bytes.

The copy ceiling (``bench.harness.copy_bandwidth_gbs``) is measured on a large copy, where the ramp-up of a grid
and its tail are negligible. A decode step's weight products read 2 to 40 MB each, where they are not: on an H200 a
plain streaming read of one TP8 rank's qkv_a weight (15.1 MB) took 6.76 us, 53% of copy bandwidth, and of q_b's
4.7 MB 3.98 us, 28%. :func:`read_us` times a Triton kernel that reads the given tensors' bytes with 16-byte loads
and keeps a sum (so nothing is skipped), over a few tilings, CUDA-graphed over the tensors in turn (pass copies
that together exceed L2), and returns the best: what any kernel reading those bytes could reach, from that side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.harness import graph_ms

#: (int32 words per load step, steps per program, warps) tried by :func:`read_us`
TILINGS = ((1024, 1, 4), (1024, 2, 4), (2048, 1, 8), (2048, 2, 8), (4096, 1, 8), (512, 4, 4), (1024, 4, 8))


@triton.jit
def _read_kernel(W, OUT, NW, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(W + offs, mask=offs < NW, other=0)
    tl.store(OUT + tl.program_id(0), tl.sum(acc))


def read_us(tensors: list[torch.Tensor]) -> tuple[float, tuple[int, int, int]]:
    """Best microseconds to read one of ``tensors`` (equal sizes, contiguous, CUDA, byte count a multiple of 4),
    and the tiling that gave it."""
    words = [t.reshape(-1).view(torch.uint8).view(torch.int32) for t in tensors]
    nw = words[0].numel()
    best = (float("inf"), TILINGS[0])
    for block, iters, warps in TILINGS:
        grid = (triton.cdiv(nw, block * iters),)
        out = torch.empty(grid[0], dtype=torch.int32, device=words[0].device)
        calls = [lambda v=v, g=grid, o=out, b=block, i=iters, w=warps:
                 _read_kernel[g](v, o, nw, BLOCK=b, ITERS=i, num_warps=w) for v in words]
        best = min(best, (graph_ms(calls, rep_ms=40) * 1e3, (block, iters, warps)), key=lambda p: p[0])
    return best
