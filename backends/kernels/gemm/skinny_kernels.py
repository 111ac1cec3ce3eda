"""Triton kernels for matrix products with few rows (decode at small batch), launchers in
:mod:`backends.kernels.gemm.skinny`.

At one to sixteen rows a linear layer only streams its weight matrix. These kernels give each program a block of
output columns (weight rows) and stream the whole reduction dim, so every weight byte is read once. On an H100 at
DeepSeek-V3's TP8 shapes, timed in CUDA graphs over more weight bytes than L2 holds (``python -m bench.gemv_bench``),
they read the matrices at 34% (q_b, 9 MB) to 75% (dense gate_up, 66 MB) of copy bandwidth and the 231 MB LM head at
85%, about as fast as cuBLAS; what they gain is in the MoE, where routing, the routed experts and the shared
expert take two kernels instead of a sort, two grouped GEMMs and a combine.

Row independence: a row's result never depends on how many rows the call has (bf16 / fp16 go through one
16-row tensor-core tile, padded rows are zeros; float32 runs one program per row), so a CUDA graph captured
for a padded batch gives the eager run's bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.pdl import pdl_enter


@triton.jit
def _linear_dot_kernel(X, W, Y, NW, M, N, K, stride_xm, stride_wn, stride_ym, eps,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """Y[:M, n-block] = X[:M] @ W[n-block].T for M <= 16: acc[BLOCK_N, 16] += W tile @ X tile.T, float32.

    NORM: X is first RMS-normed per row with weight NW [K] and rounded as the norm kernel rounds
    (``decoder_kernels._rms_norm_kernel``: x * rstd rounded, times NW, rounded), so the product equals
    ``linear(rms_norm(X))``; the row's sum of squares takes one pass over X (a few KB in L2) before the weight
    stream starts."""
    pdl_enter(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    nmask = rn < N
    mmask = rm < M
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = X + rm[:, None] * stride_xm
    DT: tl.constexpr = Y.dtype.element_ty
    if NORM:
        ss = tl.zeros([16], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            xf = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if NORM:
            g = tl.load(NW + rk, mask=kmask, other=0.0).to(tl.float32)
            x = ((x.to(tl.float32) * rstd[:, None]).to(DT).to(tl.float32) * g[None, :]).to(DT)
        acc = tl.dot(w, tl.trans(x), acc)
    out = tl.trans(acc).to(DT)
    tl.store(Y + rm[:, None] * stride_ym + rn[None, :], out, mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _head_dot_kernel(X, W, Y, M, N, K, stride_xm, stride_xh, stride_wh, stride_wk, stride_ym, stride_yh,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Program (column block, head): :func:`head_dot_tile`."""
    pdl_enter(PDL)
    head_dot_tile(X, W, Y, M, N, K, tl.program_id(0), tl.program_id(1).to(tl.int64), stride_xm, stride_xh, stride_wh,
                  stride_wk, stride_ym, stride_yh, BLOCK_N, BLOCK_K)


