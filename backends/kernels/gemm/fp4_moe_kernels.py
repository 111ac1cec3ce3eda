"""Triton kernels for DeepSeek-V4's fp4 routed experts, launchers in :mod:`backends.kernels.gemm.fp4_moe`.

Weights are e2m1 values packed two per byte (low nibble first: input column 2 j is byte j's low nibble, 2 j + 1
its high one) with one power-of-two scale per row and 32 inputs (``dequantized = e2m1 * scale``, the layout of
``runtime.model.quantized.PackedFP4``): ue8m0 bytes as the release stores them (uint8 b, ``2 ** (b - 127)``; the
``*_UE8M0`` constexprs) or float32 values. Hopper has no fp4 tensor-core product, so every kernel reads the packed
bytes and widens them in registers (:func:`_widen`: the e2m1 values of a byte's two nibbles built from their bits
as float32 by :func:`_nibbles`, times their group's scale (a ue8m0 byte widened to float32 by :func:`_ue8m0`),
cast to the activation dtype). The widening is exact: every e2m1 value times a power of two is a bf16 / fp16 value
(within their exponent ranges), so the products are those of the dequantized weights up to float32 summation order.

A byte tile is read as [rows, groups, 16] (16 bytes = one 32-input scale group), so a group's one scale
broadcasts over its 16 bytes without a gather. The two nibbles of a byte are two input columns:

* **Few tokens** (decode, T <= 16), on request (``Fp4ExpertConfig(fma=False)``): :func:`_fp4_moe_up_kernel` and
  :func:`_fp4_moe_down_kernel` (the design of ``fp8_moe_kernels._fp8_moe_up_kernel`` / ``_down_kernel``: every
  (token, slot) pair streams its expert's bytes once and multiplies on the tensor cores with the token's row as row
  0 of a 16-row tile). The low nibbles multiply the activation's even columns and the high nibbles its odd columns
  (two products per step, no interleave of the widened tile: the activation row is what is read strided, and it is
  tiny). The default are the CUDA-core kernels of :mod:`~backends.kernels.gemm.fp4_fma_kernels` (5-8x faster at
  few tokens on an H200, where these spend their time on operand layouts). The addressing is shared:
  :func:`_up_pair` / :func:`_up_step` (a pair's gate and up rows, a step's bytes and scales), :func:`_down_program`
  / :func:`_down_step` / :func:`_fold_slot` (a token's slots; a step's slot, expert, bytes and scales; a slot's
  product folded in), also by the other kernel modules.
* **Many tokens** (prefill): :func:`_fp4_grouped_gemm_kernel`, a W4A16 grouped GEMM over rows sorted by expert
  (16-bit activations read contiguously, the widened nibbles interleaved back into column order with
  ``tl.join``), optionally with the gated activation fused (gate and up columns in one program, the product of
  the activation written).

Activations (``ACT``): 0 none (the plain product), 1 V3's silu(gate) * up, 2 V4's clamped SwiGLU
silu(min(gate, limit)) * clamp(up, -limit, limit). Each GEMM output is rounded to the activation dtype, SiLU
rounded, the product rounded (the torch path's rounding points).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.gemm.fp8_moe_kernels import expert_tile
from backends.kernels.pdl import pdl_enter

#: inputs per scale (one scale group: 16 packed bytes)
GROUP: tl.constexpr = tl.constexpr(32)
GROUP_BYTES: tl.constexpr = tl.constexpr(16)


@triton.jit
def _nibbles(packed):
    """packed uint8 bytes -> the e2m1 values of their (low, high) nibbles as float32, from the bits (a nibble: sign
    bit 3, exponent bits 2..1, mantissa bit 0): magnitude codes 2..7 are (1 + m / 2) 2^(e - 1), whose float32 bits
    are (code + 252) << 22; code 1 is 0.5 (126 << 23), code 0 is 0. Both nibbles in one helper (the interpreter
    pays for every call)."""
    b = packed.to(tl.uint32)
    lo = b & 15
    code = lo & 7
    lo_bits = tl.where(code > 1, (code + 252) << 22, code * (126 << 23)) | ((lo & 8) << 28)
    hi = b >> 4
    code = hi & 7
    hi_bits = tl.where(code > 1, (code + 252) << 22, code * (126 << 23)) | ((hi & 8) << 28)
    return lo_bits.to(tl.float32, bitcast=True), hi_bits.to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0(scale, UE8M0: tl.constexpr):
    """Scales as loaded -> float32: ue8m0 bytes b (``UE8M0``) -> ``2 ** (b - 127)`` built from its float32 bits
    (b << 23; b = 0 is the subnormal 2 ** -127, 0x400000; b = 255 is inf), exact, the value of
    ``runtime.model.quantized.scale_values``; float32 scales as they are."""
    if UE8M0:  # one return (the compiler types every return of a function, taken or not)
        b = scale.to(tl.uint32)
        out = tl.where(b > 0, b << 23, 0x400000).to(tl.float32, bitcast=True)
    else:
        out = scale
    return out


@triton.jit
def _widen(packed, scale, DT: tl.constexpr, UE8M0: tl.constexpr):
    """packed [R, G, 16] uint8 and scale [R, G] (ue8m0 uint8 with ``UE8M0``, else float32) -> (low nibbles, high
    nibbles) [R, G, 16] of ``DT``, each times its group's scale (exact)."""
    lo, hi = _nibbles(packed)
    s = _ue8m0(scale, UE8M0)[:, :, None]
    return (lo * s).to(DT), (hi * s).to(DT)


