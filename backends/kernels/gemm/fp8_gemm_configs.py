"""Tile configurations of the block-fp8 linear-layer kernels (:mod:`backends.kernels.gemm.fp8_gemm`): the launch
dataclasses and the rules that pick them by shape and device (measured figures in each rule's docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from backends.kernels.gemm.skinny import CPU_SM_COUNT, TileConfig
from backends.kernels.sm_count import capability_major, sm_count

#: rows up to which :func:`~backends.kernels.gemm.fp8_gemm.fp8_linear` takes the few-row W8A16 kernel (one 16-row
#: tensor-core tile)
FEW_ROWS = 16


@dataclass(frozen=True)
class GemmConfig:
    """A launch of the tiled GEMM: output tile ``block_m x block_n``, reduction step ``block_k`` (a power of two
    dividing the scale block's ``bk``), row tiles per L2 group, warps, pipeline stages; ``tma``: the tiles loaded by
    the tensor memory accelerator (``_block_gemm_tma_kernel``, compiled for a Hopper+ GPU only; 16-byte aligned
    rows), ``ws``: with it, Triton's warp-specialized loop."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = False
    ws: bool = False


@dataclass(frozen=True)
class FewConfig(TileConfig):
    """A launch of the few-row kernel: the tiles of :class:`~backends.kernels.gemm.skinny.TileConfig` and
    ``split_k``, the programs that share each block of output columns, each over a run of whole ``block_k`` steps
    (> 1: float32 partials summed in order, by each column block's last program given ``counters``, else by a
    second kernel), and ``fma``: the CUDA-core kernel (float32 products, M <= :data:`FMA_ROWS`) instead of the
    tensor-core one. :func:`few_config` splits above :data:`FMA_ROWS` rows."""

    split_k: int = 1
    fma: bool = False


@dataclass(frozen=True)
class SplitConfig:
    """A launch of the ``"split"`` W8A8 kernel (``_split_w8a8_kernel``): ``block_n`` weight rows per program (the
    tensor cores' wide side, 64 or 128), ``split_k`` programs sharing each block of columns (> 1: float32
    partials summed in order by a second kernel), ``quant``: each program quantizes its activation tiles (else one
    :func:`~backends.kernels.gemm.fp8_gemm.quantize_act` launch first; the same scales, a quotient's last bit may
    differ), ``tma``: weight tiles by TMA (Hopper+, 16-byte rows)."""

    block_n: int = 128
    split_k: int = 1
    quant: bool = True
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False


#: rows up to which a :class:`FewConfig` with ``fma`` may run (the CUDA-core kernel, ``_few_fma_kernel``)
FMA_ROWS = 2


def few_config(n: int, k_dim: int, device: torch.device | str, m: int = FEW_ROWS) -> FewConfig:
    """Tiles of the few-row kernel for ``m`` rows.

    Up to :data:`FMA_ROWS` rows: the CUDA-core kernel, 8 weight rows x 512 inputs per step where that gives every
    SM 4 programs, else 4 x 1024, no split-K. At one row on an H200 (``python -m bench.fp8_gemm_bench --path few
    --m 1 --sweep``, µs, partials summed in the last programs) this is the best of 30 tiles x splits or within 5% at
    every TP8 shape but the shared expert's gate_up (8.3 against 5.8 split 4; the experts' own kernels take the
    shared expert at decode): qkv_a 9.4, q_b 5.3, o_proj 7.9, down 8.8, gate_up 16.3 (15.6 split 2).
    Above (3-16 rows): the tensor-core kernel, 64 weight rows x 256 inputs per step, 4 warps, 4 stages, and the
    inputs split in runs of about 4 steps (``round(steps / 4)`` splits, at most 4 programs an SM), the same split for
    every row count from 3 to 16 (so a row's bits depend only on N and K). Swept at 16 rows on an H200 (``--path few
    --m 16 --sweep``, 64 x 256 at 1-8 splits and 32 x 512 at 1-4, µs): qkv_a 49.4 / 31.0 unsplit -> 15.8 (7
    splits, the best), q_b 9.8 (best 9.6), o_proj 15.2 (2, best), gate_up 27.5 (7, best; 48.8 unsplit), down 16.0 (2,
    best), the shared expert's gate_up 11.3 (best; 31.1 unsplit) and down 4.7 (1, best)."""
    sms = sm_count(device, CPU_SM_COUNT)
    k_cap = triton.next_power_of_2(max(k_dim, 16))
    if m <= FMA_ROWS:
        block_n, block_k = (8, 512) if triton.cdiv(n, 8) >= 4 * sms else (4, 1024)
        return FewConfig(block_n, min(block_k, k_cap), 4, 3, 1, True)
    block_k = min(256, k_cap)
    steps = triton.cdiv(max(k_dim, 1), block_k)
    split = max(1, min(round(steps / 4), triton.cdiv(4 * sms, triton.cdiv(n, 64))))
    return FewConfig(64, block_k, 4, 4, _splits(k_dim, block_k, split))


def _splits(k_dim: int, block_k: int, split: int) -> int:
    """The split count that whole-step runs of ``ceil(steps / split)`` steps give (no empty split)."""
    steps = triton.cdiv(max(k_dim, 1), block_k)
    return triton.cdiv(steps, triton.cdiv(steps, max(1, split)))


def gemm_config(m: int, n: int, k_dim: int, bk: int, a_fp8: bool, device: torch.device | str) -> GemmConfig:
    """Tiles of the tiled GEMM, by rule: ``block_k = min(bk, 128)`` for fp8 activations (one scale block per step,
    as DeepSeek's ``fp8_gemm``), ``min(bk, 64)`` for bf16 / fp16 ones; for W8A16 ``block_m`` the smallest of
    16 / 32 / 64 / 128 holding M; ``block_n`` 128 when that still gives every SM a tile, else 64.

    W8A8: 64 x 128 tiles, 4 warps, 3 stages, TMA loads on a Hopper+ GPU (rows 16-byte aligned). Swept on an H200
    at M = 4096 over DeepSeek-V3's TP8 shapes (``python -m bench.fp8_gemm_bench --path w8a8 --m 4096 --sweep``,
    36 configs): 1.26-1.46x faster than the 128 x 128, 8-warp tiles it replaced (qkv_a 201.8 against 294.7 µs,
    o_proj 171.9 / 244.9, gate_up 395.0 / 506.3, down 193.4 / 281.6); two 64-row tiles share an SM, so one's
    scaling runs while the other's products do (each k-step's product is scaled before it joins the
    accumulator, so a tile waits for its own). TMA took 10-13% off the same tiles; Triton's warp-specialized
    loop changed nothing at 128 x 128. Below M = 4096 not swept. W8A16: 8 warps at 128 rows, else 4; 4 stages."""
    sms = sm_count(device, CPU_SM_COUNT)
    if a_fp8:
        block_k = min(bk, 128)
        block_n = 128 if triton.cdiv(m, 64) * triton.cdiv(n, 128) >= sms else 64
        return GemmConfig(64, block_n, block_k, 8, 4, 3, tma=tma_serves(device, k_dim))
    block_k = min(bk, 64)
    block_m = next(b for b in (16, 32, 64, 128) if m <= b or b == 128)
    block_n = 128 if triton.cdiv(m, block_m) * triton.cdiv(n, 128) >= sms else 64
    return GemmConfig(block_m, block_n, block_k, 8, 8 if block_m == 128 else 4, 4)


def split_config(m: int, n: int, k_dim: int, bk: int, device: torch.device | str) -> SplitConfig:
    """Tiles of the ``"split"`` kernel, by rule: 128 weight rows a program, and the inputs split so that the
    programs number about twice the SMs (each program at least two 128-input steps); 3 stages, TMA where it
    serves. Swept at 32 rows over a TP8 rank's shapes on an H200 (``python -m bench.fp8_gemm_bench --path split
    --m 32 --sweep``): the rule's split was within 10% of the best of 15 (64 / 128 rows x 1-16 splits) at every
    shape, 3 stages at or ahead of 4 (6: up to 1.5x slower)."""
    sms = sm_count(device, CPU_SM_COUNT)
    block_k = min(bk, 128)
    steps = triton.cdiv(max(k_dim, 1), block_k)
    tiles = triton.cdiv(n, 128)
    split = max(1, min(steps // 2, round(2 * sms / tiles)))
    return SplitConfig(128, _splits(k_dim, block_k, split), block_k == bk, 4, 3, tma_serves(device, k_dim))


def tma_serves(device: torch.device | str, row_bytes: int) -> bool:
    """TMA loads serve the fp8 tiles: a CUDA GPU of capability 9.0+ (off the GPU, Triton's interpreter included:
    no) and rows of a multiple of 16 bytes."""
    return capability_major(device) >= 9 and row_bytes % 16 == 0
