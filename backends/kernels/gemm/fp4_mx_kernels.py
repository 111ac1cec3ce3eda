"""Triton kernels for DeepSeek-V4's fp4 routed experts through Triton's microscaled product (``tl.dot_scaled``),
launchers in :mod:`backends.kernels.gemm.fp4_moe`.

V4's experts are the OCP MX fp4 format: e2m1 values packed two per byte (low nibble first, Triton's order too) with
one ue8m0 scale per 32 inputs. ``tl.dot_scaled`` takes them as stored: on Hopper (no fp4 MMA) Triton widens the
packed operand to bf16 in registers (its own e2m1 conversion), applies the scales and multiplies on the tensor cores
(bf16 activations, float32 accumulation); on Blackwell the same call is a native MX product. The widening is exact
(every e2m1 value times a power of two is a bf16 value within its range), so the products are those of the dequantized
weights up to float32 summation order, as :mod:`~backends.kernels.gemm.fp4_moe_kernels`' own widening.

In the decode kernels the weights are the product's left operand (``[rows of W, K / 2]`` bytes as stored,
``[rows, K / 32]`` scales) and the activations' transpose the right one: a decode tile has one token, and the
tensor-core tile's narrow side (16) is then the token, not the weight rows ("swap AB"). On an H200 they are 2-5x
slower than the CUDA-core kernels (``fp4_fma_kernels``) at 1-16 tokens: an option, not a default.

* :func:`_fp4_moe_up_mx_kernel` / :func:`_fp4_moe_down_mx_kernel`: few tokens, one (token, slot) pair per program
  as the CUDA-core kernels (the pair's token is column 0 of a 16-column tile).
* The grouped GEMM's microscaled form is ``fp4_moe_kernels._fp4_grouped_gemm_kernel`` with ``MX`` (the activations
  the left operand: prefill tiles of 64 / 128 rows; with the weights left at 16 / 32-row tiles it measured slower
  than our widening, so that form is not kept).

Only bf16 activations (``dot_scaled`` widens to bf16: fp16 activations take the other kernels). Scales as ue8m0 bytes
or float32 powers of two (their exponent bytes taken in registers, exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.gemm.fp4_moe_kernels import GROUP, _down_program, _fold_slot, _mx_rows, _store_act, _up_pair
from backends.kernels.pdl import pdl_enter


@triton.jit
def _token_col(row_ptr, k0, width, BLOCK_K: tl.constexpr):
    """[BLOCK_K, 16] bf16: a token's inputs k0 .. k0 + BLOCK_K (masked to ``width``) as column 0, zeros beside."""
    rk = k0 + tl.arange(0, BLOCK_K)
    col0 = (tl.arange(0, 16) == 0)[None, :]
    return tl.where(col0, tl.load(row_ptr + rk, mask=rk < width, other=0.0)[:, None], 0.0).to(tl.bfloat16)


@triton.jit
def _fp4_moe_up_mx_kernel(X, IDS, GU, GUS, H, K, inter, n_local, limit, stride_x, stride_ge, stride_gn, stride_gse,
                          stride_gsn, stride_h, TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                          ACT: tl.constexpr, PDL: tl.constexpr, GUS_UE8M0: tl.constexpr):
    """``fp4_moe_kernels._fp4_moe_up_kernel``'s contract (program (p, i-block), H[p] = act(gate, up) rounded as
    there) with each step a microscaled product: BLOCK_I gate and BLOCK_I up rows x BLOCK_K inputs (left), the
    pair's token as column 0 (right)."""
    pdl_enter(PDL)
    n_bytes = K // 2
    n_groups = tl.cdiv(K, GROUP)
    p, e, ri, live, x_row, _, _, _, _ = _up_pair(X, IDS, GU, GUS, inter, n_local, stride_x, stride_ge, stride_gn,
                                                 stride_gse, stride_gsn, TOPK, BLOCK_I)
    gw = GU + e * stride_ge
    gs = GUS + e * stride_gse
    ri64 = ri.to(tl.int64)
    acc_g = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = _token_col(x_row, k0, K, BLOCK_K)
        wg, sg = _mx_rows(gw, gs, ri64, live, k0, n_bytes, n_groups, stride_gn, stride_gsn, BLOCK_K, GUS_UE8M0)
        acc_g = tl.dot_scaled(wg, sg, "e2m1", xt, None, "bf16", acc_g)
        wu, su = _mx_rows(gw, gs, ri64 + inter, live, k0, n_bytes, n_groups, stride_gn, stride_gsn, BLOCK_K,
                          GUS_UE8M0)
        acc_u = tl.dot_scaled(wu, su, "e2m1", xt, None, "bf16", acc_u)
    _store_act(H + p * stride_h, ri, inter, tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), limit, ACT)  # cols 1..15: 0


@triton.jit
def _fp4_moe_down_mx_kernel(H, IDS, WTS, DN, DNS, OUT, D, inter, n_local, stride_h, stride_de, stride_dd, stride_dse,
                            stride_dsd, stride_o, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_I: tl.constexpr, PDL: tl.constexpr, DNS_UE8M0: tl.constexpr):
    """``fp4_moe_kernels._fp4_moe_down_kernel``'s contract (program (t, d-block), slots in order, each slot's product
    rounded to H's dtype and folded in with its weight) with each (slot, chunk) step a microscaled product."""
    pdl_enter(PDL)
    DT: tl.constexpr = H.dtype.element_ty
    t, rd, rd64, dmask, slots, ids, wts = _down_program(IDS, WTS, D, TOPK, TOPK_P2, BLOCK_D)
    n_chunks = tl.cdiv(inter, BLOCK_I)
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D, 16], dtype=tl.float32)
    for it in range(0, TOPK * n_chunks):
        j = it // n_chunks
        c = it % n_chunks
        p = t * TOPK + j
        e = tl.sum(tl.where(slots == j, ids, 0))
        width = tl.where(e < n_local, inter, 0)  # other ranks' experts: nothing
        ht = _token_col(H + p * stride_h, c * BLOCK_I, width, BLOCK_I)
        w, s = _mx_rows(DN + e * stride_de, DNS + e * stride_dse, rd64, dmask, c * BLOCK_I, width // 2,
                        tl.cdiv(width, GROUP), stride_dd, stride_dsd, BLOCK_I, DNS_UE8M0)
        acc = tl.dot_scaled(w, s, "e2m1", ht, None, "bf16", acc)
        if c == n_chunks - 1:
            out, acc = _fold_slot(out, acc, slots, j, wts, DT)
    tl.store(OUT + t * stride_o + rd, out.to(OUT.dtype.element_ty), mask=dmask)
