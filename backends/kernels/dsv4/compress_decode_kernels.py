"""Triton kernel of a V4 compressor's decode step (launcher: :mod:`backends.kernels.dsv4.compress_decode`; the torch
function it reproduces: :func:`runtime.model.dsv4.compressor.compress_decode`, then RoPE of the entry).

Two launches, so that even one request spreads over many SMs:

* :func:`_compress_mix_kernel`, grid ``(B, cdiv(DIM, BLOCK_C))``: program ``(b, cb)`` owns entry channels
  ``c = [cb * BLOCK_C, (cb + 1) * BLOCK_C)`` of request ``b``, and with them every state value those channels use:
  pending channels ``c`` (and, overlapping, ``DIM + c``: series B) and ``prev`` channels ``c``. It writes the new
  token to pending slot ``position % RATE`` of its state row, reads the window's slots (the new token's from
  registers: its store and the window's loads need no ordering), mixes them (softmax over the slots per channel in
  float32, the weighted sum) into ``OUT`` (rounded to the model dtype, as torch's sum rounds it), and for
  overlapping compressors (``OVERLAP``: width ``2 * DIM``) stores the closed window's A series as the next window's
  ``prev`` after a barrier (every warp of the program has read the old one by then). No two programs touch one
  state value of a row (rows are distinct but for the graph runner's padding row, never a live request's), so the
  in-place update needs no ordering between programs.
* :func:`_norm_rope_kernel`, grid ``(B,)``: the RMSNorm needs the whole row, so one program per request reads the
  mixed row back from ``OUT`` (after the first launch: the stream orders them, and with PDL its ``gdc_wait``),
  applies the RMSNorm and RoPE at the entry's first position, and writes the row in place.

Rounding follows the torch ops: window values and gate logits in the model dtype ``DT`` (``state.to(DT)``, the
bias added in float32 and rounded), the softmax weights, each product and the sum rounded to ``DT``, the RMSNorm
rounded once after the weight, RoPE in float32 (the launch turns off FMA contraction so that ``a * c - b * s``
rounds each product as torch does). A window longer than ``BLOCK_S`` slots runs in chunks: one pass for the max,
one for the sum of exponentials, one for the weighted sum (the exact torch softmax, not an online one).
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.libdevice_math import exp_f32 as _exp
from backends.kernels.pdl import pdl_enter


@triton.jit
def _window_gate(PG_ROW, AG_ROW, BIAS, new_g, slot, j, c, mc, stride_ps, stride_as, stride_bias,
                 RATE: tl.constexpr, OVERLAP: tl.constexpr, COFF: tl.constexpr, DT: tl.constexpr):
    """Gate logits of window slots j [S] x channels c [C] as float32: pending (slot ``slot`` = new_g) plus the
    position bias, rounded to DT; prev's A slots as stored (bias included); -inf past the window."""
    p = j  # the pending slot of window slot j (overlapping: prev's RATE A slots come first)
    if OVERLAP:
        p = j - RATE
    m2 = ((p >= 0) & (p < RATE))[:, None] & mc[None, :]
    g = tl.load(PG_ROW + p[:, None] * stride_ps + COFF + c[None, :], mask=m2, other=0.0).to(DT)
    g = tl.where((p == slot)[:, None], new_g[None, :], g)
    b = tl.load(BIAS + p[:, None] * stride_bias + COFF + c[None, :], mask=m2, other=0.0).to(DT)
    g = (g.to(tl.float32) + b.to(tl.float32)).to(DT)
    if OVERLAP:
        is_a = (j < RATE)[:, None]
        a = tl.load(AG_ROW + j[:, None] * stride_as + c[None, :], mask=is_a & mc[None, :], other=0.0)
        g = tl.where(is_a, a.to(DT), g)
    ns: tl.constexpr = 2 * RATE if OVERLAP else RATE
    return tl.where((j < ns)[:, None], g.to(tl.float32), float("-inf"))


@triton.jit
def _window_kv(PK_ROW, AK_ROW, new_kv, slot, j, c, mc, stride_ps, stride_as,
               RATE: tl.constexpr, OVERLAP: tl.constexpr, COFF: tl.constexpr, DT: tl.constexpr):
    """kv of window slots j [S] x channels c [C] in DT (as float32; 0 past the window)."""
    p = j  # the pending slot of window slot j (overlapping: prev's RATE A slots come first)
    if OVERLAP:
        p = j - RATE
    m2 = ((p >= 0) & (p < RATE))[:, None] & mc[None, :]
    kv = tl.load(PK_ROW + p[:, None] * stride_ps + COFF + c[None, :], mask=m2, other=0.0).to(DT)
    kv = tl.where((p == slot)[:, None], new_kv[None, :], kv)
    if OVERLAP:
        is_a = (j < RATE)[:, None]
        a = tl.load(AK_ROW + j[:, None] * stride_as + c[None, :], mask=is_a & mc[None, :], other=0.0)
        kv = tl.where(is_a, a.to(DT), kv)
    return kv.to(tl.float32)


