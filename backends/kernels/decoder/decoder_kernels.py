"""Triton kernels of the fused decoder-layer ops (launchers: :mod:`backends.kernels.decoder.decoder_ops`).

Each kernel reproduces the rounding of the unfused torch ops it replaces: torch computes a 16-bit elementwise op
in float32 and rounds its result to the model dtype, so the kernels round (``.to(DT)``) where torch rounds, and a
fused op agrees with the torch path to float32 summation order.

In-place kernels (the latent row, the query's rope dims) load everything a program touches, pass a barrier, then
store: another warp of the same program may store where this warp still has to load.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from backends.kernels.gemm.skinny_kernels import head_dot_tile
from backends.kernels.libdevice_math import exp_f32 as _exp
from backends.kernels.pdl import pdl_enter


@triton.jit
def _rms_norm_kernel(X, D, W, R, Y, stride_x, stride_d, stride_r, stride_y, n, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr, MODE: tl.constexpr = 0):
    """One row: r = x (+ d) rounded to R's dtype (stored when HAS_DELTA); with s = rsqrt(mean(r^2) + eps) in float32,
    ``MODE`` 0 (V2 / V3): y = (r * s) rounded to Y's dtype, times w, rounded; 1 (V4's weighted norm): y = w * (r *
    s) in float32, rounded once; 2 (V4's unweighted norm): y = r * (s rounded to Y's dtype), rounded (W unread)."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(D + row * stride_d + cols, mask=m, other=0.0).to(tl.float32)
        r = (x + d).to(R.dtype.element_ty)
        tl.store(R + row * stride_r + cols, r, mask=m)
        x = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    if MODE == 2:
        y = x * rstd.to(Y.dtype.element_ty).to(tl.float32)
    else:
        w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
        if MODE == 1:
            y = w * (x * rstd)
        else:
            y = (x * rstd).to(Y.dtype.element_ty).to(tl.float32) * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr):
    """torch's rotate (cos/sin already rounded to DT): (x1 c - x2 s, x2 c + x1 s), each product and sum rounded."""
    a = (x1 * c).to(DT).to(tl.float32) - (x2 * s).to(DT).to(tl.float32)
    b = (x2 * c).to(DT).to(tl.float32) + (x1 * s).to(DT).to(tl.float32)
    return a.to(DT), b.to(DT)


