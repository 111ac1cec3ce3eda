"""Triton kernels for DeepSeek-V3's block-fp8 MoE experts, launchers in :mod:`backends.kernels.fp8_moe`.

Weights are float8 e4m3 with one float32 scale per 128 x 128 block (``dequantized = fp8 * scale``). Two paths:

* **Few tokens** (decode, T <= 16): :func:`_fp8_moe_up_kernel` and :func:`_fp8_moe_down_kernel`, the fp8
  counterparts of ``skinny_kernels._moe_up_kernel`` / ``_moe_down_kernel``: every (token, slot) pair streams its
  expert's fp8 rows once (half the bytes of bf16), widens them in registers to the activation dtype (exact: every
  e4m3 value is a bf16 and an fp16 value) and multiplies on the tensor cores with the token's row as row 0 of a
  16-row tile. Each 128-wide reduction block's partial product (float32) is multiplied by its block scale before
  it is added, so the result is the product with the dequantized weights up to float32 summation order. The
  rounding points are skinny's (each GEMM output, SiLU, the product, the weighted sum, the shared add).
  :func:`_fp8_moe_up_fma_kernel` / :func:`_fp8_moe_down_fma_kernel` do the same on the CUDA cores (float32
  products of the widened weights: a pair is one token, a matrix-vector product).
* **Many tokens** (prefill): :func:`_fp8_grouped_gemm_kernel`, a W8A8 grouped GEMM over rows sorted by expert,
  activations quantized per token and 128 columns (:func:`_quantize_groups_kernel`, amax / 448 to e4m3), fp8 x fp8
  ``tl.dot`` with float32 accumulation, each k-block's product times (activation scale x weight scale). The expert
  of each row tile is found on the device from the offsets (no host sync): the grid covers the most tiles any
  routing can need and the surplus programs return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.gemm.skinny_kernels import expert_pair, fold_slot, store_down_sum, store_silu_mul, token_slots
from backends.kernels.pdl import pdl_enter

#: rows and columns of one scale block (DeepSeek-V3's fp8 checkpoints)
QBLOCK: tl.constexpr = tl.constexpr(128)
#: e4m3's largest finite value
E4M3_MAX: tl.constexpr = tl.constexpr(448.0)


@triton.jit
def _pair_scale_rows(routed, e, i0, width, GUS, SGUS, stride_gse, stride_gsn, stride_ssn):
    """Pointers to the scale rows of a program's gate rows (from ``i0``) and of its up rows (``i0 + width``): the
    routed expert's GUS[e] or the shared experts' SGUS (BLOCK_I divides 128, so each lies in one scale row)."""
    sstride = tl.where(routed, stride_gsn, stride_ssn)
    sbase = tl.where(routed, GUS + e * stride_gse, SGUS)
    return sbase + (i0 // QBLOCK) * sstride, sbase + ((i0 + width) // QBLOCK) * sstride


@triton.jit
def _fp8_moe_up_kernel(X, IDS, GU, GUS, SGU, SGUS, H, n_pairs, K, inter, s_inter, n_local, stride_x, stride_ge,
                       stride_gn, stride_gse, stride_gsn, stride_sn, stride_ssn, stride_h, TOPK: tl.constexpr,
                       BLOCK_I: tl.constexpr, SUB_K: tl.constexpr, PDL: tl.constexpr):
    """Program (p, i-block): pair p < n_pairs is (token p // TOPK, expert IDS[p]) over GU[e] [2 I, K] fp8 with
    scales GUS[e] [2 I / 128, cdiv(K, 128)]; p >= n_pairs is token p - n_pairs over the shared experts SGU
    [2 I_s, K] / SGUS. H[p, i] = silu(gate) * up, each GEMM output rounded to H's dtype, SiLU rounded, the product
    rounded. Other ranks' experts (IDS[p] >= n_local) compute nothing. Each loop step reads SUB_K 128-wide blocks
    of BLOCK_I gate and BLOCK_I up rows (BLOCK_I divides 128 and I is a multiple of 128, so the program's gate rows
    lie in one scale row and its up rows in another): the block's one gate scale and one up scale multiply the
    activation row, ``(x * s).to(dtype)``, and the products chain into the accumulators."""
    pdl_enter(PDL)
    p = tl.program_id(0)
    ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    DT: tl.constexpr = H.dtype.element_ty
    routed, e, t, width, live, g_rows, u_rows = expert_pair(p, ri, IDS, GU, SGU, n_pairs, inter, s_inter, n_local,
                                                            stride_ge, stride_gn, stride_sn, TOPK)
    i0 = tl.program_id(1) * BLOCK_I
    g_scale, u_scale = _pair_scale_rows(routed, e, i0, width, GUS, SGUS, stride_gse, stride_gsn, stride_ssn)
    on = (e < n_local) & (i0 < width)
    r16 = tl.arange(0, 16)
    x_row = X + t * stride_x + r16[:, None] * 0
    acc_g = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    for k0 in range(0, K, SUB_K * QBLOCK):
        for sub in tl.static_range(SUB_K):
            kb = k0 // QBLOCK + sub
            rk = kb * QBLOCK + tl.arange(0, QBLOCK)
            kmask = rk < K
            x = tl.load(x_row + rk[None, :], mask=(r16 < 1)[:, None] & kmask[None, :], other=0.0)
            m2 = live[:, None] & kmask[None, :]
            wg = tl.load(g_rows + rk[None, :], mask=m2, other=0.0).to(DT)
            wu = tl.load(u_rows + rk[None, :], mask=m2, other=0.0).to(DT)
            son = on & (kb * QBLOCK < K)
            xf = x.to(tl.float32)
            sg = tl.load(g_scale + kb, mask=son, other=0.0)
            su = tl.load(u_scale + kb, mask=son, other=0.0)
            acc_g = tl.dot(wg, tl.trans((xf * sg).to(DT)), acc_g)
            acc_u = tl.dot(wu, tl.trans((xf * su).to(DT)), acc_u)
    # columns 1..15 of the accumulators are zeros
    store_silu_mul(H + p * stride_h + ri, tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), ri < width)


@triton.jit
def _fp8_moe_down_kernel(H, IDS, WTS, DN, DNS, SDN, SDNS, OUT, n_pairs, D, inter, s_inter, n_local, stride_h,
                         stride_de, stride_dd, stride_dse, stride_dsd, stride_sd, stride_ssd, stride_o,
                         TOPK: tl.constexpr, TOPK_P2: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (t, d-block): out[t] = round(sum_j WTS[t, j] * round(DN[e_j] @ H[t TOPK + j])) (float32, j in
    order; other ranks' experts add 0) (+ round(SDN @ H[n_pairs + t]), the sum rounded). DN [E, D, I] fp8 with
    scales DNS [E, cdiv(D, 128), I / 128]; SDN [D, I_s] / SDNS [cdiv(D, 128), I_s / 128].

    One loop over (slot, 128-wide chunk of the hidden dim), the shared slot last, so the weight loads stay
    pipelined across experts (as ``skinny_kernels._moe_down_kernel``); a chunk is one scale column and BLOCK_D
    (dividing 128) rows lie in one scale row, so the chunk's one scale multiplies the hidden row,
    ``(h * s).to(dtype)``, and the products chain into one accumulator per slot; at a slot's last chunk the slot's
    product is rounded and folded in."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = rd < D
    DT: tl.constexpr = OUT.dtype.element_ty
    SLOTS: tl.constexpr = TOPK + HAS_SHARED
    n_chunks = tl.cdiv(tl.maximum(inter, s_inter), QBLOCK)
    r16 = tl.arange(0, 16)
    slots, ids, wts = token_slots(IDS, WTS, t, TOPK, TOPK_P2)
    rd64 = rd.to(tl.int64)
    srow = (tl.program_id(1) * BLOCK_D) // QBLOCK  # the program's rows' scale row
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    shared = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D, 16], dtype=tl.float32)
    for it in range(0, SLOTS * n_chunks):
        j = it // n_chunks
        c = it % n_chunks
        ri = c * QBLOCK + tl.arange(0, QBLOCK)
        routed = j < TOPK
        p = tl.where(routed, t * TOPK + j, n_pairs + t)
        e = tl.sum(tl.where(slots == j, ids, 0))  # the shared slot (j == TOPK) reads 0
        width = tl.where(routed, tl.where(e < n_local, inter, 0), s_inter)  # other ranks' experts: nothing
        rows = tl.where(routed, DN + e * stride_de + rd64[:, None] * stride_dd, SDN + rd64[:, None] * stride_sd)
        scales = tl.where(routed, DNS + e * stride_dse + srow * stride_dsd, SDNS + srow * stride_ssd)
        imask = ri < width
        w = tl.load(rows + ri[None, :], mask=dmask[:, None] & imask[None, :], other=0.0).to(DT)
        sc = tl.load(scales + c, mask=c * QBLOCK < width, other=0.0)
        h = tl.load(H + p * stride_h + r16[:, None] * 0 + ri[None, :], mask=(r16 < 1)[:, None] & imask[None, :],
                    other=0.0)
        acc = tl.dot(w, tl.trans((h.to(tl.float32) * sc).to(DT)), acc)
        if c == n_chunks - 1:  # the slot's last chunk: round its product, fold it in, start the next
            y = tl.sum(acc, axis=1).to(DT).to(tl.float32)  # columns 1..15 are zeros
            out, shared = fold_slot(y, routed, tl.sum(tl.where(slots == j, wts, 0.0)), out, shared)
            acc = tl.zeros_like(acc)
    store_down_sum(OUT + t * stride_o + rd, out, shared, HAS_SHARED, dmask)


@triton.jit
def _fp8_moe_up_fma_kernel(X, IDS, GU, GUS, SGU, SGUS, H, n_pairs, K, inter, s_inter, n_local, stride_x, stride_ge,
                           stride_gn, stride_gse, stride_gsn, stride_sn, stride_ssn, stride_h, TOPK: tl.constexpr,
                           BLOCK_I: tl.constexpr, SUB_K: tl.constexpr, PDL: tl.constexpr):
    """:func:`_fp8_moe_up_kernel` on the CUDA cores: a pair is one token, so each step is a matrix-vector product
    (2 flops per weight byte), and the fp8 tiles need no tensor-core operand layout. Each step reads SUB_K
    128-wide blocks of BLOCK_I gate and BLOCK_I up rows (16-byte vector loads), widens them to float32, multiplies
    by the token's row times each input's block scale (float32, not rounded) and adds the products into float32
    accumulators in the load's own layout (no shuffle or layout change in the loop), summed over K once at the
    end; the rounding points after the sums are the tensor-core kernel's. Other ranks' pairs return at once (their
    rows of H are never read: the down kernels skip those slots)."""
    pdl_enter(PDL)
    p = tl.program_id(0)
    ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    routed, e, t, width, live, g_rows, u_rows = expert_pair(p, ri, IDS, GU, SGU, n_pairs, inter, s_inter, n_local,
                                                            stride_ge, stride_gn, stride_sn, TOPK)
    if e >= n_local:  # another rank's expert (the shared rows load e = 0)
        return
    i0 = tl.program_id(1) * BLOCK_I
    g_scale, u_scale = _pair_scale_rows(routed, e, i0, width, GUS, SGUS, stride_gse, stride_gsn, stride_ssn)
    acc_g = tl.zeros([BLOCK_I, SUB_K * QBLOCK], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, SUB_K * QBLOCK], dtype=tl.float32)
    for k0 in range(0, K, SUB_K * QBLOCK):
        rk = k0 + tl.arange(0, SUB_K * QBLOCK)
        kmask = rk < K
        m2 = live[:, None] & kmask[None, :]
        wg = tl.load(g_rows + rk[None, :], mask=m2, other=0.0).to(tl.float32)
        wu = tl.load(u_rows + rk[None, :], mask=m2, other=0.0).to(tl.float32)
        x = tl.load(X + t * stride_x + rk, mask=kmask, other=0.0).to(tl.float32)
        son = kmask & (rk * 0 + e < n_local) & (rk * 0 + i0 < width)
        sg = tl.load(g_scale + rk // QBLOCK, mask=son, other=0.0)
        su = tl.load(u_scale + rk // QBLOCK, mask=son, other=0.0)
        acc_g += wg * (x * sg)[None, :]
        acc_u += wu * (x * su)[None, :]
    acc_g = tl.sum(acc_g, axis=1)
    acc_u = tl.sum(acc_u, axis=1)
    store_silu_mul(H + p * stride_h + ri, acc_g, acc_u, ri < width)


@triton.jit
def _down_fma_slot(j, routed, c, H, DN, DNS, SDN, SDNS, t, slots, ids, n_pairs, inter, s_inter, n_local, rd64, srow,
                   dmask, stride_h, stride_de, stride_dd, stride_dse, stride_dsd, stride_sd, stride_ssd,
                   TOPK: tl.constexpr, CH: tl.constexpr):
    """Slot ``j``'s (``routed``: one of the token's TOPK experts, else the shared experts) product over chunk ``c``
    of the intermediate dim in :func:`_fp8_moe_down_fma_kernel`: [BLOCK_D] float32 row sums of the widened fp8
    tile times the pair's hidden row times each column's block scale."""
    ri = c * CH + tl.arange(0, CH)
    p = tl.where(routed, t * TOPK + j, n_pairs + t)
    e = tl.sum(tl.where(slots == j, ids, 0))
    width = tl.where(routed, tl.where(e < n_local, inter, 0), s_inter)
    rows = tl.where(routed, DN + e * stride_de + rd64[:, None] * stride_dd, SDN + rd64[:, None] * stride_sd)
    scales = tl.where(routed, DNS + e * stride_dse + srow * stride_dsd, SDNS + srow * stride_ssd)
    imask = ri < width
    w = tl.load(rows + ri[None, :], mask=dmask[:, None] & imask[None, :], other=0.0).to(tl.float32)
    sc = tl.load(scales + ri // QBLOCK, mask=imask, other=0.0)
    h = tl.load(H + p * stride_h + ri, mask=imask, other=0.0).to(tl.float32)
    return tl.sum(w * (h * sc)[None, :], axis=1)


@triton.jit
def _fp8_moe_down_fma_kernel(H, IDS, WTS, DN, DNS, SDN, SDNS, OUT, n_pairs, D, inter, s_inter, n_local, stride_h,
                             stride_de, stride_dd, stride_dse, stride_dsd, stride_sd, stride_ssd, stride_o,
                             TOPK: tl.constexpr, TOPK_P2: tl.constexpr, HAS_SHARED: tl.constexpr,
                             BLOCK_D: tl.constexpr, SUB_I: tl.constexpr, ONE_CHUNK: tl.constexpr,
                             PDL: tl.constexpr):
    """:func:`_fp8_moe_down_kernel` on the CUDA cores: one loop over (slot, chunk of SUB_I 128-wide blocks of the
    intermediate dim), the shared slot last; each step's [BLOCK_D, SUB_I 128] fp8 tile widened to float32 times
    the pair's hidden row times each column's block scale (float32), row sums added into the slot's accumulator;
    at the slot's last chunk its product is rounded and folded in as the tensor-core kernel does. ONE_CHUNK (one
    chunk holds every slot's whole intermediate row, the TP slices): the slots unrolled, the same arithmetic in
    the same order (the whole expert call 4-6% faster on an H200; offline for sm_90a the loop spilled, this does
    not). In the loop other ranks' slots (moe=ep) are skipped: they add nothing."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = rd < D
    DT: tl.constexpr = OUT.dtype.element_ty
    SLOTS: tl.constexpr = TOPK + HAS_SHARED
    CH: tl.constexpr = SUB_I * QBLOCK
    slots, ids, wts = token_slots(IDS, WTS, t, TOPK, TOPK_P2)
    rd64 = rd.to(tl.int64)
    srow = (tl.program_id(1) * BLOCK_D) // QBLOCK
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    shared = tl.zeros([BLOCK_D], dtype=tl.float32)
    if ONE_CHUNK:
        for j in tl.static_range(SLOTS):
            y = _down_fma_slot(j, j < TOPK, 0, H, DN, DNS, SDN, SDNS, t, slots, ids, n_pairs, inter, s_inter,
                               n_local, rd64, srow, dmask, stride_h, stride_de, stride_dd, stride_dse, stride_dsd,
                               stride_sd, stride_ssd, TOPK, CH)
            out, shared = fold_slot(y.to(DT).to(tl.float32), j < TOPK, tl.sum(tl.where(slots == j, wts, 0.0)),
                                    out, shared)
    else:
        n_chunks = tl.cdiv(tl.maximum(inter, s_inter), CH)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for it in range(0, SLOTS * n_chunks):
            j = it // n_chunks
            c = it % n_chunks
            routed = j < TOPK
            if (j >= TOPK) | (tl.sum(tl.where(slots == j, ids, 0)) < n_local):  # other ranks' slots: skipped
                acc += _down_fma_slot(j, routed, c, H, DN, DNS, SDN, SDNS, t, slots, ids, n_pairs, inter, s_inter,
                                      n_local, rd64, srow, dmask, stride_h, stride_de, stride_dd, stride_dse,
                                      stride_dsd, stride_sd, stride_ssd, TOPK, CH)
                if c == n_chunks - 1:
                    y = acc.to(DT).to(tl.float32)
                    out, shared = fold_slot(y, routed, tl.sum(tl.where(slots == j, wts, 0.0)), out, shared)
                    acc = tl.zeros_like(acc)
    store_down_sum(OUT + t * stride_o + rd, out, shared, HAS_SHARED, dmask)