@triton.jit
def _act(g, u, limit, ACT: tl.constexpr, DT: tl.constexpr):
    """float32 gate and up (already rounded to DT) -> the gated activation rounded to DT: silu rounded, the
    product rounded; ACT 2 clamps first (gate <= limit, |up| <= limit)."""
    if ACT == 2:  # rounded to DT as torch's clamp of a DT tensor by a float limit
        g = tl.minimum(g, limit).to(DT).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit).to(DT).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    return (s * u).to(DT)


@triton.jit
def _store_act(h_row, ri, inter, g, u, limit, ACT: tl.constexpr):
    """The up kernels' epilogue: the gate and up sums g, u [BLOCK_I] (float32) rounded to H's dtype, the activation
    (:func:`_act`) stored at ``h_row + ri`` for ``ri < inter``."""
    DT: tl.constexpr = h_row.dtype.element_ty
    tl.store(h_row + ri, _act(g.to(DT).to(tl.float32), u.to(DT).to(tl.float32), limit, ACT, DT), mask=ri < inter)


@triton.jit
def _up_pair(X, IDS, GU, GUS, inter, n_local, stride_x, stride_ge, stride_gn, stride_gse, stride_gsn,
             TOPK: tl.constexpr, BLOCK_I: tl.constexpr):
    """The up kernels' program (p, i-block), both kernel sets: pair p is (token p // TOPK, expert e = IDS[p]).
    Returns p, e (int64), ri [BLOCK_I] (the program's gate rows; up rows inter + ri), live [BLOCK_I] (rows to read:
    none of another rank's expert), the token's row of X, and expert e's gate / up byte rows [BLOCK_I, 1, 1] and
    scale rows [BLOCK_I, 1] (pointers)."""
    p = tl.program_id(0)
    ri = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    e = tl.load(IDS + p, mask=p >= 0, other=0).to(tl.int64)  # masked: the interpreter fails an unmasked scalar load
    t = p // TOPK
    live = ri < tl.where(e < n_local, inter, 0)  # (not an &: the interpreter makes that int32)
    ri64 = ri.to(tl.int64)
    g_rows = GU + e * stride_ge + ri64[:, None, None] * stride_gn
    u_rows = GU + e * stride_ge + (ri64 + inter)[:, None, None] * stride_gn
    gs_rows = GUS + e * stride_gse + ri64[:, None] * stride_gsn
    us_rows = GUS + e * stride_gse + (ri64 + inter)[:, None] * stride_gsn
    return p, e, ri, live, X + t * stride_x, g_rows, u_rows, gs_rows, us_rows