@triton.jit
def _rope_latent_kernel(Q, KV, W, COS, SIN, SLOTS, CACHE, WUK, QABS, T, n_blocks, stride_qt, stride_qh, stride_kv,
                        stride_cs, stride_cache, stride_wh, stride_wk, stride_at, stride_ah, H, N_ABS, eps,
                        NOPE: tl.constexpr, C: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr, INTERLEAVE: tl.constexpr, DO_Q: tl.constexpr,
                        DO_LATENT: tl.constexpr, WRITE_CACHE: tl.constexpr, ABSORB: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """The MLA's q/kv preparation in one launch, in place. Programs 2t and 2t + 1 take token t: the query's RoPE
    (when DO_Q) and the latent row (when DO_LATENT). With ABSORB the programs after 2T each take one (column block,
    head) of q_nope @ W_UK into QABS (:func:`skinny_kernels.head_dot_tile`, T <= 16): q_nope is not what the RoPE
    programs write, so the three run side by side."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    prep = pid < 2 * T
    if prep:
        row = (pid // 2).to(tl.int64)
        if pid % 2 == 0:
            if DO_Q:
                _rope_q_row(Q, COS, SIN, row, stride_qt, stride_qh, stride_cs, H, NOPE, HALF, BLOCK_H, BLOCK_J,
                            INTERLEAVE)
        else:
            if DO_LATENT:
                _latent_row(KV, W, COS, SIN, SLOTS, CACHE, row, stride_kv, stride_cs, stride_cache, eps, C, HALF,
                            BLOCK_C, BLOCK_J, INTERLEAVE, WRITE_CACHE)
    if ABSORB:  # outside the branch above, so the product's loop is software-pipelined: RoPE / latent programs
        # run it over no rows and no reduction (nothing loaded, nothing stored)
        j = tl.maximum(pid - 2 * T, 0)
        head_dot_tile(Q, WUK, QABS, tl.where(prep, 0, T), N_ABS, tl.where(prep, 0, NOPE), j % n_blocks,
                      (j // n_blocks).to(tl.int64), stride_qt, stride_qh, stride_wh, stride_wk, stride_at, stride_ah,
                      BLOCK_N, BLOCK_K)


@triton.jit
def _latent_row(KV, W, COS, SIN, SLOTS, CACHE, row, stride_kv, stride_cs, stride_cache, eps,
                C: tl.constexpr, HALF: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr,
                INTERLEAVE: tl.constexpr, WRITE_CACHE: tl.constexpr):
    """One token's latent row, in place: RMSNorm of the first C values (times W), RoPE on the 2*HALF rope values
    (interleaved pairs in, de-interleaved out; or half-split), then the row copied to CACHE[SLOTS[row]]."""
    DT: tl.constexpr = KV.dtype.element_ty
    base = KV + row * stride_kv
    c = tl.arange(0, BLOCK_C)
    mc = c < C
    x = tl.load(base + c, mask=mc, other=0.0).to(tl.float32)
    j = tl.arange(0, BLOCK_J)
    mj = j < HALF
    if INTERLEAVE:
        x1 = tl.load(base + C + 2 * j, mask=mj, other=0.0).to(tl.float32)
        x2 = tl.load(base + C + 2 * j + 1, mask=mj, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + C + j, mask=mj, other=0.0).to(tl.float32)
        x2 = tl.load(base + C + HALF + j, mask=mj, other=0.0).to(tl.float32)
    cs = tl.load(COS + row * stride_cs + j, mask=mj, other=0.0).to(DT).to(tl.float32)
    sn = tl.load(SIN + row * stride_cs + j, mask=mj, other=0.0).to(DT).to(tl.float32)
    w = tl.load(W + c, mask=mc, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
    ckv = ((x * rstd).to(DT).to(tl.float32) * w).to(DT)
    o1, o2 = _rotate(x1, x2, cs, sn, DT)
    tl.debug_barrier()
    tl.store(base + c, ckv, mask=mc)
    tl.store(base + C + j, o1, mask=mj)
    tl.store(base + C + HALF + j, o2, mask=mj)
    if WRITE_CACHE:
        slot = tl.load(SLOTS + row).to(tl.int64)
        cb = CACHE + slot * stride_cache
        tl.store(cb + c, ckv.to(CACHE.dtype.element_ty), mask=mc)
        tl.store(cb + C + j, o1.to(CACHE.dtype.element_ty), mask=mj)
        tl.store(cb + C + HALF + j, o2.to(CACHE.dtype.element_ty), mask=mj)


@triton.jit
def _rope_q_row(Q, COS, SIN, row, stride_t, stride_h, stride_cs, H,
                NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_J: tl.constexpr,
                INTERLEAVE: tl.constexpr):
    """RoPE on the rope dims (after NOPE) of every head of one token, in place."""
    DT: tl.constexpr = Q.dtype.element_ty
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_J)[None, :]
    m = (h < H) & (j < HALF)
    base = Q + row * stride_t + h * stride_h + NOPE
    if INTERLEAVE:
        x1 = tl.load(base + 2 * j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + 2 * j + 1, mask=m, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + j, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + j, mask=m, other=0.0).to(tl.float32)
    cs = tl.load(COS + row * stride_cs + j, mask=j < HALF, other=0.0).to(DT).to(tl.float32)
    sn = tl.load(SIN + row * stride_cs + j, mask=j < HALF, other=0.0).to(DT).to(tl.float32)
    o1, o2 = _rotate(x1, x2, cs, sn, DT)
    tl.debug_barrier()
    tl.store(base + j, o1, mask=m)
    tl.store(base + HALF + j, o2, mask=m)


@triton.jit
def _silu_mul_kernel(G, U, Y, stride_g, stride_u, stride_y, inter, limit, BLOCK: tl.constexpr,
                     CLAMP: tl.constexpr, PDL: tl.constexpr):
    """gate, up [N, I] -> silu(gate) * up [N, I], silu rounded then the product rounded; with CLAMP V4's clamps
    first, each rounded: gate <= limit, -limit <= up <= limit."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    DT: tl.constexpr = Y.dtype.element_ty
    g = tl.load(G + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit).to(DT).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit).to(DT).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (s * u).to(DT), mask=m)