@triton.jit
def _compress_mix_kernel(KV_NEW, GATE_NEW, BIAS, PKV, PGATE, AKV, AGATE, ROWS, POS, OUT,
                         stride_kn, stride_gn, stride_bias, stride_pr, stride_ps, stride_ar, stride_as, stride_out,
                         RATE: tl.constexpr, DIM: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_C: tl.constexpr,
                         BLOCK_S: tl.constexpr, LIBDEVICE: tl.constexpr, PDL: tl.constexpr):
    """Kernel 1, grid ``(B, cdiv(DIM, BLOCK_C))``: the state update and the window mix of request ``b``'s entry
    channels ``[c0, c0 + BLOCK_C)``, the mix rounded to DT into OUT (see the module docstring)."""
    pdl_enter(PDL)
    DT: tl.constexpr = OUT.dtype.element_ty
    SDT: tl.constexpr = PKV.dtype.element_ty
    NS: tl.constexpr = 2 * RATE if OVERLAP else RATE  # window slots (overlapping: prev's A, then this B)
    COFF: tl.constexpr = DIM if OVERLAP else 0  # the pending channels this entry mixes (overlapping: series B)
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = c < DIM
    row = tl.load(ROWS + b).to(tl.int64)
    slot = tl.load(POS + b).to(tl.int64) % RATE
    pk_row = PKV + row * stride_pr
    pg_row = PGATE + row * stride_pr
    ak_row = AKV + row * stride_ar
    ag_row = AGATE + row * stride_ar

    # the new token -> its pending slot; the window takes it from registers (rounded as the state holds it)
    nk = tl.load(KV_NEW + b * stride_kn + COFF + c, mask=mc, other=0.0).to(SDT)
    ng = tl.load(GATE_NEW + b * stride_gn + COFF + c, mask=mc, other=0.0).to(SDT)
    tl.store(pk_row + slot * stride_ps + COFF + c, nk, mask=mc)
    tl.store(pg_row + slot * stride_ps + COFF + c, ng, mask=mc)
    nk = nk.to(DT)
    ng = ng.to(DT)
    if OVERLAP:  # series A of the new token (the next entry's): stored, and kept for the closed-window update
        nka = tl.load(KV_NEW + b * stride_kn + c, mask=mc, other=0.0).to(SDT)
        nga = tl.load(GATE_NEW + b * stride_gn + c, mask=mc, other=0.0).to(SDT)
        tl.store(pk_row + slot * stride_ps + c, nka, mask=mc)
        tl.store(pg_row + slot * stride_ps + c, nga, mask=mc)

    # softmax over the window's slots per channel, the weighted sum (each rounding of the torch ops)
    if NS <= BLOCK_S:
        j = tl.arange(0, BLOCK_S)
        g = _window_gate(pg_row, ag_row, BIAS, ng, slot, j, c, mc, stride_ps, stride_as, stride_bias,
                         RATE, OVERLAP, COFF, DT)
        kv = _window_kv(pk_row, ak_row, nk, slot, j, c, mc, stride_ps, stride_as, RATE, OVERLAP, COFF, DT)
        e = _exp(g - tl.max(g, axis=0)[None, :], LIBDEVICE)
        w = tl.div_rn(e, tl.sum(e, axis=0)[None, :]).to(DT).to(tl.float32)
        mixed = tl.sum((kv * w).to(DT).to(tl.float32), axis=0)
    else:
        mx = tl.full([BLOCK_C], float("-inf"), tl.float32)
        for s0 in range(0, NS, BLOCK_S):
            j = s0 + tl.arange(0, BLOCK_S)
            g = _window_gate(pg_row, ag_row, BIAS, ng, slot, j, c, mc, stride_ps, stride_as, stride_bias,
                             RATE, OVERLAP, COFF, DT)
            mx = tl.maximum(mx, tl.max(g, axis=0))
        total = tl.zeros([BLOCK_C], tl.float32)
        for s0 in range(0, NS, BLOCK_S):
            j = s0 + tl.arange(0, BLOCK_S)
            g = _window_gate(pg_row, ag_row, BIAS, ng, slot, j, c, mc, stride_ps, stride_as, stride_bias,
                             RATE, OVERLAP, COFF, DT)
            total += tl.sum(_exp(g - mx[None, :], LIBDEVICE), axis=0)
        mixed = tl.zeros([BLOCK_C], tl.float32)
        for s0 in range(0, NS, BLOCK_S):
            j = s0 + tl.arange(0, BLOCK_S)
            g = _window_gate(pg_row, ag_row, BIAS, ng, slot, j, c, mc, stride_ps, stride_as, stride_bias,
                             RATE, OVERLAP, COFF, DT)
            kv = _window_kv(pk_row, ak_row, nk, slot, j, c, mc, stride_ps, stride_as, RATE, OVERLAP, COFF, DT)
            w = tl.div_rn(_exp(g - mx[None, :], LIBDEVICE), total[None, :]).to(DT).to(tl.float32)
            mixed += tl.sum((kv * w).to(DT).to(tl.float32), axis=0)
    tl.store(OUT + b * stride_out + c, mixed.to(DT), mask=mc)  # the torch sum's one rounding: exact in DT

    if OVERLAP:  # a closed window's A series (gate with bias) becomes prev, once every warp has read the old one
        tl.debug_barrier()
        n_a = tl.where(slot == RATE - 1, RATE, 0)  # slots to move: all of a closed window's, else none
        for s0 in range(0, RATE, BLOCK_S):
            j = s0 + tl.arange(0, BLOCK_S)
            m2 = (j < n_a)[:, None] & mc[None, :]
            new = (j == slot)[:, None]
            kv_a = tl.load(pk_row + j[:, None] * stride_ps + c[None, :], mask=m2, other=0.0).to(DT)
            kv_a = tl.where(new, nka.to(DT)[None, :], kv_a)
            g_a = tl.load(pg_row + j[:, None] * stride_ps + c[None, :], mask=m2, other=0.0).to(DT)
            g_a = tl.where(new, nga.to(DT)[None, :], g_a)
            bias = tl.load(BIAS + j[:, None] * stride_bias + c[None, :], mask=m2, other=0.0).to(DT)
            g_a = (g_a.to(tl.float32) + bias.to(tl.float32)).to(DT)
            tl.store(ak_row + j[:, None] * stride_as + c[None, :], kv_a.to(SDT), mask=m2)
            tl.store(ag_row + j[:, None] * stride_as + c[None, :], g_a.to(SDT), mask=m2)