@triton.jit
def _quantize_groups_kernel(X, Q, S, LIMIT, M, K, stride_x, stride_q, stride_s, eps, BLOCK_M: tl.constexpr,
                            HAS_LIMIT: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Program (row block, 128-column group): Q = e4m3(X / s), S[row, group] = s = max(amax, eps) / 448 (float32;
    the quotient clamped to +-448 so a rounding past the max never makes NaN). HAS_LIMIT: only the first
    LIMIT[0] rows (read on the device: the grouped GEMM's last offset; the rows past it are other ranks' pairs,
    never read, and may hold garbage).

    ROUND_FIRST (Triton's CPU interpreter): its float32 -> e4m3 cast gets a rounding that carries into the next
    binade wrong (124.3 -> 64, not 128; Triton 3.9), so the quotient is first rounded to e4m3's grid here (to nearest,
    ties to even, as the GPU's cast) and the cast is exact."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    if HAS_LIMIT:
        M = tl.minimum(M, tl.load(LIMIT))
    rk = g * QBLOCK + tl.arange(0, QBLOCK)
    m2 = (rm < M)[:, None] & (rk < K)[None, :]
    rm64 = rm.to(tl.int64)
    x = tl.load(X + rm64[:, None] * stride_x + rk[None, :], mask=m2, other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), axis=1), eps) / E4M3_MAX
    q = tl.clamp(x / s[:, None], -E4M3_MAX, E4M3_MAX)
    if ROUND_FIRST:
        a = tl.abs(q)
        ulp = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(a, 1e-30))), -6.0) - 3.0)  # 3 mantissa bits
        r = a / ulp  # exact: ulp is a power of two
        f = tl.floor(r)
        up = (r - f > 0.5) | ((r - f == 0.5) & (f % 2 == 1))  # to nearest, ties to even
        q = tl.where(q < 0, -1.0, 1.0) * tl.where(up, f + 1.0, f) * ulp
    tl.store(Q + rm64[:, None] * stride_q + rk[None, :], q.to(Q.dtype.element_ty), mask=m2)
    tl.store(S + rm64 * stride_s + g, s, mask=rm < M)