@triton.jit
def _top_k_positions(choice, N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Positions [BLOCK_K] int32 (-1 past K) of the K largest of ``choice`` [N] float32 (N a power of two, -inf
    where nothing may be picked), largest first; among equal values the lowest position. One max per pick over a
    64-bit key: the value's bits made order-preserving as a signed integer (-0.0 first made +0.0, as they compare
    equal) above the complement of the position, so the max is the largest value and, among equal ones, the
    lowest position (the loop of max / argmin / gather it replaced picked the same)."""
    pos = tl.arange(0, N)
    bits = (choice + 0.0).to(tl.int32, bitcast=True)
    key = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (N - 1 - pos).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    picked = tl.full([BLOCK_K], -1, dtype=tl.int32)
    for i in tl.static_range(K):
        at = N - 1 - (tl.max(key, axis=0) & 0xFFFFFFFF).to(tl.int32)
        picked = tl.where(kk == i, at, picked)
        key = tl.where(pos == at, -(2**63), key)
    return picked


@triton.jit
def _route_sigmoid_kernel(LOGITS, BIAS, W_OUT, ID_OUT, stride_l, scale,
                          G: tl.constexpr, PER: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr,
                          BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, NORM: tl.constexpr, TOP2: tl.constexpr, PDL: tl.constexpr):
    """DeepSeek-V3 noaux_tc routing of one token: sigmoid scores, choice = scores + bias, groups ranked by the
    sum of their top-2 choices (top-1 when a group has one expert), the best TOPK_GROUP groups kept, top-K
    choices among them (descending, like torch.topk); weights = the chosen unbiased scores, renormalised
    (+1e-20) when NORM, times scale."""
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)[:, None]
    p = tl.arange(0, BLOCK_P)[None, :]
    valid = (g < G) & (p < PER)
    e = g * PER + p
    logit = tl.load(LOGITS + row * stride_l + e, mask=valid, other=0.0)
    s = 1.0 / (1.0 + tl.exp(-logit))
    choice = s
    if HAS_BIAS:
        choice = s + tl.load(BIAS + e, mask=valid, other=0.0)
    choice = tl.where(valid, choice, float("-inf"))
    m1 = tl.max(choice, axis=1)
    if TOP2:
        first = tl.min(tl.where(choice == m1[:, None], p, BLOCK_P), axis=1)
        m2 = tl.max(tl.where(p == first[:, None], float("-inf"), choice), axis=1)
        gs = m1 + m2
    else:
        gs = m1
    gi = tl.arange(0, BLOCK_G)
    gs = tl.where(gi < G, gs, float("-inf"))
    keep = gi < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(gs, axis=0)
        b = tl.min(tl.where(gs == best, gi, BLOCK_G), axis=0)
        keep = keep | (gi == b)
        gs = tl.where(gi == b, float("-inf"), gs)
    # positions, not e, since padded slots (p >= PER) share e with the next group's experts
    masked = tl.where(keep[:, None] & valid, choice, float("-inf"))
    picked = _top_k_positions(tl.reshape(masked, [BLOCK_G * BLOCK_P]), BLOCK_G * BLOCK_P, K, BLOCK_K)
    kk = tl.arange(0, BLOCK_K)
    ids = ((picked // BLOCK_P) * PER + picked % BLOCK_P).to(tl.int64)
    ws = 1.0 / (1.0 + tl.exp(-tl.load(LOGITS + row * stride_l + ids, mask=kk < K, other=0.0)))  # the scores again
    ws = tl.where(kk < K, ws, 0.0)  # slots past K (BLOCK_K is a power of two) weigh nothing
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    tl.store(W_OUT + row * K + kk, ws * scale, mask=kk < K)
    tl.store(ID_OUT + row * K + kk, ids, mask=kk < K)


@triton.jit
def _v4_scores(logit, valid, SCORING: tl.constexpr, DT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Router scores of one token's logits [BLOCK_E] (float32 holding DT values), as torch's ops on DT round:
    SCORING 0 sqrtsoftplus (softplus rounded, then its sqrt: torch's softplus is the logit itself past 20, else
    log1p(exp)), 1 softmax over the ``valid`` experts, 2 sigmoid."""
    if SCORING == 0:
        ex = _exp(tl.minimum(logit, 20.0), LIBDEVICE)
        if LIBDEVICE:
            sp = libdevice.log1p(ex)
        else:  # log1p without libdevice, to float32's precision: log(u) * ex / (u - 1) with u = 1 + ex
            u = 1.0 + ex
            sp = tl.where(u == 1.0, ex, tl.log(u) * (ex / (u - 1.0)))
        sp = tl.where(logit > 20.0, logit, sp).to(DT).to(tl.float32)
        s = tl.sqrt_rn(sp)
    elif SCORING == 1:
        lm = tl.where(valid, logit, float("-inf"))
        ex = _exp(lm - tl.max(lm, axis=0), LIBDEVICE)
        s = tl.math.div_rn(ex, tl.sum(ex, axis=0))
    else:
        s = tl.math.div_rn(tl.full(logit.shape, 1.0, tl.float32), 1.0 + _exp(-logit, LIBDEVICE))
    return s.to(DT).to(tl.float32)