@triton.jit
def head_dot_tile(X, W, Y, M, N, K, nb, h, stride_xm, stride_xh, stride_wh, stride_wk, stride_ym, stride_yh,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Head h, column block nb: Y[:M, h, n-block] = X[:M, h] @ W[h][:, n-block] for M <= 16, W [H, K, N] with
    contiguous rows of N (the absorbed MLA's w_uk and w_uv as stored): acc[16, BLOCK_N] += X tile @ W tile,
    float32, padded rows zero."""
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)
    nmask = rn < N
    mmask = rm < M
    x_rows = X + h * stride_xh + rm[:, None] * stride_xm
    w_head = W + h * stride_wh + rn[None, :]
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_head + rk.to(tl.int64)[:, None] * stride_wk, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
    tl.store(Y + h * stride_yh + rm[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _linear_rows_kernel(X, W, Y, N, K, stride_xm, stride_wn, stride_ym, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One row per program (axis 1), float32 products: Y[m, n-block] = sum_k float(W[n, k]) * float(X[m, k])."""
    pdl_enter(PDL)
    m = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + m * stride_xm + rk, mask=kmask, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    tl.store(Y + m * stride_ym + rn, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=nmask)


@triton.jit
def expert_pair(p, ri, IDS, GU, SGU, n_pairs, inter, s_inter, n_local, stride_ge, stride_gn, stride_sn,
                TOPK: tl.constexpr):
    """Pair ``p`` of the few-token expert kernels and its gate / up rows ``ri``: p < n_pairs is (token p // TOPK,
    expert IDS[p]) over GU[e] [2 I, K]; p >= n_pairs is token p - n_pairs over the shared experts SGU [2 I_s, K].
    Returns (routed, e, token, width, live rows: ``ri`` inside the width and the expert this rank's, the gate rows'
    pointers [BLOCK_I, 1], the up rows' pointers)."""
    routed = p < n_pairs
    e = tl.load(IDS + p, mask=routed, other=0).to(tl.int64)
    t = tl.where(routed, p // TOPK, p - n_pairs)
    width = tl.where(routed, inter, s_inter)
    stride = tl.where(routed, stride_gn, stride_sn)
    live = ri < tl.where(e < n_local, width, 0)  # a shared row loaded e = 0
    base = tl.where(routed, GU + e * stride_ge, SGU)
    g_rows = base + ri.to(tl.int64)[:, None] * stride
    u_rows = base + (ri + width).to(tl.int64)[:, None] * stride
    return routed, e, t, width, live, g_rows, u_rows


@triton.jit
def store_silu_mul(ptrs, g, u, mask):
    """The up kernels' epilogue: gate and up sums (float32) rounded to the output's dtype, SiLU(gate) rounded, the
    product rounded and stored (the rounding points of the grouped GEMM + SiLU * up kernels)."""
    DT: tl.constexpr = ptrs.dtype.element_ty
    g = g.to(DT).to(tl.float32)
    u = u.to(DT).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    tl.store(ptrs, (s * u).to(DT), mask=mask)


@triton.jit
def token_slots(IDS, WTS, t, TOPK: tl.constexpr, TOPK_P2: tl.constexpr):
    """The down kernels' token ``t``: (slots [TOPK_P2], its expert ids int64, its routing weights), loaded before
    the slot loop so no weight address waits on a load inside it; padding slots read id 0 and weight 0."""
    slots = tl.arange(0, TOPK_P2)
    ids = tl.load(IDS + t * TOPK + slots, mask=slots < TOPK, other=0).to(tl.int64)
    wts = tl.load(WTS + t * TOPK + slots, mask=slots < TOPK, other=0.0)
    return slots, ids, wts


@triton.jit
def fold_slot(y, routed, weight, out, shared):
    """A slot's product ``y`` (float32, already rounded to the output's dtype) folded into the down kernels' sums:
    a routed expert's adds ``weight * y`` to ``out``; the shared experts' becomes ``shared``. Returns (out, shared)."""
    if routed:
        out += y * weight
    else:
        shared = y
    return out, shared


@triton.jit
def store_down_sum(ptrs, out, shared, HAS_SHARED: tl.constexpr, mask):
    """The down kernels' epilogue: the routed sum rounded, plus the shared experts' product (the sum rounded)."""
    DT: tl.constexpr = ptrs.dtype.element_ty
    res = out.to(DT)
    if HAS_SHARED:
        res = (res.to(tl.float32) + shared).to(DT)
    tl.store(ptrs, res, mask=mask)


@triton.jit
def _moe_up_kernel(X, IDS, GU, SGU, H, n_pairs, K, inter, s_inter, n_local, stride_x, stride_ge, stride_gn,
                   stride_sn, stride_h, TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT: tl.constexpr, PDL: tl.constexpr):
    """Program (p, i-block): pair p < n_pairs is (token p // TOPK, expert IDS[p]) over GU[e] [2 I, K]; p >= n_pairs
    is token p - n_pairs over the shared experts SGU [2 I_s, K]. H[p, i] = silu(gate) * up, each GEMM output
    rounded to H's dtype, silu rounded, the product rounded (as the grouped GEMM + SiLU * up kernels).
    Pairs of other ranks' experts (IDS[p] >= n_local) return at once (their H rows stay unwritten: the down
    kernel loads nothing of their slots)."""
    pdl_enter(PDL)
    p = tl.program_id(0)
    ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    routed, e, t, width, live, g_rows, u_rows = expert_pair(p, ri, IDS, GU, SGU, n_pairs, inter, s_inter, n_local,
                                                            stride_ge, stride_gn, stride_sn, TOPK)
    if e >= n_local:  # another rank's expert (the shared rows load e = 0)
        return
    if DOT:  # 16-bit: the x row as row 0 of a 16-row tensor-core tile (the weight loads feed a dot: pipelined)
        r16 = tl.arange(0, 16)
        acc_g = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            x = tl.load(X + t * stride_x + r16[:, None] * 0 + rk[None, :], mask=(r16 < 1)[:, None] & kmask[None, :],
                        other=0.0)
            m2 = live[:, None] & kmask[None, :]
            acc_g = tl.dot(tl.load(g_rows + rk[None, :], mask=m2, other=0.0), tl.trans(x), acc_g)
            acc_u = tl.dot(tl.load(u_rows + rk[None, :], mask=m2, other=0.0), tl.trans(x), acc_u)
        g = tl.sum(acc_g, axis=1)  # columns 1..15 are zeros
        u = tl.sum(acc_u, axis=1)
    else:
        acc_g2 = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
        acc_u2 = tl.zeros([BLOCK_I, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            x = tl.load(X + t * stride_x + rk, mask=kmask, other=0.0).to(tl.float32)
            m2 = live[:, None] & kmask[None, :]
            acc_g2 += tl.load(g_rows + rk[None, :], mask=m2, other=0.0).to(tl.float32) * x[None, :]
            acc_u2 += tl.load(u_rows + rk[None, :], mask=m2, other=0.0).to(tl.float32) * x[None, :]
        g = tl.sum(acc_g2, axis=1)
        u = tl.sum(acc_u2, axis=1)
    store_silu_mul(H + p * stride_h + ri, g, u, ri < width)


@triton.jit
def _moe_down_kernel(H, IDS, WTS, DN, SDN, OUT, n_pairs, D, inter, s_inter, n_local, stride_h, stride_de,
                     stride_dd, stride_sd, stride_o, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                     HAS_SHARED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr, DOT: tl.constexpr,
                     SKIP: tl.constexpr, PDL: tl.constexpr):
    """Program (t, d-block): out[t] = round(sum_j WTS[t, j] * round(DN[e_j] @ H[t TOPK + j])) (float32, j in
    order; other ranks' experts add 0: nothing of theirs is loaded) (+ round(SDN @ H[n_pairs + t]), the sum
    rounded), as the grouped GEMM and the combine kernel.

    One loop over (slot, chunk of the hidden dim) for all the slots (the routed ones, then the shared row), so the
    weight loads stay pipelined across experts (a loop per expert drained the pipeline at every expert); the
    token's expert ids and weights are loaded before the loop (TOPK_P2: TOPK rounded up to a power of two), so no
    weight address waits on a load inside it. At a slot's last chunk its product is rounded and folded in.
    ``SKIP`` (expert parallelism: ids may name other ranks' experts): their steps are branched over. Without it
    they run on masked loads (width 0), which keeps the loads pipelined: on an H200 the branch took moe=tp at one
    token from 36.8 to 46.9 µs, and saved moe=ep 20-35% (``python -m bench.fp8_moe_bench --tokens 1 4 16``)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = rd < D
    SLOTS: tl.constexpr = TOPK + HAS_SHARED
    n_chunks = tl.cdiv(tl.maximum(inter, s_inter), BLOCK_I)
    slots, ids, wts = token_slots(IDS, WTS, t, TOPK, TOPK_P2)
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    shared = tl.zeros([BLOCK_D], dtype=tl.float32)
    if DOT:  # the h row as row 0 of a 16-row tensor-core tile
        acc = tl.zeros([BLOCK_D, 16], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_D, BLOCK_I], dtype=tl.float32)
    for it in range(0, SLOTS * n_chunks):
        e = tl.sum(tl.where(slots == it // n_chunks, ids, 0))  # the shared slot (j == TOPK) reads 0
        if SKIP:
            if e < n_local:
                acc, out, shared = _down_step(it, n_chunks, e, H, DN, SDN, t, slots, wts, n_pairs, inter, s_inter,
                                              n_local, rd, dmask, stride_h, stride_de, stride_dd, stride_sd, acc,
                                              out, shared, OUT.dtype.element_ty, TOPK, BLOCK_I, DOT)
        else:
            acc, out, shared = _down_step(it, n_chunks, e, H, DN, SDN, t, slots, wts, n_pairs, inter, s_inter,
                                          n_local, rd, dmask, stride_h, stride_de, stride_dd, stride_sd, acc, out,
                                          shared, OUT.dtype.element_ty, TOPK, BLOCK_I, DOT)
    store_down_sum(OUT + t * stride_o + rd, out, shared, HAS_SHARED, dmask)


@triton.jit
def _down_step(it, n_chunks, e, H, DN, SDN, t, slots, wts, n_pairs, inter, s_inter, n_local, rd, dmask, stride_h,
               stride_de, stride_dd, stride_sd, acc, out, shared, DT: tl.constexpr, TOPK: tl.constexpr,
               BLOCK_I: tl.constexpr, DOT: tl.constexpr):
    """One (slot, chunk) step of :func:`_moe_down_kernel`: the chunk's product into ``acc``; at the slot's last
    chunk its product rounded to DT and folded into (out, shared). Other ranks' experts: width 0, nothing loaded
    (their H rows are unwritten), the slot adds 0."""
    j = it // n_chunks
    ri = (it % n_chunks) * BLOCK_I + tl.arange(0, BLOCK_I)
    routed = j < TOPK
    p = tl.where(routed, t * TOPK + j, n_pairs + t)
    width = tl.where(routed, tl.where(e < n_local, inter, 0), s_inter)
    rows = tl.where(routed, DN + e * stride_de + rd.to(tl.int64)[:, None] * stride_dd,
                    SDN + rd.to(tl.int64)[:, None] * stride_sd)
    imask = ri < width
    w = tl.load(rows + ri[None, :], mask=dmask[:, None] & imask[None, :], other=0.0)
    if DOT:
        r16 = tl.arange(0, 16)
        h = tl.load(H + p * stride_h + r16[:, None] * 0 + ri[None, :], mask=(r16 < 1)[:, None] & imask[None, :],
                    other=0.0)
        acc = tl.dot(w, tl.trans(h), acc)
    else:
        h = tl.load(H + p * stride_h + ri, mask=imask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * h[None, :]
    if (it + 1) % n_chunks == 0:  # the slot's last chunk: round its product, fold it in, start the next
        y = tl.sum(acc, axis=1).to(DT).to(tl.float32)  # DOT: columns 1..15 are zeros
        out, shared = fold_slot(y, routed, tl.sum(tl.where(slots == j, wts, 0.0)), out, shared)
        acc = tl.zeros_like(acc)
    return acc, out, shared
