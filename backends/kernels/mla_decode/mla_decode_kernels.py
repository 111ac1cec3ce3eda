"""Triton kernels for absorbed-MLA decode over a paged latent KV cache (split-KV, two stages).

Only ``@triton.jit`` code lives here; the launcher is :mod:`backends.kernels.mla_decode.mla_decode`.

Layout (one layer): ``kv[num_pages, page_size, D_CKV + D_PE]``; a row is one token, its first ``D_CKV``
values are the latent ``ckv`` (also the value), the last ``D_PE`` the rope key ``kpe``. Token ``t`` of request
``b`` lives at ``kv[page_table[b, t // page_size], t % page_size]``.

Scores are ``(q_nope . ckv + q_pe . kpe) * sm_scale``; the kernels work in base 2 internally
(``qk_scale = sm_scale * log2(e)``) and store natural-log LSEs.

Decode work plan (token-balanced, computed on the GPU from ``seq_lens`` alone, so CUDA graphs replay it for
any lengths). The batch is laid end to end in one *global token space*: request ``b`` occupies
``[s_b, s_b + pad_b)`` with ``pad_b = cdiv(len_b, BLOCK_N) * BLOCK_N`` and ``s_b`` the exclusive prefix sum of
the ``pad``. That space (``T = sum(pad)``) is cut into ``num_programs`` equal chunks of ``chunk =
max(min_chunk, roundup(cdiv(T, num_programs), BLOCK_N))`` tokens; stage-1 program ``p`` handles every
(request, token range) piece that falls in ``[p * chunk, (p + 1) * chunk)`` -- several short requests, or a
slice of a long one -- so all programs do the same amount of work whatever the length distribution. When all
non-empty requests have the same padded length and rounding the chunk up to a multiple of it costs at most 1/8
more tokens, the chunk is rounded up (``snap``): equal lengths are then cut at request boundaries.

A request that lies inside one chunk is finished by its program (written to ``out``). A request cut by chunk
boundaries is "split": its pieces (programs ``p0 .. p1``, ``p0 = s_b // chunk``, ``p1 = (s_b + pad_b - 1) //
chunk``) write normalized partial outputs and LSEs to consecutive workspace *slots* ``base_b .. base_b + p1 -
p0``, where ``base_b`` is the number of split pieces of the requests before ``b`` (a flat slot space shared
by the whole batch; at most ``min(2 * (num_programs - 1), num_programs - 1 + B)`` slots are used). Slot ``j``
lives at ``[j // slot_div, h, j % slot_div]`` of the workspace. The merge kernel recomputes the same plan
and combines the pieces of each split request.

The shared tile loop ``_mla_attn_loop`` is also used by the extend kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from backends.kernels.pdl import pdl_enter

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
#: Stage 1 calls the per-piece body (_decode_piece) as a real function: inlined into the loop over pieces,
#: its loop invariants were hoisted and kept live across that loop (ptxas, Triton 3.6, sm_90: block_h 16 went
#: from 107 to 150 registers, block_h 64 from 64 to 504 bytes of spills).
_PIECE_NOINLINE = True


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b in fp32. UPCAST feeds fp32 operands to tl.dot (the CPU interpreter computes bf16 dots wrong)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _mm_acc(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _mla_attn_loop(
    q,  # [BLOCK_M, D_CKV] in kv dtype
    qpe,  # [BLOCK_M, D_PE] in kv dtype
    m_i,  # [BLOCK_M] fp32 running max (base-2 domain)
    l_i,  # [BLOCK_M] fp32 running sum
    acc,  # [BLOCK_M, D_CKV] fp32
    KV,
    PT_row,  # pointer to page_table[b, 0]
    stride_kv_p,
    stride_kv_t,
    lo,
    hi,
    limit,  # [BLOCK_M] inclusive causal limit per row (used only when CAUSAL)
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_CKV: tl.constexpr,
    D_PE: tl.constexpr,
    MASK_N: tl.constexpr,  # keys >= hi may appear in a tile
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax over keys [lo, hi) of one request. lo must be a multiple of BLOCK_N when
    PAGE_SIZE % BLOCK_N == 0 (a tile then lies in one page and its page id is a scalar load). KV tiles are
    converted to q's dtype after the load: an fp8 cache is dequantized there, its per-tensor scale folded into
    qk_scale and the output scale by the caller."""
    offs_d = tl.arange(0, D_CKV)
    offs_pe = tl.arange(0, D_PE)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        if PAGE_SIZE % BLOCK_N == 0:
            page = tl.load(PT_row + n0 // PAGE_SIZE).to(tl.int64)
            row_off = page * stride_kv_p + (offs_n % PAGE_SIZE) * stride_kv_t
        else:
            if MASK_N:
                page = tl.load(PT_row + offs_n // PAGE_SIZE, mask=mask_n, other=0)
            else:
                page = tl.load(PT_row + offs_n // PAGE_SIZE)
            row_off = page.to(tl.int64) * stride_kv_p + (offs_n % PAGE_SIZE) * stride_kv_t
        kv_ptrs = KV + row_off[:, None] + offs_d[None, :]
        pe_ptrs = KV + row_off[:, None] + D_CKV + offs_pe[None, :]
        if MASK_N:
            kv = tl.load(kv_ptrs, mask=mask_n[:, None], other=0.0)
            kpe = tl.load(pe_ptrs, mask=mask_n[:, None], other=0.0)
        else:
            kv = tl.load(kv_ptrs)
            kpe = tl.load(pe_ptrs)
        kv = kv.to(q.dtype)  # an fp8 cache is read as fp8 and widened here (its scale is folded by the caller)
        kpe = kpe.to(q.dtype)

        qk = _mm(q, tl.trans(kv), PREC, UPCAST)
        qk += _mm(qpe, tl.trans(kpe), PREC, UPCAST)
        qk = qk * qk_scale
        if CAUSAL:
            keep = (offs_n[None, :] <= limit[:, None]) & mask_n[None, :]
            qk = tl.where(keep, qk, float("-inf"))
        elif MASK_N:
            qk = tl.where(mask_n[None, :], qk, float("-inf"))

        # Every row has a finite m_i after the first tile it sees (see callers), so no (-inf) - (-inf).
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = _mm_acc(p.to(kv.dtype), kv, acc, PREC, UPCAST)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _lengths_total(SL, num_reqs, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """seq_lens[0:BLOCK_B] (reused by _requests_before: one load fewer when batch <= BLOCK_B), the global token
    space length sum_b pad_b (pad_b = roundup(seq_lens[b], BLOCK_N)), and whether all non-empty requests
    have the same pad (then that pad, else 0)."""
    offs = tl.arange(0, BLOCK_B)
    lens0 = tl.load(SL + offs, mask=offs < num_reqs, other=0)
    pad = tl.cdiv(lens0, BLOCK_N) * BLOCK_N
    total = tl.sum(pad, 0)
    pad_max = tl.max(pad, 0)
    pad_min = tl.min(tl.where(pad > 0, pad, 2147483647), 0)
    for i in range(BLOCK_B, num_reqs, BLOCK_B):
        offs = i + tl.arange(0, BLOCK_B)
        lens = tl.load(SL + offs, mask=offs < num_reqs, other=0)
        pad = tl.cdiv(lens, BLOCK_N) * BLOCK_N
        total += tl.sum(pad, 0)
        pad_max = tl.maximum(pad_max, tl.max(pad, 0))
        pad_min = tl.minimum(pad_min, tl.min(tl.where(pad > 0, pad, 2147483647), 0))
    return lens0, total, tl.where(pad_min == pad_max, pad_max, 0)


@triton.jit
def _chunk_len(total, num_programs, min_chunk, snap, equal_pad, BLOCK_N: tl.constexpr):
    """Tokens of the global token space per stage-1 program: a multiple of BLOCK_N, >= min_chunk. With snap,
    when every non-empty request has the same padded length (equal_pad > 0) and rounding the chunk up to a
    multiple of it costs at most 1/8 more tokens per program, it is rounded up: the batch is then cut at
    request boundaries (no split pieces, no partial outputs, no merge work)."""
    c = tl.cdiv(tl.cdiv(total, num_programs), BLOCK_N) * BLOCK_N
    c = tl.maximum(tl.maximum(c, min_chunk), BLOCK_N)
    r = tl.cdiv(c, tl.maximum(equal_pad, 1)) * equal_pad
    return tl.where((snap != 0) & (equal_pad > 0) & (8 * r <= 9 * c), r, c)


@triton.jit
def _span(s, lens, chunk, BLOCK_N: tl.constexpr):
    """Request(s) of ``lens`` tokens starting at global token ``s``: the padded end, the first and last chunk it
    overlaps (p0, p1), and the split pieces it takes in the slot space (0: one chunk holds it, or it is empty)."""
    e = s + tl.cdiv(lens, BLOCK_N) * BLOCK_N
    p0 = s // chunk
    p1 = tl.maximum(e - 1, 0) // chunk
    return e, p0, p1, tl.where((lens > 0) & (p1 > p0), p1 - p0 + 1, 0)


@triton.jit
def _block_stats(offs, lens, carry, num_reqs, limit_b, limit_t, end_t, chunk, BLOCK_N: tl.constexpr):
    valid = offs < num_reqs
    pad = tl.cdiv(lens, BLOCK_N) * BLOCK_N
    s = tl.cumsum(pad, 0) + carry - pad
    e, p0, p1, pieces = _span(s, lens, chunk, BLOCK_N)
    before = valid & (offs < limit_b) & (e <= limit_t)
    n_before = tl.sum(before.to(tl.int32), 0)
    t_before = tl.sum(tl.where(before, pad, 0), 0)
    slots_before = tl.sum(tl.where(before, pieces, 0), 0)
    n_start = tl.sum((valid & (s < end_t)).to(tl.int32), 0)
    return n_before, t_before, slots_before, n_start, tl.sum(pad, 0)


@triton.jit
def _requests_before(
    lens0, SL, num_reqs, limit_b, limit_t, end_t, chunk, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr
):  # fmt: skip
    """Over the requests b < limit_b that end at or before global token limit_t (a prefix of the batch):
    (how many, their padded tokens = start of the next one, their split pieces = its first slot), and the
    number of requests that start before global token end_t. lens0: seq_lens[0:BLOCK_B]."""
    n_before, t_before, slots_before, n_start, carry = _block_stats(
        tl.arange(0, BLOCK_B), lens0, limit_t * 0, num_reqs, limit_b, limit_t, end_t, chunk, BLOCK_N
    )
    for i in range(BLOCK_B, num_reqs, BLOCK_B):
        offs = i + tl.arange(0, BLOCK_B)
        lens = tl.load(SL + offs, mask=offs < num_reqs, other=0)
        nb, tb, sb, ns, tot = _block_stats(offs, lens, carry, num_reqs, limit_b, limit_t, end_t, chunk, BLOCK_N)
        n_before += nb
        t_before += tb
        slots_before += sb
        n_start += ns
        carry += tot
    return n_before, t_before, slots_before, n_start


@triton.jit
def _mla_attn_loop_tma(
    q_lo,  # [BLOCK_H, D_CKV // 2] in kv dtype
    q_hi,  # [BLOCK_H, D_CKV // 2]
    qpe,  # [BLOCK_H, D_PE]
    m_i,
    l_i,
    acc_lo,  # [BLOCK_H, D_CKV // 2] fp32 (output columns 0 .. D_CKV / 2)
    acc_hi,  # [BLOCK_H, D_CKV // 2] fp32
    DESC_C,  # TMA descriptor over kv rows [pages * PAGE_SIZE, D_CKV + D_PE], block [BLOCK_N, D_CKV // 2]
    DESC_PE,  # same rows, block [BLOCK_N, D_PE]
    PT_row,
    lo,
    hi,
    qk_scale,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_CKV: tl.constexpr,
    MASK_N: tl.constexpr,
):
    """_mla_attn_loop with TMA tile loads (no per-thread address tensors, so fewer registers). A tile lies in
    one page (PAGE_SIZE % BLOCK_N == 0) and is BLOCK_N consecutive rows of the cache; the latent row is
    loaded as two halves (a TMA box is at most 256 wide). With MASK_N, rows >= hi (other tokens of the page,
    possibly never written) are zeroed before they reach the P @ V product."""
    D_HALF: tl.constexpr = D_CKV // 2
    for n0 in range(lo, hi, BLOCK_N):
        page = tl.load(PT_row + n0 // PAGE_SIZE)
        row = page * PAGE_SIZE + n0 % PAGE_SIZE
        k_lo = DESC_C.load([row, 0]).to(q_lo.dtype)
        k_hi = DESC_C.load([row, D_HALF]).to(q_lo.dtype)
        kpe = DESC_PE.load([row, D_CKV]).to(q_lo.dtype)
        if MASK_N:
            keep = (n0 + tl.arange(0, BLOCK_N)) < hi
            k_lo = tl.where(keep[:, None], k_lo, 0.0).to(k_lo.dtype)
            k_hi = tl.where(keep[:, None], k_hi, 0.0).to(k_hi.dtype)
            kpe = tl.where(keep[:, None], kpe, 0.0).to(kpe.dtype)
        qk = tl.dot(q_lo, tl.trans(k_lo))
        qk = tl.dot(q_hi, tl.trans(k_hi), qk)
        qk = tl.dot(qpe, tl.trans(kpe), qk)
        qk = qk * qk_scale
        if MASK_N:
            qk = tl.where(keep[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pb = p.to(k_lo.dtype)
        acc_lo = tl.dot(pb, k_lo, acc_lo * alpha[:, None])
        acc_hi = tl.dot(pb, k_hi, acc_hi * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc_lo, acc_hi


@triton.jit
def _q_to(x, CDT: tl.constexpr):
    """q in the products' dtype. Over an fp8 cache a bf16 q runs in fp16 (the cache widens to fp16 in one
    instruction): values past fp16's range (65504) are clamped there instead of becoming inf."""
    if CDT == tl.float16 and x.dtype == tl.bfloat16:
        x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0)
    return x.to(CDT)


@triton.jit
def _store_piece(
    o, m_i, l_i, cols, offs_h, mask_h, b64, split, slot, slot_div, PO, PL, OUT,
    stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h,
    WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """o: [BLOCK_H, len(cols)] normalized output of one piece -> OUT (the whole request) or workspace slot."""
    if split:
        ws_b = (slot // slot_div).to(tl.int64)
        ws_s = slot % slot_div
        po_ptrs = PO + ws_b * stride_po_b + offs_h[:, None] * stride_po_h + ws_s * stride_po_s + cols[None, :]
        tl.store(po_ptrs, o, mask=mask_h[:, None])
        if WRITE_LSE:
            lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
            tl.store(PL + ws_b * stride_pl_b + offs_h * stride_pl_h + ws_s * stride_pl_s, lse, mask=mask_h)
    else:
        o_ptrs = OUT + b64 * stride_o_b + offs_h[:, None] * stride_o_h + cols[None, :]
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=mask_h[:, None])


@triton.jit(noinline=_PIECE_NOINLINE)
def _decode_piece(
    QN, QP, KV, DESC_C, DESC_PE, PT, PO, PL, OUT, qk_scale, out_scale, b64, start, end, split, slot, slot_div, pid_h, H,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_kv_p, stride_kv_t, stride_pt_b, stride_po_b,
    stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h,
    PAGE_SIZE: tl.constexpr, D_CKV: tl.constexpr, D_PE: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
    KV_FP8: tl.constexpr,
):  # fmt: skip
    """Tokens [start, end) of request b64 for BLOCK_H heads -> OUT (split False) or workspace slot. With an
    fp8 cache (KV_FP8) the products run in fp16 (fp32 for an fp32 q; see _q_to) and ``out_scale`` (the cache
    scale) rescales the output."""
    if KV_FP8:
        if QN.dtype.element_ty == tl.float32:
            CDT: tl.constexpr = tl.float32
        else:  # e4m3 -> fp16 is one cvt per two values on sm_89+; -> bf16 goes through fp32
            CDT: tl.constexpr = tl.float16
    else:
        CDT: tl.constexpr = KV.dtype.element_ty
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_pe = tl.arange(0, D_PE)
    PT_row = PT + b64 * stride_pt_b
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    qpe = tl.load(
        QP + b64 * stride_qp_b + offs_h[:, None] * stride_qp_h + offs_pe[None, :],
        mask=mask_h[:, None],
        other=0.0,
    )
    qpe = _q_to(qpe, CDT)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if USE_TMA:
        D_HALF: tl.constexpr = D_CKV // 2
        cols = tl.arange(0, D_HALF)
        q_base = QN + b64 * stride_qn_b + offs_h[:, None] * stride_qn_h + cols[None, :]
        q_lo = _q_to(tl.load(q_base, mask=mask_h[:, None], other=0.0), CDT)
        q_hi = _q_to(tl.load(q_base + D_HALF, mask=mask_h[:, None], other=0.0), CDT)
        acc_lo = tl.zeros([BLOCK_H, D_HALF], dtype=tl.float32)
        acc_hi = tl.zeros([BLOCK_H, D_HALF], dtype=tl.float32)
        m_i, l_i, acc_lo, acc_hi = _mla_attn_loop_tma(
            q_lo, q_hi, qpe, m_i, l_i, acc_lo, acc_hi, DESC_C, DESC_PE, PT_row, start, full_end,
            qk_scale, PAGE_SIZE, BLOCK_N, D_CKV, MASK_N=False,
        )  # fmt: skip
        m_i, l_i, acc_lo, acc_hi = _mla_attn_loop_tma(
            q_lo, q_hi, qpe, m_i, l_i, acc_lo, acc_hi, DESC_C, DESC_PE, PT_row, full_end, end,
            qk_scale, PAGE_SIZE, BLOCK_N, D_CKV, MASK_N=True,
        )  # fmt: skip
        _store_piece(
            acc_lo * (out_scale / l_i)[:, None], m_i, l_i, cols, offs_h, mask_h, b64, split, slot, slot_div, PO, PL,
            OUT, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s,
            stride_o_b, stride_o_h, WRITE_LSE=True,
        )  # fmt: skip
        _store_piece(
            acc_hi * (out_scale / l_i)[:, None], m_i, l_i, cols + D_HALF, offs_h, mask_h, b64, split, slot, slot_div,
            PO, PL, OUT, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s,
            stride_o_b, stride_o_h, WRITE_LSE=False,
        )  # fmt: skip
    else:
        offs_d = tl.arange(0, D_CKV)
        q = tl.load(
            QN + b64 * stride_qn_b + offs_h[:, None] * stride_qn_h + offs_d[None, :],
            mask=mask_h[:, None],
            other=0.0,
        )
        q = _q_to(q, CDT)
        acc = tl.zeros([BLOCK_H, D_CKV], dtype=tl.float32)
        m_i, l_i, acc = _mla_attn_loop(
            q, qpe, m_i, l_i, acc, KV, PT_row, stride_kv_p, stride_kv_t, start, full_end, m_i, qk_scale,
            PAGE_SIZE, BLOCK_N, D_CKV, D_PE, MASK_N=False, CAUSAL=False, PREC=PREC, UPCAST=UPCAST,
        )  # fmt: skip
        m_i, l_i, acc = _mla_attn_loop(
            q, qpe, m_i, l_i, acc, KV, PT_row, stride_kv_p, stride_kv_t, full_end, end, m_i, qk_scale,
            PAGE_SIZE, BLOCK_N, D_CKV, D_PE, MASK_N=True, CAUSAL=False, PREC=PREC, UPCAST=UPCAST,
        )  # fmt: skip
        _store_piece(
            acc * (out_scale / l_i)[:, None], m_i, l_i, offs_d, offs_h, mask_h, b64, split, slot, slot_div, PO, PL, OUT,
            stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b,
            stride_o_h, WRITE_LSE=True,
        )  # fmt: skip


# Scalars that change with the batch are not specialized, so a new batch size never triggers a recompile
# (which would break CUDA-graph capture); strides keep Triton's divisibility specialization.
@triton.jit(do_not_specialize=["H", "num_reqs", "num_programs", "min_chunk", "snap", "slot_div"])
def _mla_decode_stage1_kernel(
    QN,
    QP,
    KV,
    DESC_C,
    DESC_PE,
    PT,
    SL,
    PO,
    PL,
    OUT,
    qk_scale,
    out_scale,
    stride_qn_b,
    stride_qn_h,
    stride_qp_b,
    stride_qp_h,
    stride_kv_p,
    stride_kv_t,
    stride_pt_b,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    stride_pl_s,
    stride_o_b,
    stride_o_h,
    H,
    num_reqs,
    num_programs,
    min_chunk,
    snap,
    slot_div,
    PAGE_SIZE: tl.constexpr,
    D_CKV: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    USE_TMA: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """grid (cdiv(H, BLOCK_H), num_programs). Program (h, p): BLOCK_H heads, global tokens
    [p * chunk, (p + 1) * chunk) (see the module doc). The head block varies fastest, so the programs that
    read the same KV tiles run together (L2 hits). USE_TMA loads KV tiles through DESC_C / DESC_PE (bf16 /
    fp16 caches with PAGE_SIZE % BLOCK_N == 0); otherwise through pointers from KV."""
    pdl_enter(PDL)
    pid_h = tl.program_id(0)
    pid_p = tl.program_id(1)

    lens0, total, equal_pad = _lengths_total(SL, num_reqs, BLOCK_N, BLOCK_B)
    chunk = _chunk_len(total, num_programs, min_chunk, snap, equal_pad, BLOCK_N)
    lo_g = pid_p * chunk
    if lo_g < total:
        hi_g = tl.minimum(lo_g + chunk, total)
        b0, s_b, slot0, b_end = _requests_before(lens0, SL, num_reqs, num_reqs, lo_g, hi_g, chunk, BLOCK_N, BLOCK_B)
        for b in range(b0, b_end):  # the requests that overlap [lo_g, hi_g)
            seq_len = tl.load(SL + b)
            e_b, p0, p1, pieces = _span(s_b, seq_len, chunk, BLOCK_N)
            # local token range of this piece: start is a multiple of BLOCK_N, end may be ragged
            start = tl.maximum(lo_g, s_b) - s_b
            end = tl.minimum(tl.minimum(hi_g, e_b) - s_b, seq_len)
            split = p1 > p0
            slot = slot0 + (pid_p - p0)
            if start < end:
                _decode_piece(
                    QN, QP, KV, DESC_C, DESC_PE, PT, PO, PL, OUT, qk_scale, out_scale, (s_b * 0 + b).to(tl.int64),
                    start, end,
                    split, slot, slot_div, pid_h, H, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_kv_p,
                    stride_kv_t, stride_pt_b, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h,
                    stride_pl_s, stride_o_b, stride_o_h, PAGE_SIZE, D_CKV, D_PE, BLOCK_H, BLOCK_N, PREC, UPCAST,
                    USE_TMA, KV_FP8,
                )  # fmt: skip
            slot0 += pieces
            s_b = e_b


@triton.jit
def _merge_pieces(
    PO, PL, o_ptrs, slot0, n_pieces, offs_h, mask_h, offs_d, stride_po_b, stride_po_h, stride_po_s, stride_pl_b,
    stride_pl_h, stride_pl_s, slot_div, BLOCK_S: tl.constexpr, BLOCK_HM: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """Merge ``n_pieces`` (>= 1) partial outputs from flat slot ``slot0`` on (rows ``offs_h``, columns ``offs_d``)
    by their LSEs into ``o_ptrs``, BLOCK_S pieces at a time."""
    m = tl.full([BLOCK_HM], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_HM], dtype=tl.float32)
    acc = tl.zeros([BLOCK_HM, BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, n_pieces, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask_s = offs_s < n_pieces
        slot = slot0 + offs_s
        ws_b = (slot // slot_div).to(tl.int64)
        ws_s = slot % slot_div
        mask_sh = mask_s[:, None] & mask_h[None, :]
        lse = tl.load(
            PL + ws_b[:, None] * stride_pl_b + offs_h[None, :] * stride_pl_h + ws_s[:, None] * stride_pl_s,
            mask=mask_sh,
            other=0.0,
        )
        # pieces past the end weigh 0; offs_s[0] < n_pieces so every head's m_new is finite
        lse = tl.where(mask_s[:, None], lse, float("-inf"))
        o = tl.load(
            PO
            + ws_b[:, None, None] * stride_po_b
            + offs_h[None, :, None] * stride_po_h
            + ws_s[:, None, None] * stride_po_s
            + offs_d[None, None, :],
            mask=mask_sh[:, :, None],
            other=0.0,
        )
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new[None, :])
        l = l * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        m = m_new
    res = acc / l[:, None]
    tl.store(o_ptrs, res.to(o_ptrs.dtype.element_ty), mask=mask_h[:, None])


@triton.jit(do_not_specialize=["H", "num_reqs", "num_programs", "min_chunk", "snap", "slot_div"])
def _mla_decode_stage2_kernel(
    PO,
    PL,
    SL,
    OUT,
    stride_po_b,
    stride_po_h,
    stride_po_s,
    stride_pl_b,
    stride_pl_h,
    stride_pl_s,
    stride_o_b,
    stride_o_h,
    H,
    num_reqs,
    num_programs,
    min_chunk,
    snap,
    slot_div,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_HM: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
):
    """grid (B, cdiv(H, BLOCK_HM), D_CKV // BLOCK_DV): merge the pieces of split request b with their LSEs,
    BLOCK_S pieces x BLOCK_HM heads x BLOCK_DV columns at a time, recomputing the plan. Requests finished by stage 1
    are skipped; a request with no keys gets zeros. (The wgmma path merges from its plan's rows instead:
    :mod:`backends.kernels.mla_decode.mla_decode_plan_kernels`.)"""
    pdl_enter(PDL)
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_d = tl.program_id(2)

    seq_len = tl.load(SL + pid_b)
    offs_h = pid_h * BLOCK_HM + tl.arange(0, BLOCK_HM)
    mask_h = offs_h < H
    offs_d = pid_d * BLOCK_DV + tl.arange(0, BLOCK_DV)
    o_ptrs = OUT + pid_b.to(tl.int64) * stride_o_b + offs_h[:, None] * stride_o_h + offs_d[None, :]
    if seq_len <= 0:
        tl.store(o_ptrs, tl.zeros([BLOCK_HM, BLOCK_DV], dtype=OUT.dtype.element_ty), mask=mask_h[:, None])
    else:
        lens0, total, equal_pad = _lengths_total(SL, num_reqs, BLOCK_N, BLOCK_B)
        chunk = _chunk_len(total, num_programs, min_chunk, snap, equal_pad, BLOCK_N)
        _, s_b, slot0, _ = _requests_before(lens0, SL, num_reqs, pid_b, total, 0, chunk, BLOCK_N, BLOCK_B)
        _, p0, p1, _ = _span(s_b, seq_len, chunk, BLOCK_N)
        n_pieces = p1 - p0 + 1
        if n_pieces > 1:
            _merge_pieces(PO, PL, o_ptrs, slot0, n_pieces, offs_h, mask_h, offs_d, stride_po_b, stride_po_h,
                          stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, slot_div, BLOCK_S, BLOCK_HM,
                          BLOCK_DV)  # fmt: skip
