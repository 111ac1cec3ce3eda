"""Triton kernel for indexed row copies where one side may be pinned host memory (read or written over PCIe
through unified addressing).

Only ``@triton.jit`` code lives here; the launchers are in :mod:`backends.kernels.sparse.host_gather`.

Rows are viewed as 32-bit (or narrower) words and cut into *segments* of ``SEG`` words (a 1152-byte KV row is
9 segments of 128 bytes), so a tile ``[BLOCK_SEG, SEG]`` has no masked lanes and each thread moves 16-byte
vectors. Program ``p`` copies segments ``[p * BLOCK_SEG * ITERS, (p + 1) * BLOCK_SEG * ITERS)`` of the flat
segment space (entry ``i = segment // SEGS_PER_ROW``); many segments per program keep many PCIe reads in flight.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["m"])
def _copy_rows_kernel(
    SRC,
    SRC_IDX,
    DST,
    DST_IDX,
    COUNT,  # 1-element int tensor (only read when HAS_COUNT)
    m,  # entries
    stride_src,  # words
    stride_dst,
    SEG: tl.constexpr,  # words per segment (a power of two)
    SEGS_PER_ROW: tl.constexpr,
    BLOCK_SEG: tl.constexpr,
    ITERS: tl.constexpr,
    HAS_COUNT: tl.constexpr,
):
    """dst[dst_idx[i]] = src[src_idx[i]] for i < m (and i < COUNT[0]) with src_idx[i] >= 0."""
    pid = tl.program_id(0).to(tl.int64)
    limit = m
    if HAS_COUNT:
        limit = tl.minimum(limit, tl.load(COUNT).to(tl.int64))
    cols = tl.arange(0, SEG)
    for it in tl.static_range(ITERS):
        seg = (pid * ITERS + it) * BLOCK_SEG + tl.arange(0, BLOCK_SEG)
        entry = seg // SEGS_PER_ROW
        part = seg % SEGS_PER_ROW
        live = entry < limit
        src = tl.load(SRC_IDX + entry, mask=live, other=-1).to(tl.int64)
        ok = live & (src >= 0)
        dst = tl.load(DST_IDX + entry, mask=ok, other=0).to(tl.int64)
        word_src = src * stride_src + part * SEG
        word_dst = dst * stride_dst + part * SEG
        vals = tl.load(SRC + word_src[:, None] + cols[None, :], mask=ok[:, None])
        tl.store(DST + word_dst[:, None] + cols[None, :], vals, mask=ok[:, None])