@triton.jit
def _norm_rope_kernel(NORM_W, POS, INV_FREQ, OUT, stride_out, eps, attention_factor,
                      RATE: tl.constexpr, DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                      PDL: tl.constexpr):
    """Kernel 2, grid ``(B,)``: request ``b``'s mixed row of OUT, in place: RMSNorm over all ``DIM`` channels, then
    RoPE (see the module docstring)."""
    pdl_enter(PDL)
    DT: tl.constexpr = OUT.dtype.element_ty
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int64)
    c = tl.arange(0, BLOCK_D)
    mc = c < DIM
    x = tl.load(OUT + b * stride_out + c, mask=mc, other=0.0).to(tl.float32)

    # RMSNorm: (weight * (x * rsqrt(mean(x^2) + eps))) rounded once
    r = tl.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    y = (tl.load(NORM_W + c, mask=mc, other=0.0).to(tl.float32) * (x * r)).to(DT)

    # RoPE of the last 2 * HALF channels (interleaved pairs) at the entry's first position, in float32
    if HALF > 0:
        ev, od = tl.split(tl.reshape(y.to(tl.float32), (BLOCK_D // 2, 2)))
        k = tl.arange(0, BLOCK_D // 2) - (DIM // 2 - HALF)
        f = tl.load(INV_FREQ + k, mask=(k >= 0) & (k < HALF), other=0.0)
        ang = (pos // RATE * RATE).to(tl.float32) * f
        cs = tl.cos(ang) * attention_factor
        sn = tl.sin(ang) * attention_factor
        rot = tl.reshape(tl.join(ev * cs - od * sn, od * cs + ev * sn), (BLOCK_D,))
        y = tl.where(c >= DIM - 2 * HALF, rot.to(DT), y)
    tl.store(OUT + b * stride_out + c, y, mask=mc)  # every store depends on r, so on every load of the row
