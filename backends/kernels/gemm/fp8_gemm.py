"""Launchers of the block-fp8 linear-layer kernels (:mod:`backends.kernels.gemm.fp8_gemm_kernels`): ``y = x @ W.T`` with
DeepSeek-V3's fp8 weights used as stored, never expanded to bf16 in memory.

Weights: ``w [N, K]`` ``torch.float8_e4m3fn`` and ``scale [ceil(N / bn), ceil(K / bk)]`` float32, the dequantized
weight being ``w.float() * scale`` expanded per ``(bn, bk)`` block (edge blocks partial), as
``runtime.model.quantized.dequantize_fp8`` computes it. ``bk`` must be a power of two >= 16 (>= 32 for the W8A8
path: fp8 tensor-core steps are 32 deep); ``bn`` any positive int.

Paths (:func:`fp8_linear` picks by M, ``path=`` forces one):

* ``"few"`` (M <= :data:`FEW_ROWS`): W8A16, each weight byte read once, fp8 weight tiles widened in registers:
  up to :data:`FMA_ROWS` rows on the CUDA cores (float32 products), above as one 16-row tensor-core tile per
  program (:func:`few_config` picks the kernel and tiles). :func:`fp8_norm_linear` fuses an RMSNorm of x.
* ``"w8a8"`` (M > 16 by default): x quantized per row and ``bk`` inputs by :func:`quantize_act` (DeepSeek's
  ``act_quant``: amax / 448), then a block-scaled fp8 GEMM on the fp8 tensor cores (:func:`gemm_config`).
  Needs compute capability 8.9+ on a GPU; with ``path=None`` a GPU without fp8 tensor cores gets ``"w8a16"``.
* ``"split"`` (17 to :data:`SPLIT_ROWS` rows by default): W8A8 for decode batches, the weight tile on the tensor
  cores' 64 / 128-row side and the activations, quantized inside the kernel, on the narrow side; the inputs
  split over programs so that the grid fills the GPU (:func:`split_config`), partials summed in order.
* ``"w8a16"``: the tiled GEMM with bf16 / fp16 activations and weights widened in registers, any M (no
  activation rounding; for comparisons and GPUs without fp8 tensor cores).
* ``"flashinfer"`` / ``"scaled_mm"``: the libraries' W8A8 block-scale GEMMs (FlashInfer's
  ``fp8_blockscale_gemm_sm90``; torch's ``F.scaled_mm`` with 1 x 128 / 128 x 128 block scales, i.e. cuBLAS, after
  :func:`quantize_act`), chosen above :data:`FEW_ROWS` rows by measurement (:func:`choose_path`).

Split-K leaves float32 partials that a second kernel sums in order (``"split"``), or for ``"few"``
(``FewConfig.split_k > 1``), given ``counters`` (int32, zero, one per column tile: the fused ops' workspace
``gemm_counters``), the last program of each column tile does, in the same order (the same bits, no second launch;
each launch leaves the counters at zero again; one with more column tiles than counters takes the second kernel).

All launchers are CUDA-graph safe: outputs and temporaries from ``torch.empty``, grids from shapes, no host
sync, tile choices by rule (no autotuning at run time).
"""

from __future__ import annotations

import functools

import torch
import triton

from backends.kernels.checks import interpreted, require
from backends.kernels.gemm import fp8_gemm_kernels as k
from backends.kernels.gemm.fp8_gemm_configs import (
    FEW_ROWS,
    FMA_ROWS,
    FewConfig,
    GemmConfig,
    SplitConfig,
    _splits,
    few_config,
    gemm_config,
    split_config,
)
from backends.kernels.pdl import use_pdl