@triton.jit
def _up_step(g_rows, u_rows, gs_rows, us_rows, live, k0, n_bytes, n_groups, G: tl.constexpr):
    """One step of the up kernels: inputs k0 .. k0 + 32 G (groups k0 / 32 ..) of the gate and up rows, masked to
    the live rows, n_bytes (K / 2) and n_groups (cdiv(K, 32)). Returns byte [G, 16] (the bytes' indices in a row),
    the gate and up bytes [BLOCK_I, G, 16] uint8 and their scales [BLOCK_I, G] as stored."""
    grp = k0 // GROUP + tl.arange(0, G)
    byte = grp[:, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES)[None, :]  # [G, 16]
    m3 = live[:, None, None] & (byte < n_bytes)[None, :, :]
    ms = live[:, None] & (grp < n_groups)[None, :]
    wg = tl.load(g_rows + byte[None, :, :], mask=m3, other=0)
    wu = tl.load(u_rows + byte[None, :, :], mask=m3, other=0)
    sg = tl.load(gs_rows + grp[None, :], mask=ms, other=0)
    su = tl.load(us_rows + grp[None, :], mask=ms, other=0)
    return byte, wg, wu, sg, su


@triton.jit
def _down_program(IDS, WTS, D, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_D: tl.constexpr):
    """The down kernels' program (t, d-block), both kernel sets: t, rd [BLOCK_D] (its output columns, rd64 as
    int64), dmask (rd < D), and token t's slots [TOPK_P2] with their expert ids (int64) and routing weights."""
    t = tl.program_id(0)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = rd < D
    slots = tl.arange(0, TOPK_P2)
    ids = tl.load(IDS + t * TOPK + slots, mask=slots < TOPK, other=0).to(tl.int64)
    wts = tl.load(WTS + t * TOPK + slots, mask=slots < TOPK, other=0.0)
    return t, rd, rd.to(tl.int64), dmask, slots, ids, wts


