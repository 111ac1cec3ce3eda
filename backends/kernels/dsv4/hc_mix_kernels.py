"""Triton kernels of mHC (manifold-constrained hyper-connections) around each V4 block (launchers:
:mod:`backends.kernels.dsv4.hc_mix`; torch reference: :mod:`runtime.model.mhc`).

The torch code runs the 4 x 4 Sinkhorn loop as a few small kernels per round (about 120 launches per ``hc_pre``);
here one program per token keeps the n x n matrix in registers for every round. The kernels keep torch's float32
operation order: each sum over n adds its terms in index order (as torch's CPU reduction does), divisions are IEEE
(``div_rn``), and the launchers turn off FMA contraction so every product and sum rounds where torch's does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.pdl import pdl_enter


@triton.jit
def _col_sums(m, idx, N: tl.constexpr):
    """[N, N] -> [N]: the sum over rows (torch ``sum(dim=-2)``), rows added in order 0 .. N - 1."""
    acc = tl.sum(tl.where(idx[:, None] == 0, m, 0.0), axis=0)
    for j in tl.static_range(1, N):
        acc = acc + tl.sum(tl.where(idx[:, None] == j, m, 0.0), axis=0)
    return acc


@triton.jit
def _row_sums(m, idx, N: tl.constexpr):
    """[N, N] -> [N]: the sum over columns (torch ``sum(dim=-1)``), columns added in order 0 .. N - 1."""
    acc = tl.sum(tl.where(idx[None, :] == 0, m, 0.0), axis=1)
    for j in tl.static_range(1, N):
        acc = acc + tl.sum(tl.where(idx[None, :] == j, m, 0.0), axis=1)
    return acc


@triton.jit
def _hc_mix_kernel(MIXED, BASE, SCALE, S, POST, COMB, OUT, hidden, iters, eps, stride_m, stride_st, stride_sn,
                   stride_ot, N: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """One token: pre = sigmoid(pre_w * s0 + pre_b) + eps; post = 2 sigmoid(post_w * s1 + post_b); comb = row
    softmax(comb_w * s2 + comb_b) + eps, then Sinkhorn (a column normalisation, ``iters - 1`` rounds of row then
    column, each ``x / (sum + eps)``); OUT[t] = sum_j pre_j S[t, j] in float32, rounded to OUT's dtype."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N)
    ij = i[:, None] * N + i[None, :]
    row = MIXED + t * stride_m
    s0 = tl.load(SCALE).to(tl.float32)
    s1 = tl.load(SCALE + 1).to(tl.float32)
    s2 = tl.load(SCALE + 2).to(tl.float32)
    pre = tl.sigmoid(tl.load(row + i) * s0 + tl.load(BASE + i).to(tl.float32)) + eps
    post = 2.0 * tl.sigmoid(tl.load(row + N + i) * s1 + tl.load(BASE + N + i).to(tl.float32))
    logits = tl.load(row + 2 * N + ij) * s2 + tl.load(BASE + 2 * N + ij).to(tl.float32)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.math.div_rn(e, _row_sums(e, i, N)[:, None]) + eps
    comb = tl.math.div_rn(comb, _col_sums(comb, i, N)[None, :] + eps)
    for _ in range(iters - 1):
        comb = tl.math.div_rn(comb, _row_sums(comb, i, N)[:, None] + eps)
        comb = tl.math.div_rn(comb, _col_sums(comb, i, N)[None, :] + eps)
    tl.store(POST + t * N + i, post)
    tl.store(COMB + t * (N * N) + ij, comb)

    h = tl.arange(0, BLOCK_H)
    src = S + t * stride_st
    dst = OUT + t * stride_ot
    for h0 in range(0, hidden, BLOCK_H):
        cols = h0 + h
        m = cols < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(N):
            pj = tl.sum(tl.where(i == j, pre, 0.0), axis=0)
            acc = acc + pj * tl.load(src + j * stride_sn + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + cols, acc.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _hc_post_kernel(POST, COMB, BO, S, OUT, hidden, stride_bt, stride_st, stride_sn, stride_ot, stride_on,
                    N: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Program (t, block): OUT[t, i, cols] = post_i * BO[t, cols] + sum_j comb[j, i] * S[t, j, cols] with post and
    comb rounded to OUT's dtype DT first, the product rounded to DT, the sum over j in float32 rounded to DT, and
    the final add rounded to DT (torch's ``post.to(dt) * out + matmul(comb.to(dt).mT, streams)`` in DT)."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < hidden
    p = tl.load(POST + t * N + i).to(OUT.dtype.element_ty).to(tl.float32)
    bo = tl.load(BO + t * stride_bt + cols, mask=m, other=0.0).to(tl.float32)
    a = (p[:, None] * bo[None, :]).to(OUT.dtype.element_ty).to(tl.float32)
    src = S + t * stride_st
    acc = tl.zeros([N, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(N):
        # comb[t, j, :]: column j of comb^T
        c = tl.load(COMB + t * (N * N) + j * N + i).to(OUT.dtype.element_ty).to(tl.float32)
        x = tl.load(src + j * stride_sn + cols, mask=m, other=0.0).to(tl.float32)
        acc = acc + c[:, None] * x[None, :]
    y = a + acc.to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + t * stride_ot + i[:, None] * stride_on + cols[None, :], y.to(OUT.dtype.element_ty), mask=m[None, :])
