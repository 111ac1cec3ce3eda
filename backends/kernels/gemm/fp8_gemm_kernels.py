"""Triton kernels for linear layers over DeepSeek-V3 block-fp8 weights, launchers in
:mod:`backends.kernels.gemm.fp8_gemm`.

Weight format: ``W [N, K]`` float8 e4m3 and ``S [ceil(N / BN_S), ceil(K / BK_S)]`` float32, the dequantized weight
being ``W[n, k] * S[n // BN_S, k // BK_S]`` (the edge blocks may be partial). ``BN_S`` / ``BK_S`` are the scale
block; ``BK_S`` is a power of two (a constexpr), ``BN_S`` any positive int (each output column gathers its own
scale row, so no relation between the scale block and the column tile is needed).

* :func:`_few_w8a16_kernel`: M <= 16 rows (decode). One program per block of output columns streams its weight rows
  once; each fp8 tile is widened to the activations' dtype in registers and fed to the tensor cores as the A
  operand against the activations as one zero-padded 16-row B tile (as ``skinny_kernels._linear_dot_kernel``);
  the tile's partial product is multiplied by its (column, k-block) scale and added to a float32 accumulator.
  A row's result does not depend on M (padded rows are zeros, same tile, same order).
* :func:`_few_fma_kernel`: M <= 2 rows on the CUDA cores (float32 products of the widened weights), same
  split-K; the few-row path's choice at one row where it measures faster.
* :func:`_split_w8a8_kernel`: W8A8 for a few dozen rows (decode batches): the weight tile on the tensor cores'
  wide side, the activations (quantized in the kernel) on the narrow one, the inputs split over programs.
* :func:`_block_gemm_kernel`: a tiled GEMM for any M, block scales applied per k-step. ``A_FP8``: W8A8 as
  DeepSeek's inference code (``act_quant`` + ``fp8_gemm``): A is fp8 with one scale per row and ``BK_S`` inputs
  (:func:`_quant_act_kernel`), ``acc += dot(a, b) * a_scale[:, None] * b_scale[None, :]``, fp8 tensor cores.
  Otherwise W8A16: A is bf16 / fp16, B widened to it in registers, ``acc += dot(a, b) * b_scale[None, :]``.
  :func:`_block_gemm_tma_kernel`: the same with TMA loads (Hopper+), optionally warp-specialized.
* :func:`_quant_act_kernel`: x [M, K] -> fp8 [M, K] and float32 scales [M, ceil(K / G)], per row and G inputs:
  ``s = max(amax / 448, 1e-12)``, ``q = clamp(x / s, +-448)`` (IEEE division, so the bits equal torch's).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.pdl import pdl_enter

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _few_w8a16_kernel(X, W, S, Y, P, CNT, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
                      BN_S, BK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      ONE_SCALE_ROW: tl.constexpr, PARTIAL: tl.constexpr, FOLD: tl.constexpr, PDL: tl.constexpr):
    """Y[:M, n-block] = X[:M] @ dequant(W)[n-block].T for M <= 16, float32 accumulation.

    X [M, K] bf16 / fp16 (rows strided, last dim contiguous); W [N, K] fp8 e4m3; S float32 scales; Y [M, N] of X's
    dtype; one chained accumulator ``acc[BLOCK_N, 16]``. ``ONE_SCALE_ROW`` (the program's rows lie in one scale
    row: BN_S a multiple of BLOCK_N): one [BLOCK_N, BLOCK_K] weight load per step, as the bf16 few-row kernel, each
    input column's block scale multiplying the 16 activation rows, ``(X * s[k-block]).to(X dtype)``; otherwise
    sub-tiles of ``min(BLOCK_K, BK_S)`` inputs, each weight row widened and scaled, ``(W * s[row]).to(X dtype)``
    (what dequantize-at-load computes).

    Split-K: program (n-block, j) sums the inputs ``[j K_SPLIT, (j + 1) K_SPLIT)`` (K_SPLIT a multiple of BLOCK_K;
    one split: K_SPLIT >= K); ``PARTIAL``: it stores its float32 partial in ``P [splits, 16, N]`` and
    :func:`_sum_splits_kernel` adds the partials in order (deterministic), or with ``FOLD`` the column block's last
    program does (:func:`_partial_out`). More programs keep more weight bytes in flight where the column blocks
    alone leave SMs idle (gate_up of a TP8 rank: 72 blocks of 64 columns on 132 SMs).

    Speed (H200, one row): 17-22% of copy bandwidth, 0.44-0.75x the bf16 few-row kernel on bf16 weights; the time
    grows with BLOCK_N (fewer, longer programs), a per-sub-tile ``dot * scale`` and reading the weights as bytes
    widened by bit operations ran at the same speed (docs/kernels.md)."""
    pdl_enter(PDL)
    SUB_K: tl.constexpr = BLOCK_K if BLOCK_K < BK_S else BK_S
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    nmask = rn < N
    mmask = rm < M
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = X + rm[:, None] * stride_xm
    s_rows = S + (rn // BN_S) * stride_sn
    s_tile = S + (tl.program_id(0) * BLOCK_N // BN_S) * stride_sn
    DT: tl.constexpr = Y.dtype.element_ty
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    if ONE_SCALE_ROW:  # one [BLOCK_N, BLOCK_K] load per step, each column's k-block scale on the activations
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
            sv = tl.load(s_tile + (rk // BK_S) * stride_sk, mask=kmask, other=0.0)
            acc = tl.dot(w.to(DT), tl.trans((x.to(tl.float32) * sv[None, :]).to(DT)), acc)
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for j in tl.static_range(BLOCK_K // SUB_K):
                ks = k0 + j * SUB_K
                rk = ks + tl.arange(0, SUB_K)
                kmask = rk < K
                w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
                x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
                # a sub-tile wholly past K (last step) reads the last k-block's scales: its products are zeros
                s = tl.load(s_rows + (tl.minimum(ks, K - 1) // BK_S) * stride_sk, mask=nmask, other=0.0)
                acc = tl.dot((w.to(tl.float32) * s[:, None]).to(DT), tl.trans(x), acc)
    if not PARTIAL:
        out = tl.trans(acc).to(DT)
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], out, mask=mmask[:, None] & nmask[None, :])
    else:
        _partial_out(P, CNT, Y, tl.trans(acc), rm, rn, M, N, 16, stride_ym, FOLD)


@triton.jit
def _few_fma_kernel(X, W, S, Y, P, CNT, NW, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
                    BN_S, eps, BK_S: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ONE_SCALE_ROW: tl.constexpr, PARTIAL: tl.constexpr, FOLD: tl.constexpr, NORM: tl.constexpr,
                    PDL: tl.constexpr):
    """Y[:M, n-block] = X[:M] @ dequant(W)[n-block].T for M <= M_PAD (1 or 2 rows), on the CUDA cores.

    At one or two rows a linear layer does 2 to 4 flops per weight byte: the FMA units keep up with the memory,
    and the weights need no tensor-core operand layout. Each step loads a ``[BLOCK_N, BLOCK_K]`` fp8 tile
    (16-byte vector loads), widens it to float32 and multiplies it by the rows of X (float32, times each input's
    block scale: ``ONE_SCALE_ROW``, the program's rows in one scale row; else the weight tile is scaled per
    element). Each row's products add into a ``[BLOCK_N, BLOCK_K]`` accumulator of its own in the load's layout
    (no shuffle, no layout change in the loop), summed over K once at the end: the second row costs one more FMA
    per weight element, not a reduction per step. No rounding before the output; row 0's operations are the same
    at one and two rows.
    Split-K and ``PARTIAL`` as :func:`_few_w8a16_kernel`. ``NORM``: X is first RMS-normed per row with weight NW
    [K], rounded as the fused norm kernel rounds (``skinny_kernels._linear_dot_kernel``'s NORM), so the product is
    ``linear(rms_norm(X), W)`` without the norm's own launch."""
    tl.static_assert(M_PAD <= 2, "the CUDA-core kernel takes one or two rows")
    pdl_enter(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, M_PAD)
    nmask = rn < N
    mmask = rm < M
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = X + rm[:, None] * stride_xm
    s_tile = S + (tl.program_id(0) * BLOCK_N // BN_S) * stride_sn
    s_rows = S + (rn // BN_S)[:, None] * stride_sn
    DT: tl.constexpr = Y.dtype.element_ty
    if NORM:  # the rows' sums of squares: one pass over X (a few KB, from L2) before the weight stream
        ss = tl.zeros([M_PAD], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xf = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    else:
        rstd = tl.full([M_PAD], 1.0, tl.float32)
    rstd0 = tl.sum(tl.where(rm == 0, rstd, 0.0))
    rstd1 = tl.sum(tl.where(rm == 1, rstd, 0.0))
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # row 0's products, in the weight load's layout
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # row 1's (M_PAD 2)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    k_row1 = K * tl.minimum(M - 1, 1)  # row 1's inputs: K where it exists, none at M = 1
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        if not ONE_SCALE_ROW:
            w = w * tl.load(s_rows + (rk // BK_S)[None, :] * stride_sk, mask=nmask[:, None] & kmask[None, :],
                            other=0.0)
        sv = tl.full([BLOCK_K], 1.0, tl.float32)
        if ONE_SCALE_ROW:
            sv = tl.load(s_tile + (rk // BK_S) * stride_sk, mask=kmask, other=0.0)
        acc0 += w * _fma_row(X, NW, rk, kmask, rstd0, sv, NORM, ONE_SCALE_ROW, DT)[None, :]  # M >= 1 here
        if M_PAD == 2:
            acc1 += w * _fma_row(X + stride_xm, NW, rk, rk < k_row1, rstd1, sv, NORM, ONE_SCALE_ROW, DT)[None, :]
    acc = tl.sum(acc0, axis=1)[None, :]
    if M_PAD == 2:
        acc = tl.where(rm[:, None] == 0, acc, tl.sum(acc1, axis=1)[None, :])
    if not PARTIAL:
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])
    else:
        _partial_out(P, CNT, Y, acc, rm, rn, M, N, 16, stride_ym, FOLD)


@triton.jit
def _fma_row(x_ptr, NW, rk, kmask, rstd, sv, NORM: tl.constexpr, ONE_SCALE_ROW: tl.constexpr, DT: tl.constexpr):
    """One activation row of :func:`_few_fma_kernel` over the inputs ``rk``, in float32: loaded, RMS-normed
    (``NORM``: times ``rstd`` and the norm weight NW, rounded as the fused norm kernel rounds) and times its inputs'
    block scales ``sv`` (``ONE_SCALE_ROW``)."""
    x = tl.load(x_ptr + rk, mask=kmask, other=0.0).to(tl.float32)
    if NORM:
        g = tl.load(NW + rk, mask=kmask, other=0.0).to(tl.float32)
        x = ((x * rstd).to(DT).to(tl.float32) * g).to(DT).to(tl.float32)
    if ONE_SCALE_ROW:
        x = x * sv
    return x


@triton.jit
def _sum_splits_kernel(P, Y, M, N, ROWS_P, stride_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Y[m, n] = sum over j in order of P[j, m, n] (float32, ``ROWS_P`` rows a split), in Y's dtype: the split-K
    partials of :func:`_few_w8a16_kernel` and :func:`_split_w8a8_kernel`. One program per BLOCK outputs of one
    row (grid: column blocks x M)."""
    pdl_enter(PDL)
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rn < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(SPLIT):
        acc += tl.load(P + (j * ROWS_P + m).to(tl.int64) * N + rn, mask=mask, other=0.0)
    tl.store(Y + m * stride_ym + rn, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _partial_out(P, CNT, Y, acc, rm, rn, M, N, ROWS_P, stride_ym, FOLD: tl.constexpr):
    """A split-K program's end: its float32 partial ``acc [rows, BLOCK_N]`` (rows ``rm``, columns ``rn``) into
    split ``program_id(1)`` of ``P [splits, ROWS_P, N]``. ``FOLD`` (the split count; 0: off): the program also
    counts its split in the column tile's counter ``CNT[program_id(0)]`` (int32, zero on entry); the one that
    counts the last split sums every split's partial in order, the additions of :func:`_sum_splits_kernel` (so the
    same bits), stores the sum in Y and sets the counter back to zero for the next launch: no second kernel. Every
    warp's partial stores are issued before the count (barrier, then a release at GPU scope); the summing program's
    loads come after its acquire and bypass L1."""
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm[:, None] * N + rn[None, :]
    tl.store(P + tl.program_id(1).to(tl.int64) * ROWS_P * N + offs, acc, mask=mask)
    if FOLD:
        tl.debug_barrier()
        done = tl.atomic_add(CNT + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if done == FOLD - 1:
            tl.store(CNT + tl.program_id(0), 0)
            total = tl.zeros_like(acc)
            part = P
            for _ in tl.static_range(FOLD):  # unrolled: the loads need not wait for one another
                total += tl.load(part + offs, mask=mask, other=0.0, cache_modifier=".cg")
                part += ROWS_P * N
            tl.store(Y + rm[:, None] * stride_ym + rn[None, :], total.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _split_w8a8_kernel(X, XS, W, w_desc, S, Y, P, M, N, K, K_SPLIT, stride_xm, stride_xsm, stride_wn, stride_sn,
                       stride_sk, stride_ym, BN_S, BK_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, QUANT: tl.constexpr, TMA: tl.constexpr, PARTIAL: tl.constexpr,
                       ROUND_FIRST: tl.constexpr, PDL: tl.constexpr):
    """W8A8 for a few dozen rows: Y[:M, n-block] = X[:M] @ dequant(W)[n-block].T, the weight on the wide side.

    At 17-64 rows a 64-row tile of the tiled GEMM holds every row, so the grid is only the column blocks (33 for
    a TP8 rank's qkv_a) and most SMs idle. Here the product is turned around: each program multiplies a
    ``[BLOCK_N, BLOCK_K]`` fp8 weight tile (the tensor cores' 64 / 128-row side) by the ``[BLOCK_M, BLOCK_K]``
    e4m3 activations (BLOCK_M >= M, 16 to 128: their narrow side), and the inputs are split over programs
    (program (n-block, j) sums ``[j K_SPLIT, (j + 1) K_SPLIT)``, K_SPLIT a multiple of BLOCK_K), so the grid
    fills the GPU and every weight byte is read once. BLOCK_K divides BK_S: each step lies in one scale block and
    ``acc[BLOCK_N, BLOCK_M] += dot(w, q.T) * w_scale[:, None] * x_scale[None, :]`` (each weight row's own scale
    row: any BN_S).

    ``QUANT``: X is bf16 / fp16 and each program quantizes its own activation tiles with the scales of
    :func:`_quant_act_kernel` (per row and BK_S inputs), each input times the scale's reciprocal (that kernel
    divides: a quotient may differ in its last float32 bit, so an e4m3 value at a rounding tie may differ), so no
    quantize launch and no fp8 copy of X in memory; else X is that kernel's e4m3 output with scales XS. ``TMA``:
    the weight tiles by the tensor memory accelerator (``w_desc``, block [BLOCK_N, BLOCK_K], edges read as
    zeros); else pointer loads (wrapped rows, masked K edge). ``PARTIAL``: the float32 partial goes to ``P [splits,
    M, N]`` for :func:`_sum_splits_kernel`. (The few-row kernels' sum in the tile's last program, :func:`_partial_out`'s
    ``FOLD``, was slower here: that program's sum of up to 28 partials of 32 x 128 is the launch's tail, 1-10 µs
    alone on an H200, and the batch-32 step took 5492 against 5205 µs of kernels.)"""
    tl.static_assert(BK_S % BLOCK_K == 0, "a step lies in one scale block")
    tl.static_assert(not QUANT or BLOCK_K == BK_S, "QUANT: a step is one activation scale group")
    pdl_enter(PDL)
    n0 = tl.program_id(0) * BLOCK_N
    rn = n0 + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    w_rows = W + (rn % N).to(tl.int64)[:, None] * stride_wn
    s_rows = S + ((rn % N) // BN_S) * stride_sn
    x_rows = X + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kmask = (k0 + rk) < K
        if TMA:
            w = w_desc.load([n0, k0])
        else:
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=kmask[None, :], other=0.0)
        xmask = mmask[:, None] & kmask[None, :]
        if QUANT:  # times the reciprocal of the row's scale: one division a row, not one an input
            x = tl.load(x_rows + (k0 + rk)[None, :], mask=xmask, other=0.0).to(tl.float32)
            xs = _row_scales(x)
            q = tl.minimum(tl.maximum(x * tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), xs)[:, None], -FP8_MAX),
                           FP8_MAX)
            if ROUND_FIRST:
                q = _round_e4m3(q)
            q = q.to(w.dtype)
        else:
            q = tl.load(x_rows + (k0 + rk)[None, :], mask=xmask, other=0.0)
            xs = tl.load(XS + rm * stride_xsm + k0 // BK_S, mask=mmask, other=0.0)
        ws = tl.load(s_rows + (k0 // BK_S) * stride_sk)
        acc += tl.dot(w, tl.trans(q)) * ws[:, None] * xs[None, :]
    if PARTIAL:
        _partial_out(P, P, Y, tl.trans(acc), rm, rn, M, N, M, stride_ym, 0)
    else:
        _store_tile(Y, tl.trans(acc), rm, rn, M, N, stride_ym)


@triton.jit
def _row_scales(x):
    """The e4m3 scale of each row of float32 x [rows, G]: ``max(amax(|x|) / 448, 1e-12)``, IEEE-rounded."""
    return tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), 1e-12)


@triton.jit
def _block_gemm_kernel(A, AS, B, BS, C, M, N, K, stride_am, stride_asm, stride_ask, stride_bn, stride_bsn,
                       stride_bsk, stride_cm, BN_S, BK_S: tl.constexpr, A_FP8: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    """C[m-block, n-block] = A @ dequant(B).T, float32 accumulation, one program per output tile.

    A [M, K]: fp8 e4m3 with scales AS [M, ceil(K / BK_S)] (``A_FP8``), or bf16 / fp16 (AS unused); B [N, K] fp8
    e4m3 with block scales BS; C [M, N] bf16 / fp16. BLOCK_K divides BK_S (both powers of two), so every k-step lies
    in one scale block and its product is scaled before it joins the accumulator. Programs are ordered in groups
    of GROUP_M row tiles (the B tiles of a group stay in L2). Out-of-range rows / columns are read wrapped
    (``% M``, ``% N``) and not stored, so only the K edge is masked (not at all with ``EVEN_K``)."""
    pdl_enter(PDL)
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rma = rm % M
    rnb = rn % N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + rma.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptrs = B + rnb.to(tl.int64)[:, None] * stride_bn + rk[None, :]
    as_ptrs = AS + rma * stride_asm
    bs_ptrs = BS + (rnb // BN_S) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            kmask = (k0 + rk) < K
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[None, :], other=0.0)
        acc = _scaled_step(acc, a, b, as_ptrs, bs_ptrs, k0 // BK_S, stride_ask, stride_bsk, A_FP8)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _store_tile(C, acc, rm, rn, M, N, stride_cm)


@triton.jit
def _block_gemm_tma_kernel(a_desc, AS, b_desc, BS, C, M, N, K, stride_asm, stride_ask, stride_bsn, stride_bsk,
                           stride_cm, BN_S, BK_S: tl.constexpr, A_FP8: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
                           WS: tl.constexpr):
    """:func:`_block_gemm_kernel` with its A / B tiles loaded by the tensor memory accelerator (host-built
    descriptors ``a_desc`` [M, K] block [BLOCK_M, BLOCK_K], ``b_desc`` [N, K] block [BLOCK_N, BLOCK_K]; edges read
    as zeros, so no masks and no wrapped rows); ``WS``: Triton's warp-specialized loop (a producer warp feeds the
    consumer warps). The same products in the same order, so the same bits."""
    pdl_enter(PDL)
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    as_ptrs = AS + (rm % M) * stride_asm
    bs_ptrs = BS + ((rn % N) // BN_S) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WS):
        acc = _scaled_step(acc, a_desc.load([m0, k0]), b_desc.load([n0, k0]), as_ptrs, bs_ptrs, k0 // BK_S,
                           stride_ask, stride_bsk, A_FP8)
    _store_tile(C, acc, rm, rn, M, N, stride_cm)


@triton.jit
def _scaled_step(acc, a, b, as_ptrs, bs_ptrs, kb, stride_ask, stride_bsk, A_FP8: tl.constexpr):
    """One k-step of the tiled GEMMs: the tile product of a [BLOCK_M, BLOCK_K] and b [BLOCK_N, BLOCK_K] scaled by
    its scale block ``kb`` (W8A8: activation scale x weight scale; W8A16: b widened, the weight scale) and added to
    the float32 accumulator."""
    b_s = tl.load(bs_ptrs + kb * stride_bsk)
    if A_FP8:
        a_s = tl.load(as_ptrs + kb * stride_ask)
        return acc + tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    return acc + tl.dot(a, tl.trans(b.to(a.dtype))) * b_s[None, :]


@triton.jit
def _store_tile(C, acc, rm, rn, M, N, stride_cm):
    """The accumulator rounded to C's dtype, stored where the rows / columns are in range."""
    tl.store(C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc.to(C.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program: programs ordered in groups of GROUP_M row tiles, so the B tiles of
    a group stay in L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_rows, (pid % in_group) // group_rows


@triton.jit
def _round_e4m3(q):
    """float32 q (|q| <= 448) rounded to nearest even on e4m3's grid, in float32: 3 mantissa bits, the grid of
    2^-6 (the smallest normal) below it. ``(q + c) - c`` with ``c = 1.5 * 2^(e + 20)`` (e: q's exponent, at least
    -6) rounds q to a multiple of 2^(e - 3) by IEEE addition. The cast to e4m3 after it is exact, so the bits do
    not depend on how the cast rounds (Triton's interpreter drops the carry into the next binade: 126.5 -> 64)."""
    bits = q.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    c = (((e + 20) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    return (q + c) - c


@triton.jit
def _quant_act_kernel(X, Q, QS, M, K, stride_xm, stride_qm, stride_qsm, BLOCK_M: tl.constexpr, G: tl.constexpr,
                      PDL: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Program (row block, group g): Q[rows, g G : (g + 1) G] = x / s in fp8 e4m3 and QS[rows, g] = s, with
    ``s = max(amax(|x|) / 448, 1e-12)`` over the group's (valid) inputs; both divisions IEEE-rounded
    (``tl.div_rn``: the bits of torch's), x / s clamped to +-448 and cast to e4m3 (nearest, ties to even).
    ``ROUND_FIRST`` (Triton's CPU interpreter, whose cast rounds a carry into the next binade wrong): the quotient
    is first rounded on e4m3's grid (:func:`_round_e4m3`), so the cast is exact; the GPU's cast rounds itself."""
    pdl_enter(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    rk = g * G + tl.arange(0, G)
    mask = (rm < M)[:, None] & (rk < K)[None, :]
    x = tl.load(X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    s = _row_scales(x)
    q = tl.minimum(tl.maximum(tl.div_rn(x, s[:, None]), -FP8_MAX), FP8_MAX)
    if ROUND_FIRST:
        q = _round_e4m3(q)
    tl.store(Q + rm.to(tl.int64)[:, None] * stride_qm + rk[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(QS + rm * stride_qsm + g, s, mask=rm < M)