@triton.jit
def expert_tile(OFFS, n_experts, n_out, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """This program's output tile of a grouped GEMM over rows grouped by expert (OFFS [E] int32, the inclusive
    cumulative row counts), without a host sync: program id -> (tile slot, n-block), GROUP_M tile slots per n-block
    sweep (one expert's tiles share its weight bytes in L2); the offsets are read into E_P2 >= E lanes, the row
    tiles of BLOCK_M counted per expert and the slot's expert found by a cumulative sum.

    Returns (live, e, row0, row_end, pid_n): ``live`` False for slots past the last tile (the program returns),
    the expert, its tile's first row, the expert's end row (rows from there are masked) and the n-block."""
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(n_out, BLOCK_N)
    slot = (pid // per_group) * GROUP_M + (pid % per_group) % GROUP_M
    pid_n = (pid % per_group) // GROUP_M
    ei = tl.arange(0, E_P2)
    ends = tl.load(OFFS + ei, mask=ei < n_experts, other=0)
    starts = tl.load(OFFS + ei - 1, mask=(ei > 0) & (ei < n_experts), other=0)
    counts = tl.where(ei < n_experts, ends - starts, 0)
    tiles = (tl.maximum(counts, 0) + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)
    e = tl.sum((cum <= slot).to(tl.int32))
    sel = ei == e
    row0 = tl.sum(tl.where(sel, starts, 0)) + (slot - tl.sum(tl.where(sel, cum - tiles, 0))) * BLOCK_M
    row_end = tl.sum(tl.where(sel, ends, 0))
    return slot < tl.sum(tiles), e, row0, row_end, pid_n


@triton.jit
def _fp8_grouped_gemm_kernel(A, AS, B, B_DESC, BS, C, OFFS, ROWS, n_experts, N, K, stride_a, stride_as, stride_be,
                             stride_bn, stride_bse, stride_bsn, stride_c, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, A_FP8: tl.constexpr,
                             GATHER: tl.constexpr, TMA: tl.constexpr):
    """C[rows of e] = (A[rows of e] * AS) @ (B[e] * BS[e]).T, rounded to C's dtype, for every expert e.

    ``A_FP8`` (W8A8): A [rows, K] e4m3 grouped by expert, AS [rows, cdiv(K, 128)] float32 (one scale per row and
    128 columns), fp8 tensor cores. Otherwise (W8A16): A bf16 / fp16, AS unused, each B tile widened to A's dtype
    in registers (exact: e4m3 fits in either), the products scaled per column. B [E, N, K] e4m3,
    BS [E, cdiv(N, 128), cdiv(K, 128)] float32; OFFS [E] int32, the inclusive cumulative row counts. Rows past
    OFFS[E - 1] are not written.

    ``GATHER``: A (and AS) are per token, not grouped: grouped row r reads A row ROWS[r] (int64), so the rows
    need no gathered copy and a token's activations are quantized once for all its experts. ``TMA``: the B tiles
    are loaded by the tensor memory accelerator through B_DESC (B as [E * N, K], blocks [BLOCK_N, 128]; rows past
    an expert's N belong to the next expert or read as zeros, and only feed output columns that are not stored).

    Each program finds its tile with :func:`expert_tile` (no host sync); slots past the last tile return.
    The k loop is 128 wide: one activation scale per row and one weight scale per column per step."""
    live, e, row0, row_end, pid_n = expert_tile(OFFS, n_experts, N, E_P2, BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < row_end
    nmask = rn < N
    rm64 = rm.to(tl.int64)
    e64 = e.to(tl.int64)
    ra = tl.load(ROWS + rm64, mask=mmask, other=0) if GATHER else rm64
    a_rows = A + ra[:, None] * stride_a
    b_cols = B + e64 * stride_be + rn.to(tl.int64)[None, :] * stride_bn  # [BLOCK_K, BLOCK_N] tiles of B[e].T
    a_scales = AS + ra * stride_as
    b_scales = BS + e64 * stride_bse + (rn // QBLOCK) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, QBLOCK)):
        rk = kb * QBLOCK + tl.arange(0, QBLOCK)
        kmask = rk < K
        a = tl.load(a_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        if TMA:
            b = tl.trans(B_DESC.load([e * N + pid_n * BLOCK_N, kb * QBLOCK]))
        else:
            b = tl.load(b_cols + rk[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        sb = tl.load(b_scales + kb, mask=nmask, other=0.0)
        if A_FP8:
            sa = tl.load(a_scales + kb, mask=mmask, other=0.0)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        else:
            acc += tl.dot(a, b.to(a.dtype)) * sb[None, :]
    tl.store(C + rm64[:, None] * stride_c + rn[None, :], acc.to(C.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])