@triton.jit
def _down_step(DN, DNS, t, it, n_chunks, slots, ids, rd64, dmask, inter, n_local, stride_de, stride_dd, stride_dse,
               stride_dsd, TOPK: tl.constexpr, G: tl.constexpr):
    """Step ``it`` of the down kernels' loop over (slot j, chunk c of 32 G hidden inputs): returns j, c, the pair
    p, width (the hidden inputs of the slot's expert: inter, 0 for another rank's), byte [G, 16] (the bytes'
    indices in a row) and the chunk's bytes [BLOCK_D, G, 16] uint8 and scales [BLOCK_D, G] as stored, masked to
    dmask and width."""
    j = it // n_chunks
    c = it % n_chunks
    p = t * TOPK + j
    e = tl.sum(tl.where(slots == j, ids, 0))
    width = tl.where(e < n_local, inter, 0)  # other ranks' experts: nothing
    grp = c * G + tl.arange(0, G)
    byte = grp[:, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES)[None, :]  # [G, 16], bytes of the expert's row
    w = tl.load(DN + e * stride_de + rd64[:, None, None] * stride_dd + byte[None, :, :],
                mask=dmask[:, None, None] & (byte < width // 2)[None, :, :], other=0)
    sc = tl.load(DNS + e * stride_dse + rd64[:, None] * stride_dsd + grp[None, :],
                 mask=dmask[:, None] & (grp * GROUP < width)[None, :], other=0)
    return j, c, p, width, byte, w, sc


@triton.jit
def _fold_slot(out, acc, slots, j, wts, DT: tl.constexpr):
    """A slot's product folded in, both down kernels: acc's row sums (acc [BLOCK_D, n] float32) rounded to DT,
    times slot j's routing weight, added to out [BLOCK_D] float32. Returns (out, acc restarted at zeros)."""
    y = tl.sum(acc, axis=1).to(DT).to(tl.float32)
    out += y * tl.sum(tl.where(slots == j, wts, 0.0))
    return out, tl.zeros_like(acc)


@triton.jit
def _fp4_moe_up_kernel(X, IDS, GU, GUS, H, K, inter, n_local, limit, stride_x, stride_ge, stride_gn, stride_gse,
                       stride_gsn, stride_h, TOPK: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                       ACT: tl.constexpr, PDL: tl.constexpr, GUS_UE8M0: tl.constexpr):
    """Program (p, i-block): pair p is (token p // TOPK, expert IDS[p]) over GU[e] [2 I, K / 2] packed bytes with
    scales GUS[e] [2 I, cdiv(K, 32)] (ue8m0 bytes with ``GUS_UE8M0``, else float32). H[p, i] = act(gate, up) (see
    :func:`_act`), each GEMM output rounded to H's dtype. Other ranks' experts (IDS[p] >= n_local) compute nothing
    (their rows of H are written, unused). Each loop step reads BLOCK_K inputs (BLOCK_K / 32 groups of 16 bytes) of
    BLOCK_I gate and BLOCK_I up rows (:func:`_up_step`)."""
    pdl_enter(PDL)
    DT: tl.constexpr = H.dtype.element_ty
    HALF: tl.constexpr = BLOCK_K // 2
    n_bytes = K // 2
    n_groups = tl.cdiv(K, GROUP)
    p, _e, ri, live, x_row, g_rows, u_rows, gs_rows, us_rows = _up_pair(
        X, IDS, GU, GUS, inter, n_local, stride_x, stride_ge, stride_gn, stride_gse, stride_gsn, TOPK, BLOCK_I)
    jj = tl.arange(0, HALF)
    row0 = (tl.arange(0, 16) == 0)[:, None]
    acc_g = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, 16], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        _, wg, wu, sg, su = _up_step(g_rows, u_rows, gs_rows, us_rows, live, k0, n_bytes, n_groups, BLOCK_K // GROUP)
        glo, ghi = _widen(wg, sg, DT, GUS_UE8M0)
        ulo, uhi = _widen(wu, su, DT, GUS_UE8M0)
        col = k0 + 2 * jj
        x_ev = tl.where(row0, tl.load(x_row + col, mask=col < K, other=0.0)[None, :], 0.0).to(DT)  # token row 0
        x_od = tl.where(row0, tl.load(x_row + col + 1, mask=col < K, other=0.0)[None, :], 0.0).to(DT)
        acc_g = tl.dot(tl.reshape(glo, [BLOCK_I, HALF]), tl.trans(x_ev), acc_g)
        acc_g = tl.dot(tl.reshape(ghi, [BLOCK_I, HALF]), tl.trans(x_od), acc_g)
        acc_u = tl.dot(tl.reshape(ulo, [BLOCK_I, HALF]), tl.trans(x_ev), acc_u)
        acc_u = tl.dot(tl.reshape(uhi, [BLOCK_I, HALF]), tl.trans(x_od), acc_u)
    _store_act(H + p * stride_h, ri, inter, tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), limit, ACT)  # cols 1..15: 0


@triton.jit
def _fp4_moe_down_kernel(H, IDS, WTS, DN, DNS, OUT, D, inter, n_local, stride_h, stride_de, stride_dd, stride_dse,
                         stride_dsd, stride_o, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_I: tl.constexpr, PDL: tl.constexpr, DNS_UE8M0: tl.constexpr):
    """Program (t, d-block): OUT[t] = sum_j WTS[t, j] * round(DN[e_j] @ H[t TOPK + j]) in float32, j in order (other
    ranks' experts add 0), stored in OUT's dtype. DN [E, D, I / 2] packed bytes with scales DNS [E, D, cdiv(I, 32)]
    (ue8m0 bytes with ``DNS_UE8M0``, else float32); the product of each slot rounded to H's dtype.

    One loop over (slot, BLOCK_I-wide chunk of the hidden dim) (:func:`_down_step`), so the weight loads stay
    pipelined across experts (as ``fp8_moe_kernels._fp8_moe_down_kernel``); at a slot's last chunk its product is
    rounded and folded in (:func:`_fold_slot`)."""
    pdl_enter(PDL)
    DT: tl.constexpr = H.dtype.element_ty
    HALF: tl.constexpr = BLOCK_I // 2
    t, rd, rd64, dmask, slots, ids, wts = _down_program(IDS, WTS, D, TOPK, TOPK_P2, BLOCK_D)
    n_chunks = tl.cdiv(inter, BLOCK_I)
    row0 = (tl.arange(0, 16) == 0)[:, None]
    jj = tl.arange(0, HALF)
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D, 16], dtype=tl.float32)
    for it in range(0, TOPK * n_chunks):
        j, c, p, width, _, w, sc = _down_step(DN, DNS, t, it, n_chunks, slots, ids, rd64, dmask, inter, n_local,
                                              stride_de, stride_dd, stride_dse, stride_dsd, TOPK, BLOCK_I // GROUP)
        lo, hi = _widen(w, sc, DT, DNS_UE8M0)
        col = c * BLOCK_I + 2 * jj
        h_row = H + p * stride_h + col
        h_ev = tl.where(row0, tl.load(h_row, mask=col < width, other=0.0)[None, :], 0.0).to(DT)  # the pair's row 0
        h_od = tl.where(row0, tl.load(h_row + 1, mask=col < width, other=0.0)[None, :], 0.0).to(DT)
        acc = tl.dot(tl.reshape(lo, [BLOCK_D, HALF]), tl.trans(h_ev), acc)
        acc = tl.dot(tl.reshape(hi, [BLOCK_D, HALF]), tl.trans(h_od), acc)
        if c == n_chunks - 1:  # the slot's last chunk: round its product, fold it in, start the next
            out, acc = _fold_slot(out, acc, slots, j, wts, DT)  # (columns 1..15 of acc are zeros)
    tl.store(OUT + t * stride_o + rd, out.to(OUT.dtype.element_ty), mask=dmask)


@triton.jit
def _e8m0(scale, UE8M0: tl.constexpr):
    """Scales as loaded -> ue8m0 bytes: bytes as they are, float32 powers of two as their exponent field (2 ** -127,
    float32's subnormal 0x400000, is byte 0)."""
    if UE8M0:
        out = scale.to(tl.uint8)
    else:
        out = (scale.to(tl.uint32, bitcast=True) >> 23).to(tl.uint8)
    return out


@triton.jit
def _mx_rows(W, WS, rows64, live, k0, n_bytes, n_groups, stride_wn, stride_wsn, BLOCK_K: tl.constexpr,
             UE8M0: tl.constexpr):
    """Rows ``rows64`` ([R] int64, from W / WS already at the expert), inputs k0 .. k0 + BLOCK_K, masked to ``live``
    rows and the row's bytes: packed [R, BLOCK_K / 2] uint8 and scales [R, BLOCK_K / 32] ue8m0 bytes."""
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    grp = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    w = tl.load(W + rows64[:, None] * stride_wn + byte[None, :], mask=live[:, None] & (byte < n_bytes)[None, :],
                other=0)
    s = tl.load(WS + rows64[:, None] * stride_wsn + grp[None, :], mask=live[:, None] & (grp < n_groups)[None, :],
                other=0)
    return w, _e8m0(s, UE8M0)


@triton.jit
def _fp4_tile(B, BS, e64, rows64, nmask, k0, n_bytes, n_groups, stride_be, stride_bn, stride_bse, stride_bsn,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr, UE8M0: tl.constexpr):
    """Rows ``rows64`` of expert e's packed weight, inputs k0 .. k0 + BLOCK_K, widened: [BLOCK_N, BLOCK_K] of DT
    in column order (the nibbles joined back: low, high, low, high ...); ``UE8M0``: BS holds ue8m0 bytes."""
    G: tl.constexpr = BLOCK_K // GROUP
    grp = k0 // GROUP + tl.arange(0, G)
    byte = grp[:, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES)[None, :]
    w = tl.load(B + e64 * stride_be + rows64[:, None, None] * stride_bn + byte[None, :, :],
                mask=nmask[:, None, None] & (byte < n_bytes)[None, :, :], other=0)
    s = tl.load(BS + e64 * stride_bse + rows64[:, None] * stride_bsn + grp[None, :],
                mask=nmask[:, None] & (grp < n_groups)[None, :], other=0)
    lo, hi = _widen(w, s, DT, UE8M0)
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])


