"""CUDA-core kernels for DeepSeek-V4's fp4 routed experts at few tokens (the default of ``fp4_moe_experts``): they
read the packed weights as 32-bit words,
launchers in :mod:`backends.kernels.gemm.fp4_moe`.

A word holds 8 e2m1 values (inputs 8 w .. 8 w + 7, nibble j = bits 4 j .. 4 j + 3, low nibble first as the bytes).
Nibble j becomes a float32 in 2-3 integer operations (:func:`_nibble`): its magnitude bits go to float32 bits
22..24 and its sign to bit 31, which is the e2m1 value times 2 ** -126 exactly (0.5 is the subnormal 2 ** -127;
Triton keeps float32 subnormals: its FMULs and FFMAs are not flush-to-zero). The products are taken against the
activation times 2 ** 63, so they are e2m1 * x * 2 ** -63 (normal unless |e2m1 * x| < 2 ** -63); a word's 8 products
are summed, then times its group's scale times 2 ** 63 (an exact power of two: the scale ``2 ** (b - 127)`` of ue8m0
byte b is ``(b + 63) << 23`` as float32 bits) into one float32 accumulator per word lane. The sums are those of the
dequantized weights in float32 up to summation order. Limits: scales up to 2 ** 64 (ue8m0 bytes <= 191: the
checkpoint reader refuses larger ones, ``runtime.model.deepseek.checkpoint.FP4_MAX_SCALE``) and |activations| below
2 ** 65; the release's scales are ~2 ** -8.

The loop is ~11 instructions a packed byte (offline SASS for sm_90a, 4 x 1024 up tile), against ~25 of the
byte-wise CUDA-core kernels these replaced (16-byte groups of nibbles widened with compares and selects, reduced
across lanes); on an H200 1.4-2x faster at 1-64 tokens on V4-Flash's tp2 / tp8 slices, 4-8x at moe=ep (other
ranks' slots are skipped, no longer computed on zeros). Tiles are
[rows, G, 4] words (G scale groups of 4 words), so a group's scale broadcasts over its words without a gather, and
the activations [G, 4, 8] are one contiguous load split into their 8 nibble positions in registers.

Rows must be whole words: the input width a multiple of 8 (the launcher falls back to the tensor-core kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.gemm.fp4_moe_kernels import GROUP, _down_program, _fold_slot, _store_act, _up_pair
from backends.kernels.pdl import pdl_enter

#: words per 32-input scale group
GROUP_WORDS: tl.constexpr = tl.constexpr(4)
#: float32 bits 22..24 (an e2m1 magnitude) and bit 31 (its sign): 0x81C00000 as int32
SIGN_MAG: tl.constexpr = tl.constexpr(0x81C00000 - 2**32)
#: 2 ** 63: the activations' factor and the scales' (2 ** -126 * 2 ** 63 * 2 ** 63 = 1)
TWO63: tl.constexpr = tl.constexpr(9.223372036854775808e18)


@triton.jit
def _nibble(wd, J: tl.constexpr):
    """int32 words -> float32: nibble J of each word as its e2m1 value times 2 ** -126 (exact). The nibble is
    shifted to bits 28..31, then arithmetically right by 6: its sign lands on bit 25 and is copied up to bit 31, its
    magnitude on bits 22..24; the mask keeps those two (2-3 integer operations)."""
    return (((wd << (28 - 4 * J)) >> 6) & SIGN_MAG).to(tl.float32, bitcast=True)


@triton.jit
def _scale63(scale, UE8M0: tl.constexpr):
    """Scales as loaded -> float32 scale * 2 ** 63 (ue8m0 byte b: bits (b + 63) << 23; float32: a product)."""
    if UE8M0:
        out = ((scale.to(tl.int32) + 63) << 23).to(tl.float32, bitcast=True)
    else:
        out = scale * TWO63
    return out


@triton.jit
def _split8(x):
    """x [G, 4, 8] float32 -> its 8 nibble positions, each [G, 4] (register moves: the 8 are one thread's)."""
    a, b = tl.split(tl.reshape(x, [x.shape[0], 4, 4, 2]))  # positions 0 2 4 6 / 1 3 5 7
    a0, a1 = tl.split(tl.reshape(a, [x.shape[0], 4, 2, 2]))  # 0 4 / 2 6
    b0, b1 = tl.split(tl.reshape(b, [x.shape[0], 4, 2, 2]))  # 1 5 / 3 7
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _word_dot(wd, x0, x1, x2, x3, x4, x5, x6, x7):
    """wd [R, G, 4] int32 words, x0..x7 [G, 4] (activation * 2 ** 63 at each nibble position) -> [R, G, 4] float32,
    each word's 8 products summed (e2m1 * x * 2 ** -63)."""
    acc = _nibble(wd, 0) * x0[None, :, :]
    acc += _nibble(wd, 1) * x1[None, :, :]
    acc += _nibble(wd, 2) * x2[None, :, :]
    acc += _nibble(wd, 3) * x3[None, :, :]
    acc += _nibble(wd, 4) * x4[None, :, :]
    acc += _nibble(wd, 5) * x5[None, :, :]
    acc += _nibble(wd, 6) * x6[None, :, :]
    acc += _nibble(wd, 7) * x7[None, :, :]
    return acc


@triton.jit
def _words(W, WS, rows64, live, k0, n_words, n_groups, stride_wn, stride_wsn, G: tl.constexpr):
    """Rows ``rows64`` [R] (int64; W / WS at the expert), inputs k0 .. k0 + 32 G: words [R, G, 4] int32 and scales
    [R, G] as stored, masked to the live rows and the row's words / groups."""
    grp = k0 // GROUP + tl.arange(0, G)
    word = grp[:, None] * GROUP_WORDS + tl.arange(0, GROUP_WORDS)[None, :]  # [G, 4]
    rows = (W + rows64[:, None, None] * stride_wn).to(tl.pointer_type(tl.int32))
    wd = tl.load(rows + word[None, :, :], mask=live[:, None, None] & (word < n_words)[None, :, :], other=0)
    s = tl.load(WS + rows64[:, None] * stride_wsn + grp[None, :], mask=live[:, None] & (grp < n_groups)[None, :],
                other=0)
    return wd, s


@triton.jit
def _acts(row, k0, width, G: tl.constexpr):
    """A 16-bit activation row's inputs k0 .. k0 + 32 G (masked to ``width``) times 2 ** 63, split by nibble
    position: 8 x [G, 4] float32."""
    idx = k0 + tl.arange(0, G * 32)
    x = tl.load(row + idx, mask=idx < width, other=0.0).to(tl.float32) * TWO63
    return _split8(tl.reshape(x, [G, 4, 8]))


@triton.jit
def _fp4_moe_up_fma_kernel(X, IDS, GU, GUS, H, K, inter, n_local, limit, stride_x, stride_ge, stride_gn,
                           stride_gse, stride_gsn, stride_h, TOPK: tl.constexpr, BLOCK_I: tl.constexpr,
                           BLOCK_K: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr, GUS_UE8M0: tl.constexpr):
    """Program (p, i-block): pair p is (token p // TOPK, expert IDS[p]); H[p, i] = act(gate, up) (see
    ``fp4_moe_kernels._act``), each GEMM output rounded to H's dtype (``fp4_moe_kernels._fp4_moe_up_kernel``'s
    contract; other ranks' pairs return at once and leave their rows of H unwritten). Each step reads BLOCK_I gate
    and BLOCK_I up rows x BLOCK_K inputs as words."""
    pdl_enter(PDL)
    G: tl.constexpr = BLOCK_K // GROUP
    p, e, ri, live, x_row, _, _, _, _ = _up_pair(X, IDS, GU, GUS, inter, n_local, stride_x, stride_ge, stride_gn,
                                                 stride_gse, stride_gsn, TOPK, BLOCK_I)
    if e >= n_local:  # another rank's expert: its row of H is never read (the down kernel skips the slot)
        return
    ri64 = ri.to(tl.int64)
    gu = GU + e * stride_ge
    gus = GUS + e * stride_gse
    n_words = K // 8
    n_groups = tl.cdiv(K, GROUP)
    acc_g = tl.zeros([BLOCK_I, G, 4], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I, G, 4], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x0, x1, x2, x3, x4, x5, x6, x7 = _acts(x_row, k0, K, G)
        wg, sg = _words(gu, gus, ri64, live, k0, n_words, n_groups, stride_gn, stride_gsn, G)
        acc_g += _word_dot(wg, x0, x1, x2, x3, x4, x5, x6, x7) * _scale63(sg, GUS_UE8M0)[:, :, None]
        wu, su = _words(gu, gus, ri64 + inter, live, k0, n_words, n_groups, stride_gn, stride_gsn, G)
        acc_u += _word_dot(wu, x0, x1, x2, x3, x4, x5, x6, x7) * _scale63(su, GUS_UE8M0)[:, :, None]
    _store_act(H + p * stride_h, ri, inter, tl.sum(tl.sum(acc_g, axis=2), axis=1), tl.sum(tl.sum(acc_u, axis=2), axis=1),
               limit, ACT)


@triton.jit
def _fp4_moe_down_fma_kernel(H, IDS, WTS, DN, DNS, OUT, D, inter, n_local, stride_h, stride_de, stride_dd,
                             stride_dse, stride_dsd, stride_o, TOPK: tl.constexpr, TOPK_P2: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_I: tl.constexpr, PDL: tl.constexpr,
                             DNS_UE8M0: tl.constexpr):
    """Program (t, d-block): OUT[t] = sum_j WTS[t, j] * round(DN[e_j] @ H[t TOPK + j]) in float32, slots in order
    (``fp4_moe_kernels._fp4_moe_down_kernel``'s contract); other ranks' slots are skipped. Each (slot, chunk) step
    reads BLOCK_D rows x BLOCK_I hidden inputs as words."""
    pdl_enter(PDL)
    DT: tl.constexpr = H.dtype.element_ty
    G: tl.constexpr = BLOCK_I // GROUP
    t, rd, rd64, dmask, slots, ids, wts = _down_program(IDS, WTS, D, TOPK, TOPK_P2, BLOCK_D)
    n_chunks = tl.cdiv(inter, BLOCK_I)
    n_words = inter // 8
    n_groups = tl.cdiv(inter, GROUP)
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D, G, 4], dtype=tl.float32)
    for it in range(0, TOPK * n_chunks):
        j = it // n_chunks
        c = it % n_chunks
        e = tl.sum(tl.where(slots == j, ids, 0))
        if e < n_local:  # other ranks' experts add nothing: their slots are skipped
            x0, x1, x2, x3, x4, x5, x6, x7 = _acts(H + (t * TOPK + j) * stride_h, c * BLOCK_I, inter, G)
            w, s = _words(DN + e * stride_de, DNS + e * stride_dse, rd64, dmask, c * BLOCK_I, n_words, n_groups,
                          stride_dd, stride_dsd, G)
            acc += _word_dot(w, x0, x1, x2, x3, x4, x5, x6, x7) * _scale63(s, DNS_UE8M0)[:, :, None]
            if c == n_chunks - 1:  # the slot's last chunk: round its product, fold it in, start the next
                out, _ = _fold_slot(out, tl.sum(acc, axis=2), slots, j, wts, DT)
                acc = tl.zeros([BLOCK_D, G, 4], dtype=tl.float32)
    tl.store(OUT + t * stride_o + rd, out.to(OUT.dtype.element_ty), mask=dmask)