FP8_BLOCK = (128, 128)
PATHS = (None, "few", "split", "w8a8", "w8a16", "flashinfer", "scaled_mm")
#: rows up to which ``path=None`` takes the ``"split"`` W8A8 kernel above :data:`FEW_ROWS` (0: never), and the
#: most rows it takes (its activation tile holds every row). 32: a 16-layer fp8 decode step at batch 32 on an
#: H200 (``python -m bench.decode_roofline --preset h100_triton_tp8 --layers 16 --batches 32 --weights fp8``) took
#: 5199 µs a step with it against 5417 with FlashInfer's kernel there (whose launches break the PDL chain); at
#: batch 64 it was slower (6855 against 6613 µs)
SPLIT_ROWS, SPLIT_MAX_ROWS = 32, 128
#: rows from which ``path=None`` takes torch's block-scaled ``F.scaled_mm`` (cuBLAS) over FlashInfer's kernel
#: (None: never). On an H200 cuBLAS is ahead per GEMM from 2048 rows (``python -m bench.fp8_gemm_bench``, CUDA
#: graphs); in a 16-layer eager fp8 prefill (``python -m bench.prefill_bench --kernels``) the GPU's kernel time
#: with it from 2048 rows was 23.7 / 39.6 / 71.5 ms at 2048 / 4096 / 8000 tokens against 23.4 / 40.9 / 74.5
#: without, so it starts at 4096
SCALED_MM_ROWS: int | None = 4096
#: where the library kernel serves: FlashInfer's ``fp8_blockscale_gemm_sm90`` (W8A8, 1 x 128 activation scales it
#: computes itself, 128 x 128 weight blocks), Hopper only, bf16 activations
LIBRARY_CC, LIBRARY_BLOCK = (9, 0), (128, 128)
ACT_DTYPES = (torch.bfloat16, torch.float16)


def _split_k(k_dim: int, block_k: int, split: int) -> tuple[int, int]:
    """(splits, inputs per split) of a split-K launch: whole ``block_k`` steps per split, no empty split."""
    split = _splits(k_dim, block_k, split)
    return split, triton.cdiv(triton.cdiv(k_dim, block_k), split) * block_k


def _sum_splits(part: torch.Tensor, y: torch.Tensor, rows_p: int, pdl: bool) -> None:
    """y[m, n] = the in-order sum of the float32 partials ``part [splits, rows_p, N]`` (rows_p >= M rows)."""
    m, n = y.shape
    k._sum_splits_kernel[(triton.cdiv(n, 1024), m)](part, y, m, n, rows_p, y.stride(0), SPLIT=part.shape[0],
                                                     BLOCK=1024, PDL=pdl, launch_pdl=pdl, num_warps=4)


def _folds(counters: torch.Tensor | None, grid: tuple[int, int]) -> int:
    """The kernels' ``FOLD`` of a split-K launch over ``grid`` (column tiles, splits): the split count where its
    last programs sum the partials (more than one split and a counter for every column tile), else 0 (one split, or
    :func:`_sum_splits` does, a second launch)."""
    return grid[1] if grid[1] > 1 and counters is not None and counters.numel() >= grid[0] else 0


def _check_counters(counters: torch.Tensor | None, x: torch.Tensor) -> None:
    require(counters is None or (counters.dtype == torch.int32 and counters.dim() == 1 and counters.is_contiguous()
                                 and counters.device == x.device),
            lambda: f"counters int32 [n], contiguous, on x's device ({x.device}), zero (the workspace gemm_counters) "
                    f"or None; got {tuple(counters.shape)} {counters.dtype} on {counters.device}")