@triton.jit
def _grouped_step(a, acc, B, BS, e64, rows64, nmask, k0, n_bytes, n_groups, stride_be, stride_bn, stride_bse,
                  stride_bsn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr, UE8M0: tl.constexpr,
                  MX: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + a [BLOCK_M, BLOCK_K] @ expert e's rows ``rows64`` (inputs k0 ..).T: ``MX`` the
    microscaled product of the packed tile, else our widened tile (:func:`_fp4_tile`) and ``tl.dot``."""
    if MX:
        w, s = _mx_rows(B + e64 * stride_be, BS + e64 * stride_bse, rows64, nmask, k0, n_bytes, n_groups, stride_bn,
                        stride_bsn, BLOCK_K, UE8M0)
        out = tl.dot_scaled(a, None, "bf16", tl.trans(w), s, "e2m1", acc)
    else:
        w = _fp4_tile(B, BS, e64, rows64, nmask, k0, n_bytes, n_groups, stride_be, stride_bn, stride_bse, stride_bsn,
                      BLOCK_N, BLOCK_K, DT, UE8M0)
        out = tl.dot(a, tl.trans(w), acc)
    return out


@triton.jit
def _fp4_grouped_gemm_kernel(A, B, BS, C, OFFS, n_experts, N, K, n_out, limit, stride_a, stride_be, stride_bn,
                             stride_bse, stride_bsn, stride_c, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ACT: tl.constexpr,
                             BS_UE8M0: tl.constexpr, MX: tl.constexpr):
    """C[rows of e] = A[rows of e] @ W[e].T for every expert e (ACT 0: n_out = N columns, rounded to C's dtype),
    or with the activation fused (ACT 1, 2: n_out = N / 2; W[e]'s rows are gate, then up; C = act(gate, up)).
    ``MX`` (bf16 A only): each step is Triton's microscaled product (``tl.dot_scaled``: the packed tile and its
    scales as stored, widened by Triton) instead of our widening and ``tl.dot``.

    A [rows, K] of 16 bits grouped by expert; B [E, N, K / 2] packed e2m1, BS [E, N, cdiv(K, 32)] ue8m0 bytes
    (``BS_UE8M0``) or float32; OFFS [E] int32, the inclusive cumulative row counts. Rows past OFFS[E - 1] are not
    written.

    Each program finds its tile with :func:`~backends.kernels.gemm.fp8_moe_kernels.expert_tile` (no host sync); slots past the last tile return."""
    live, e, row0, row_end, pid_n = expert_tile(OFFS, n_experts, n_out, E_P2, BLOCK_M, BLOCK_N, GROUP_M)
    if not live:
        return
    DT: tl.constexpr = A.dtype.element_ty
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < row_end
    nmask = rn < n_out
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    e64 = e.to(tl.int64)
    a_rows = A + rm64[:, None] * stride_a
    n_bytes = K // 2
    n_groups = tl.cdiv(K, GROUP)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
        acc = _grouped_step(a, acc, B, BS, e64, rn64, nmask, k0, n_bytes, n_groups, stride_be, stride_bn, stride_bse,
                            stride_bsn, BLOCK_N, BLOCK_K, DT, BS_UE8M0, MX)
        if ACT != 0:  # the up rows of the same columns
            acc_u = _grouped_step(a, acc_u, B, BS, e64, rn64 + n_out, nmask, k0, n_bytes, n_groups, stride_be,
                                  stride_bn, stride_bse, stride_bsn, BLOCK_N, BLOCK_K, DT, BS_UE8M0, MX)
    if ACT != 0:
        res = _act(acc.to(DT).to(tl.float32), acc_u.to(DT).to(tl.float32), limit, ACT, DT)
    else:
        res = acc
    tl.store(C + rm64[:, None] * stride_c + rn[None, :], res.to(C.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])