@triton.jit
def _v4_route_kernel(LOGITS, BIAS, TID2EID, INPUT_IDS, W_OUT, ID_OUT, stride_l, stride_h, E, scale, eps,
                     SCORING: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HASH: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    """DeepSeek-V4 routing of one token (``runtime.model.deepseek.routing.route`` with V4's router), every torch
    op's rounding to DT (the logits' dtype) kept: scores (:func:`_v4_scores`); the K experts from the token's row
    of TID2EID (HASH: INPUT_IDS[row]'s) or the top-K of the choice = scores + BIAS (bias rounded to DT, then the
    sum) in descending order, the lowest id first among equal choices; weights = the chosen scores over their
    sum (rounded) + eps (rounded), rounded, times scale, rounded."""
    pdl_enter(PDL)
    DT: tl.constexpr = W_OUT.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    logit = tl.load(LOGITS + row * stride_l + e, mask=valid, other=0.0).to(tl.float32)
    s = _v4_scores(logit, valid, SCORING, DT, LIBDEVICE)
    kk = tl.arange(0, BLOCK_K)
    if HASH:
        tok = tl.load(INPUT_IDS + row).to(tl.int64)
        ids = tl.load(TID2EID + tok * stride_h + kk, mask=kk < K, other=0).to(tl.int64)
    else:
        choice = s
        if HAS_BIAS:
            b = tl.load(BIAS + e, mask=valid, other=0.0).to(DT).to(tl.float32)
            choice = (s + b).to(DT).to(tl.float32)
        ids = _top_k_positions(tl.where(valid, choice, float("-inf")), BLOCK_E, K, BLOCK_K).to(tl.int64)
    # the chosen scores: one match per slot (a hash row may name an expert twice: both slots get its score)
    ws = tl.sum(tl.where(ids[:, None] == e[None, :], s[None, :], 0.0), axis=1)
    ws = tl.where(kk < K, ws, 0.0)  # slots past K (BLOCK_K is a power of two) weigh nothing
    total = tl.sum(ws, axis=0).to(DT).to(tl.float32)
    ws = tl.math.div_rn(ws, (total + eps).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    tl.store(W_OUT + row * K + kk, (ws * scale).to(DT), mask=kk < K)
    tl.store(ID_OUT + row * K + kk, ids, mask=kk < K)


@triton.jit
def _moe_dispatch_kernel(IDS, TOKENS, INV, OFFS, N, E, SHARED_ROWS, K: tl.constexpr,
                         BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr):
    """A stable counting sort of the N = T*K (token, slot) pairs by expert id: pair i goes to position
    #{j: id_j < id_i} + #{j < i: id_j == id_i}; INV[i] = that position, TOKENS[position] = i // K; program 0
    also writes OFFS[e] = #{j: id_j <= e} (int32), the inclusive row offsets the grouped GEMM takes, and the
    shared expert's group (:func:`_shared_rows`)."""
    pid = tl.program_id(0)
    i = pid * BLOCK_I + tl.arange(0, BLOCK_I)
    mi = i < N
    idi = tl.load(IDS + i, mask=mi, other=0)
    pos = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(0, N, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        mj = j < N
        idj = tl.load(IDS + j, mask=mj, other=0)
        before = (idj[None, :] < idi[:, None]) | ((idj[None, :] == idi[:, None]) & (j[None, :] < i[:, None]))
        pos += tl.sum((before & mj[None, :]).to(tl.int32), axis=1)
    tl.store(INV + i, pos.to(tl.int64), mask=mi)
    tl.store(TOKENS + pos, (i // K).to(tl.int64), mask=mi)
    if pid == 0:
        ex = tl.arange(0, BLOCK_E)
        cnt = tl.zeros([BLOCK_E], dtype=tl.int32)
        for j0 in range(0, N, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            mj = j < N
            idj = tl.load(IDS + j, mask=mj, other=0)
            cnt += tl.sum(((idj[:, None] <= ex[None, :]) & mj[:, None]).to(tl.int32), axis=0)
        tl.store(OFFS + ex, cnt, mask=ex < E)
        _shared_rows(TOKENS, OFFS, N, E, SHARED_ROWS, BLOCK_J)


@triton.jit
def _shared_rows(TOKENS, OFFS, N, E, SHARED_ROWS, BLOCK: tl.constexpr):
    """The shared expert as group E past the N sorted pairs (every expert id < E): its SHARED_ROWS rows are the
    tokens in order (TOKENS[N + t] = t) and OFFS[E] = N + SHARED_ROWS. Nothing when SHARED_ROWS is 0."""
    for t0 in range(0, SHARED_ROWS, BLOCK):
        t = t0 + tl.arange(0, BLOCK)
        tl.store(TOKENS + N + t, t.to(tl.int64), mask=t < SHARED_ROWS)
    if SHARED_ROWS > 0:  # (a vector of one: N and SHARED_ROWS may be compiled as the constant 1)
        one = tl.arange(0, 1)
        tl.store(OFFS + E + one, (N + SHARED_ROWS + one * 0).to(tl.int32))


@triton.jit
def _moe_block_count_kernel(IDS, CNT, N, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    """The block counting sort's first pass: CNT[b, e] = #{pairs i of block b (BLOCK pairs): id_i == e}, a row
    of BLOCK_E counts per block (BLOCK_E > E: the pairs past N fall in the unused last bin)."""
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(IDS + i, mask=i < N, other=BLOCK_E - 1).to(tl.int32)
    tl.store(CNT + b * BLOCK_E + tl.arange(0, BLOCK_E), tl.histogram(ids, BLOCK_E))


@triton.jit
def _moe_block_scan_kernel(CNT, OFFS, TOKENS, N, NB, E, SHARED_ROWS, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program, in place: CNT[b, e] <- the first sorted row of block b's pairs of expert e = the rows of
    experts < e + the pairs of expert e in blocks < b; OFFS[e] = #{pairs: id <= e} (int32, inclusive); the
    shared expert's group (:func:`_shared_rows`)."""
    _shared_rows(TOKENS, OFFS, N, E, SHARED_ROWS, 256)
    ex = tl.arange(0, BLOCK_E)
    run = tl.zeros([BLOCK_E], dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):  # exclusive prefix over blocks, per expert
        bb = b0 + tl.arange(0, BLOCK_B)
        ptr = CNT + bb[:, None] * BLOCK_E + ex[None, :]
        m = (bb < NB)[:, None]
        c = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, run[None, :] + tl.cumsum(c, axis=0) - c, mask=m)
        run += tl.sum(c, axis=0)
    total = tl.where(ex < E, run, 0)
    incl = tl.cumsum(total, axis=0)
    tl.store(OFFS + ex, incl, mask=ex < E)
    start = incl - total
    for b0 in range(0, NB, BLOCK_B):  # + the rows of the experts before
        bb = b0 + tl.arange(0, BLOCK_B)
        ptr = CNT + bb[:, None] * BLOCK_E + ex[None, :]
        m = (bb < NB)[:, None]
        tl.store(ptr, tl.load(ptr, mask=m, other=0) + start[None, :], mask=m)


@triton.jit
def _moe_block_scatter_kernel(IDS, CNT, TOKENS, INV, N, K: tl.constexpr, BLOCK: tl.constexpr,
                              BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr):
    """The last pass: pair i of block b goes to CNT[b, id_i] + #{j < i in block b: id_j == id_i} (stable);
    INV[i] = that position, TOKENS[position] = i // K."""
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    mi = i < N
    idi = tl.load(IDS + i, mask=mi, other=0).to(tl.int32)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    for j0 in range(b * BLOCK, b * BLOCK + BLOCK, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        idj = tl.load(IDS + j, mask=j < N, other=-1).to(tl.int32)
        rank += tl.sum(((idj[None, :] == idi[:, None]) & (j[None, :] < i[:, None])).to(tl.int32), axis=1)
    pos = tl.load(CNT + b * BLOCK_E + idi, mask=mi, other=0) + rank
    tl.store(INV + i, pos.to(tl.int64), mask=mi)
    tl.store(TOKENS + pos, (i // K).to(tl.int64), mask=mi)


@triton.jit
def _moe_combine_kernel(Y, INV, W, SHARED, LIMIT, OUT, D, stride_y, stride_s, stride_o,
                        K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[t] = round(sum_j W[t, j] * Y[INV[t K + j]]) (float32, j in order) (+ SHARED[t], rounded);
    ``HAS_LIMIT``: rows of Y from LIMIT[0] on (other ranks' pairs, not computed) are read as zeros."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = d < D
    DT: tl.constexpr = OUT.dtype.element_ty
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_LIMIT:
        limit = tl.load(LIMIT)
    for j in tl.static_range(K):
        p = tl.load(INV + t * K + j)
        w = tl.load(W + t * K + j)
        mj = m
        if HAS_LIMIT:
            mj = m & ((d * 0 + p) < limit)
        acc += tl.load(Y + p * stride_y + d, mask=mj, other=0.0).to(tl.float32) * w
    out = acc.to(DT)
    if HAS_SHARED:
        out = (out.to(tl.float32) + tl.load(SHARED + t * stride_s + d, mask=m, other=0.0).to(tl.float32)).to(DT)
    tl.store(OUT + t * stride_o + d, out, mask=m)