def _tma_desc(w: torch.Tensor, block_n: int, block_k: int):
    """A TMA descriptor of a 2-D tensor (A or W, last dim contiguous, 16-byte aligned rows), [block_n, block_k] tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    require(w.stride(-1) == 1 and (w.stride(0) * w.element_size()) % 16 == 0,
            lambda: f"TMA loads need 16-byte aligned rows; got strides {w.stride()}")
    return TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [block_n, block_k])


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
               pdl: bool = False, path: str | None = None,
               config: FewConfig | GemmConfig | None = None, w8a8: bool = True,
               counters: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(w, scale).T`` with float32 accumulation.

    Parameters
    ----------
    x : torch.Tensor
        [M, K] bf16 or fp16; rows may be strided, the last dim contiguous.
    w : torch.Tensor
        [N, K] ``torch.float8_e4m3fn``, last dim contiguous.
    scale : torch.Tensor
        [ceil(N / bn), ceil(K / bk)] float32 (any strides): the weight's block scales (``<name>_scale_inv``).
    block : (int, int)
        The scale block ``(bn, bk)``: bn >= 1, bk a power of two >= 16 (>= 32 for ``"w8a8"``).
    pdl : bool
        Launch with programmatic dependent launch (Hopper+, compiled kernels only).
    path : {None, "few", "w8a8", "w8a16", "flashinfer", "scaled_mm"}
        None: :func:`choose_path` (``"few"`` for M <= 16; above, the libraries' SM90 block-scale GEMMs where
        they serve, else ``"w8a8"``, or ``"w8a16"`` on a GPU without fp8 tensor cores or bk < 32). A forced path
        that cannot run raises ValueError saying why.
    config : FewConfig or GemmConfig, optional
        Tiles: :class:`FewConfig` for ``"few"`` (default :func:`few_config`),
        :class:`GemmConfig` for the others (default :func:`gemm_config`).
    w8a8 : bool
        With ``path=None``: False keeps the activations 16-bit above :data:`FEW_ROWS` rows too (``"w8a16"``, the
        model's ``model.fp8_compute=w8a16``); True lets :func:`choose_path` quantize them there.
    counters : torch.Tensor, optional
        int32 [>= cdiv(N, block_n)], zero: split-K partials summed by each column tile's last program (see the
        module docstring); None: by a second kernel.

    Returns
    -------
    torch.Tensor
        [M, N] in x's dtype, from ``torch.empty`` (``"w8a8"`` also allocates its fp8 copy of x and its scales).
    """
    m, kd, n, bn, bk = _check(x, w, scale, block)
    _check_counters(counters, x)
    chosen = _resolve_path(path, m, (bn, bk), x, w8a8)
    if chosen == "flashinfer" and m and n and kd:
        return _library_gemm()(x.contiguous(), w, None, scale, out_dtype=x.dtype)
    if chosen == "scaled_mm" and m and n and kd:  # rows padded to 16: cuBLAS refuses unaligned row counts
        q, qs = quantize_act(x, bk, pdl, row_multiple=16)
        scaled_mm, st = _torch_block_scaled()  # the activations' scales outer-dim-major, as cuBLAS reads them
        return scaled_mm(q, w.t(), qs.t().contiguous().t(), st.BlockWise1x128, scale.t(), st.BlockWise128x128,
                         output_dtype=x.dtype)[:m]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if kd == 0:
        return y.zero_()
    if chosen == "few":
        require(config is None or isinstance(config, FewConfig),
                lambda: f"config a fp8_gemm.FewConfig for the few-row path; got {type(config).__name__}")
        cfg = config or few_config(n, kd, x.device, m)
        _check_pow2("config.block_k", cfg.block_k, 16)
        low = 1 if cfg.fma else 16
        require(cfg.block_n >= low and cfg.block_n & (cfg.block_n - 1) == 0,
                lambda: f"config.block_n a power of two >= {low} ({'fma' if cfg.fma else 'one tensor-core tile'}); got "
                        f"{cfg.block_n}")
        _few(x, w, scale, y, bn, bk, cfg, pdl, counters=counters)
        return y
    if chosen == "split":
        require(config is None or isinstance(config, SplitConfig),
                lambda: f"config a fp8_gemm.SplitConfig for the split path; got {type(config).__name__}")
        _split(x, w, scale, y, bn, bk, config or split_config(m, n, kd, bk, x.device), pdl)
        return y
    require(config is None or isinstance(config, GemmConfig),
            lambda: f"config a fp8_gemm.GemmConfig for the {chosen} path; got {type(config).__name__}")
    a_fp8 = chosen == "w8a8"
    cfg = config or gemm_config(m, n, kd, bk, a_fp8, x.device)
    _check_pow2("config.block_k", cfg.block_k, 32 if a_fp8 else 16)
    require(bk % cfg.block_k == 0, lambda: f"config.block_k ({cfg.block_k}) dividing the scale block's bk ({bk})")
    if a_fp8:
        a, a_scale = quantize_act(x, bk, pdl)
    else:
        a, a_scale = x, scale  # a_scale unused (A_FP8 off)
    p = use_pdl(pdl, k._block_gemm_kernel, x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    if cfg.tma:
        _tma_gemm(a, a_scale, w, scale, y, bn, bk, a_fp8, cfg, p, grid)
        return y
    k._block_gemm_kernel[grid](
        a, a_scale, w, scale, y, m, n, kd, a.stride(0), a_scale.stride(0), a_scale.stride(1), w.stride(0),
        scale.stride(0), scale.stride(1), y.stride(0), bn, BK_S=bk, A_FP8=a_fp8, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=kd % cfg.block_k == 0, PDL=p,
        launch_pdl=p, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def _tma_gemm(a, a_scale, w, scale, y, bn: int, bk: int, a_fp8: bool, cfg: GemmConfig, pdl: bool, grid) -> None:
    """The tiled GEMM with TMA loads (:class:`GemmConfig` ``tma``): host-built descriptors of A and W."""
    m, kd = a.shape
    a_desc = _tma_desc(a, cfg.block_m, cfg.block_k)
    b_desc = _tma_desc(w, cfg.block_n, cfg.block_k)
    k._block_gemm_tma_kernel[grid](
        a_desc, a_scale, b_desc, scale, y, m, w.shape[0], kd, a_scale.stride(0), a_scale.stride(1), scale.stride(0),
        scale.stride(1), y.stride(0), bn, BK_S=bk, A_FP8=a_fp8, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PDL=pdl, WS=cfg.ws, launch_pdl=pdl, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def fp8_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int] = FP8_BLOCK, pdl: bool = False,
                    config: FewConfig | None = None, counters: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_linear(rms_norm(x, norm_weight, eps), w, scale)`` in one launch for M <= :data:`FMA_ROWS` rows (the
    q LoRA's q_a_layernorm then q_b_proj at decode): the CUDA-core kernel norms the rows as the fused RMSNorm
    kernel rounds, then streams the fp8 weight. norm_weight [K] of x's dtype, contiguous. More rows: ValueError
    (norm first, then :func:`fp8_linear`)."""
    m, kd, n, bn, bk = _check(x, w, scale, block)
    _check_counters(counters, x)
    require(0 < m <= FMA_ROWS and x.dtype in ACT_DTYPES,
            lambda: f"fp8_norm_linear: 1 to {FMA_ROWS} rows of bf16 / fp16; got {m} rows of {x.dtype}. Fix: rms_norm, "
                    f"then fp8_linear")
    require(norm_weight.shape == (kd,) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous(),
            lambda: f"norm_weight [K] of x's dtype, contiguous; got {tuple(norm_weight.shape)} {norm_weight.dtype}")
    cfg = config or few_config(n, kd, x.device, m)
    require(cfg.fma, lambda: f"fp8_norm_linear: a FewConfig with fma=True; got {cfg}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if n:
        _few(x, w, scale, y, bn, bk, cfg, pdl, (norm_weight, float(eps)), counters)
    return y


def _few(x, w, scale, y, bn: int, bk: int, cfg: FewConfig, pdl: bool, norm: tuple | None = None,
         counters: torch.Tensor | None = None) -> None:
    """The few-row kernel into ``y``; with ``cfg.split_k > 1`` (whole ``block_k`` steps per split) its float32
    partials go to a ``[split, 16, N]`` temporary, summed in order (:func:`_folds`). ``norm``: (weight, eps) of an
    RMSNorm of x first (the CUDA-core kernel only)."""
    split = cfg.split_k
    require(isinstance(split, int) and split >= 1, lambda: f"config.split_k a positive int; got {split!r}")
    m, kd = x.shape
    n = w.shape[0]
    split, k_split = _split_k(kd, cfg.block_k, split)
    part = torch.empty(split, 16, n, dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (triton.cdiv(n, cfg.block_n), split)
    fold = _folds(counters, grid)
    cnt = counters if fold else part  # never read without FOLD
    strides = (x.stride(0), w.stride(0), scale.stride(0), scale.stride(1), y.stride(0), bn)
    one_row = bn % cfg.block_n == 0
    if cfg.fma:
        require(m <= FMA_ROWS, lambda: f"config.fma for at most {FMA_ROWS} rows; got {m} rows. Fix: fma=False")
        nw, eps = norm or (w, 0.0)
        p = use_pdl(pdl, k._few_fma_kernel, x.device)
        k._few_fma_kernel[grid](x, w, scale, y, part, cnt, nw, m, n, kd, k_split, *strides, eps, BK_S=bk,
                                M_PAD=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                ONE_SCALE_ROW=one_row, PARTIAL=split > 1, FOLD=fold,
                                NORM=norm is not None, PDL=p, launch_pdl=p, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages)
    else:
        p = use_pdl(pdl, k._few_w8a16_kernel, x.device)
        k._few_w8a16_kernel[grid](x, w, scale, y, part, cnt, m, n, kd, k_split, *strides, BK_S=bk,
                                  BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ONE_SCALE_ROW=one_row,
                                  PARTIAL=split > 1, FOLD=fold, PDL=p, launch_pdl=p,
                                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1 and not fold:
        _sum_splits(part, y, 16, p)


def _split(x, w, scale, y, bn: int, bk: int, cfg: SplitConfig, pdl: bool) -> None:
    """The ``"split"`` W8A8 kernel into ``y`` (M <= :data:`SPLIT_MAX_ROWS`); with more than one split its float32
    partials go to a ``[split, M, N]`` temporary that :func:`k._sum_splits_kernel` sums in order."""
    m, kd = x.shape
    n = w.shape[0]
    block_k = min(bk, 128)
    require(isinstance(cfg.block_n, int) and cfg.block_n >= 16 and cfg.block_n & (cfg.block_n - 1) == 0,
            lambda: f"config.block_n a power of two >= 16 (one tensor-core tile); got {cfg.block_n!r}")
    require(isinstance(cfg.split_k, int) and cfg.split_k >= 1, lambda: f"config.split_k a positive int; got "
                                                                       f"{cfg.split_k!r}")
    require(not cfg.quant or block_k == bk, lambda: f"config.quant: one 128-input step per activation scale group; the "
                                                    f"scale block's bk is {bk} (fix: quant=False)")
    split, k_split = _split_k(kd, block_k, cfg.split_k)
    a, a_scale = (x, scale) if cfg.quant else quantize_act(x, bk, pdl)  # scale: unused with quant
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    p = use_pdl(pdl, k._split_w8a8_kernel, x.device)
    w_desc = _tma_desc(w, cfg.block_n, block_k) if cfg.tma else w
    k._split_w8a8_kernel[(triton.cdiv(n, cfg.block_n), split)](
        a, a_scale, w, w_desc, scale, y, part, m, n, kd, k_split, a.stride(0), a_scale.stride(0), w.stride(0),
        scale.stride(0), scale.stride(1), y.stride(0), bn, BK_S=bk, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=cfg.block_n, BLOCK_K=block_k, QUANT=cfg.quant, TMA=cfg.tma, PARTIAL=split > 1,
        ROUND_FIRST=interpreted(k._split_w8a8_kernel), PDL=p, launch_pdl=p, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if split > 1:
        _sum_splits(part, y, m, p)


def quantize_act(x: torch.Tensor, group: int = 128, pdl: bool = False, row_multiple: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-``group``-inputs fp8 quantization of activations (DeepSeek-V3's ``act_quant``).

    Parameters
    ----------
    x : torch.Tensor
        [M, K] bf16 / fp16 / float32; rows may be strided, the last dim contiguous.
    group : int
        Inputs per scale, a power of two >= 16 (the weight's bk, 128 for DeepSeek-V3).
    pdl : bool
        Launch with programmatic dependent launch.
    row_multiple : int
        Both outputs get M rounded up to a multiple of it rows; the rows past M are left unwritten (a library
        GEMM that needs aligned row counts reads them into output rows that are dropped).

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        ``x_fp8`` [M, K] ``float8_e4m3fn`` and ``x_scale`` [M, ceil(K / group)] float32, both contiguous, with
        ``x_scale = max(amax(|x_group|) / 448, 1e-12)`` and ``x_fp8 = clamp(x / x_scale, +-448)`` rounded to
        nearest (the bits of the same computation in torch).
    """
    _check_pow2("group", group, 16)
    require(x.dim() == 2 and x.dtype in (*ACT_DTYPES, torch.float32) and (x.numel() == 0 or x.stride(-1) == 1),
            lambda: f"x [M, K] bf16 / fp16 / float32 with a contiguous last dim; got {tuple(x.shape)} {x.dtype} "
                    f"strides {tuple(x.stride())} (fix: x.contiguous())")
    m, kd = x.shape
    rows = triton.cdiv(m, row_multiple) * row_multiple
    q = torch.empty(rows, kd, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, triton.cdiv(kd, group), dtype=torch.float32, device=x.device)
    if m == 0 or kd == 0:
        return q, s
    block_m = 16 if m <= 16 else 32
    p = use_pdl(pdl, k._quant_act_kernel, x.device)
    k._quant_act_kernel[(triton.cdiv(m, block_m), s.shape[1])](
        x, q, s, m, kd, x.stride(0), q.stride(0), s.stride(0), BLOCK_M=block_m, G=group, PDL=p,
        ROUND_FIRST=interpreted(k._quant_act_kernel), launch_pdl=p, num_warps=4)
    return q, s


def choose_path(m: int, bk: int, device: torch.device | str, dtype: torch.dtype = torch.float16,
                block: tuple[int, int] | None = None, library: bool = True, w8a8: bool = True, k_dim: int = 0
                ) -> str:
    """The path :func:`fp8_linear` takes with ``path=None``: ``"few"`` for M <= :data:`FEW_ROWS` (bf16
    activations: the decode step keeps the dequantized model's precision; FlashInfer's W8A8 is 1.3-2.7x faster
    there on an H200, but its e4m3 activations took a 4-layer decode's hidden-state error from 3.6e-2 to 5.1e-2,
    past the parity tolerance); up to :data:`SPLIT_ROWS` our ``"split"`` W8A8 kernel (fp8 tensor cores, bk >=
    32: the decode batches); above it the libraries where they serve (bf16 activations, 128 x 128 blocks, an
    SM90 GPU): FlashInfer's kernel (importable), or from :data:`SCALED_MM_ROWS` rows (4096 by default)
    torch's ``F.scaled_mm`` (cuBLAS), both faster than ours at every TP8 shape measured on an H200
    (``python -m bench.fp8_gemm_bench``:
    at 2048 / 4096 rows cuBLAS 89.7-139.9 / 129.2-270.1 µs, FlashInfer 70.2-167.7 / 142.3-287.7 over qkv_a,
    o_proj, gate_up; FlashInfer ahead up to 1024 rows); ``k_dim``: K, which cuBLAS's path needs a multiple of
    512 (0: unknown, not taken); else ``"w8a8"`` where fp8 tensor cores exist and bk >= 32, else
    ``"w8a16"`` (``library`` False: our kernels' path only, for the bench; ``w8a8`` False: ``"w8a16"`` above
    :data:`FEW_ROWS` whatever the GPU)."""
    if m <= FEW_ROWS:
        return "few"
    if not w8a8:
        return "w8a16"
    if m <= SPLIT_ROWS and bk >= 32 and _fp8_dot_ok(device):
        return "split"
    block = tuple(block or (128, bk))
    if library and SCALED_MM_ROWS is not None and m >= SCALED_MM_ROWS and _scaled_mm_serves(dtype, block, device,
                                                                                             k_dim):
        return "scaled_mm"
    if library and _library_serves(dtype, block, device):
        return "flashinfer"
    return "w8a8" if _fp8_dot_ok(device) and bk >= 32 else "w8a16"


# ------------------------------------------------------------------------------------------------ checks
def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block) -> tuple[int, int, int, int, int]:
    require(isinstance(block, (tuple, list)) and len(block) == 2 and all(isinstance(b, int) for b in block)
            and block[0] >= 1, lambda: f"block = (bn, bk), two ints, bn >= 1; got {block!r}")
    bn, bk = block
    _check_pow2("block's bk", bk, 16)
    require(x.dim() == 2 and x.dtype in ACT_DTYPES and (x.numel() == 0 or x.stride(-1) == 1),
            lambda: f"x [M, K] bf16 or fp16 with a contiguous last dim; got {tuple(x.shape)} {x.dtype} strides "
                    f"{tuple(x.stride())} (fix: x.to(torch.bfloat16) / x.contiguous())")
    kd = x.shape[1]
    require(w.dim() == 2 and w.dtype == torch.float8_e4m3fn and w.shape[1] == kd
            and (w.numel() == 0 or w.stride(-1) == 1),
            lambda: f"w [N, K={kd}] torch.float8_e4m3fn with a contiguous last dim; got {tuple(w.shape)} {w.dtype} "
                    f"(fp8 checkpoints store weight [out, in] and weight_scale_inv)")
    n = w.shape[0]
    want = (triton.cdiv(n, bn), triton.cdiv(kd, bk))
    require(scale.dtype == torch.float32 and tuple(scale.shape) == want,
            lambda: f"scale [ceil(N / {bn}), ceil(K / {bk})] = {list(want)} float32 for w {tuple(w.shape)} and block "
                    f"{tuple(block)}; got {tuple(scale.shape)} {scale.dtype} (ue8m0 / bf16 scales: convert with "
                    f"runtime.model.quantized.scale_values first)")
    require(x.device == w.device == scale.device,
            lambda: f"x, w and scale on one device; got {x.device}, {w.device}, {scale.device}")
    return x.shape[0], kd, n, bn, bk


def _check_pow2(what: str, value, least: int) -> None:
    require(isinstance(value, int) and value >= least and value & (value - 1) == 0,
            lambda: f"{what} a power of two >= {least}; got {value!r}")


def _resolve_path(path: str | None, m: int, block: tuple[int, int], x: torch.Tensor, w8a8: bool) -> str:
    require(path in PATHS, lambda: f"path one of {PATHS}; got {path!r}")
    bk, device = block[1], x.device
    if path is None:
        return choose_path(m, bk, device, x.dtype, block, w8a8=w8a8, k_dim=x.shape[1])
    if path == "flashinfer":
        require(_library_serves(x.dtype, block, device),
                lambda: f"bf16 activations, {LIBRARY_BLOCK} blocks, a GPU of compute capability {LIBRARY_CC} and "
                        f"FlashInfer for path='flashinfer'; got {x.dtype}, {tuple(block)}, {device} (fix: path=None)")
    if path == "scaled_mm":
        require(_scaled_mm_serves(x.dtype, block, device, x.shape[1]),
                lambda: f"bf16 activations, {LIBRARY_BLOCK} blocks, K a multiple of 512, a GPU of compute capability "
                        f"{LIBRARY_CC} and torch's F.scaled_mm with block scaling for path='scaled_mm'; got {x.dtype}, "
                        f"{tuple(block)}, K {x.shape[1]}, {device} (fix: path=None)")
    if path == "few":
        require(m <= FEW_ROWS, lambda: f"M <= {FEW_ROWS} rows for path='few' (one 16-row tile); got M = {m} (fix: "
                                       f"path=None, 'w8a8' or 'w8a16')")
    if path == "split":
        require(m <= SPLIT_MAX_ROWS, lambda: f"M <= {SPLIT_MAX_ROWS} rows for path='split' (one activation tile); got "
                                             f"M = {m} (fix: path=None or 'w8a8')")
    if path in ("w8a8", "split"):
        require(bk >= 32, lambda: f"bk >= 32 for path={path!r} (fp8 tensor-core steps are 32 deep); got bk = {bk} "
                                  f"(fix: path='w8a16')")
        require(_fp8_dot_ok(device), lambda: f"a GPU with fp8 tensor cores (compute capability 8.9+) for "
                                             f"path={path!r}; got {device} (fix: path='w8a16')")
    return path


def _fp8_dot_ok(device: torch.device | str) -> bool:
    """fp8 tensor-core products run here: Triton's interpreter (emulated), or a CUDA GPU of capability 8.9+."""
    if interpreted(k._block_gemm_kernel):
        return True
    device = torch.device(device)
    if device.type != "cuda":
        return False
    return _cuda_capability(torch.cuda.current_device() if device.index is None else device.index) >= (8, 9)


def _library_serves(dtype: torch.dtype, block: tuple[int, int], device: torch.device | str) -> bool:
    device = torch.device(device)
    if dtype != torch.bfloat16 or tuple(block) != LIBRARY_BLOCK or device.type != "cuda":
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return _cuda_capability(index) == LIBRARY_CC and _library_gemm() is not None


def _scaled_mm_serves(dtype: torch.dtype, block: tuple[int, int], device: torch.device | str, k_dim: int) -> bool:
    """torch's ``F.scaled_mm`` takes 1 x 128 activation / 128 x 128 weight block scales here (cuBLAS on SM90):
    bf16 activations, 128 x 128 blocks, K a multiple of 512 (cuBLAS wants the weight scales' K blocks in fours:
    the TP8 rank's dense down, K 2304, is refused), a GPU of :data:`LIBRARY_CC`, a torch with ``F.ScalingType``."""
    device = torch.device(device)
    if dtype != torch.bfloat16 or tuple(block) != LIBRARY_BLOCK or device.type != "cuda" or k_dim <= 0 or k_dim % 512:
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return _cuda_capability(index) == LIBRARY_CC and _torch_block_scaled() is not None


@functools.cache
def _torch_block_scaled():
    """(torch's ``F.scaled_mm``, its ``ScalingType``), None with a torch that has no block-scaled product."""
    try:
        from torch.nn.functional import ScalingType, scaled_mm
    except ImportError:  # an older torch: FlashInfer or our kernels serve
        return None
    return scaled_mm, ScalingType


@functools.cache
def _library_gemm():
    """FlashInfer's ``fp8_blockscale_gemm_sm90`` (x, w, x_scale=None, w_scale, out_dtype), None without it."""
    try:
        from flashinfer.gemm import fp8_blockscale_gemm_sm90
    except Exception:  # noqa: BLE001 - not installed, or built without the SM90 GEMMs: our kernels serve
        return None
    return fp8_blockscale_gemm_sm90


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
