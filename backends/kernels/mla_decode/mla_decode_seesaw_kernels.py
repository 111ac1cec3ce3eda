"""Gluon stage-1 kernel of the absorbed-MLA decode for 64 heads per program, two warpgroups in a "seesaw" (Hopper,
bf16 / fp16 cache): the schedule FlashMLA uses on Hopper, written here in Gluon's warp specialization.

Why: in :mod:`backends.kernels.mla_decode.mla_decode_wgmma_kernels` both warpgroups share every tile (each computes the
scores of 32 of its 64 tokens and half the output columns), so they run in lock step: the tensor cores wait while both
do the softmax and its cross-warpgroup reductions, and each score product is ``m64n32`` with q read from shared
memory, which is bound by shared-memory reads (3 KiB per 64 K multiply-adds). Here the tiles go in pairs and each
warpgroup has its own:

* warpgroup A (the default partition) computes the scores of the pair's first tile (``m64n64``, whole rows), its
  softmax and the output columns 0..255; warpgroup B (a worker partition) the second tile and columns 256..511;
* each hands the other its probabilities (``P``, into the tile's rope slot of shared memory, free once the scores
  are done) and its row max (64 floats): B's softmax starts from A's max, A rescales by B's; each multiplies its
  own ``P`` from registers and the other's from shared memory;
* while one warpgroup runs its softmax, the other's products keep the tensor cores busy.

Loads: each tile comes in three TMA boxes (latent halves and rope part), each on its own barrier, so the scores
start on the first half while the rest lands. A box of the next pair is issued by the warpgroup that reads it last,
right after that read: the latent half ``lo`` of both tiles and the rope slot of the second by A, the rest by B.
No stage is held back for prefetching: 72 KiB of q + 2 x 72 KiB of tiles, 216 KiB in all.

The plan (which requests and token ranges a program handles) and the outputs (finished requests to ``out``, split
pieces to workspace slots) are the 64-head kernel's; every split request is left to the merge kernel.

Measured on an H100 (CUDA-graph replays, plan reused; docs/kernels.md): 128 heads 64 x 4096 151.7 us (fa3
145.0), 64 x 32768 1053.6 (fa3 1189.3), 128 x varied 8192 632.3 (fa3 777.7); the lock-step kernel took 199.5,
1531.6 and 771.2 in an earlier call; slower at 64 heads (see ``SEESAW_MIN_HEADS`` in
:mod:`backends.kernels.mla_decode.mla_decode_wgmma`). 255 registers, no spills, 222,572 bytes of shared memory. The
score products read q and the tile at an index the compiler cannot fold (:func:`_tile_scores`): with fixed indices their
wgmma descriptors were hoisted out of the pair loop and 308 bytes spilled in warpgroup A (64 x 32768: 1148.6-1211.4
us then).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from backends.kernels.mla_decode.mla_decode_wgmma_kernels import (
    _hand_over,
    _load_q,
    _opaque_zero,
    _request_span,
    _store_half,
    _work_row,
    _zero_rows_past,
)

#: Warps of each warpgroup (the default partition and the worker), and the worker's registers per thread.
SEESAW_WARPS = gl.constexpr(4)
SEESAW_REGS = gl.constexpr(240)
# barrier slots: 0-5 the boxes of the two tiles (tile t*3 + lo / hi / rope), then the hand-overs
_A_READY = gl.constexpr(6)
_B_READY = gl.constexpr(7)
_Q_READY = gl.constexpr(8)
_LA_READY = gl.constexpr(9)
_LB_READY = gl.constexpr(10)
_BARRIERS = gl.constexpr(11)


@gluon.jit
def _issue_box(desc, dst, bar, PT_row, n, col, PAGE_SIZE: gl.constexpr):
    """One TMA box (the tile at request token n, columns col ..) into dst, completing on bar."""
    page = gl.load(PT_row + n // PAGE_SIZE)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [page * PAGE_SIZE + n % PAGE_SIZE, col], bar, dst)


@gluon.constexpr_function
def _s_layout(BLOCK_N, num_warps):
    """One warpgroup's score tile [64 heads, BLOCK_N tokens] (whole rows per warpgroup)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])


@gluon.constexpr_function
def _o_layout(D_HALF, num_warps):
    """One warpgroup's output half [64 heads, D_HALF columns]."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D_HALF, 16])


@gluon.jit
def _tile_scores(q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, bars, t, phase, s_layout: gl.constexpr, BLOCK_H: gl.constexpr,
                 BLOCK_N: gl.constexpr):
    """q . k of the tile in slot t, each box's product issued as soon as the box has landed; waited for. q and the
    slot are indexed through an opaque 0, so their operand descriptors are built here, per tile, instead of being
    hoisted out of the loop and kept live (spilled) across it."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    z = _opaque_zero()
    t = t + z
    mbarrier.wait(bars.index(3 * t), phase)
    s = warpgroup_mma(q_lo.index(z), kv_lo.index(t).permute((1, 0)), s, use_acc=False, is_async=True)
    mbarrier.wait(bars.index(3 * t + 1), phase)
    s = warpgroup_mma(q_hi.index(z), kv_hi.index(t).permute((1, 0)), s, is_async=True)
    mbarrier.wait(bars.index(3 * t + 2), phase)
    s = warpgroup_mma(q_pe.index(z), kv_pe.index(t).permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(s,))


@gluon.jit
def _zero_past(buf, valid, BLOCK_N: gl.constexpr, D_HALF: gl.constexpr, num_warps: gl.constexpr):
    """A latent half of a ragged last tile: rows past the request's end (never-written pool memory, possibly NaN)
    set to 0 before P @ V reads them."""
    if valid < BLOCK_N:
        _zero_rows_past(buf, valid, BLOCK_N, D_HALF, num_warps)
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _finish(
    o, m, l_own, s_l_own, s_l_other, bars, own_slot, other_slot, phase, cols0, out_scale, b64, split, slot,
    slot_div, h0, PO, PL, OUT, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s,
    stride_o_b, stride_o_h, WRITE_LSE: gl.constexpr, BLOCK_H: gl.constexpr, D_HALF: gl.constexpr,
    o_layout: gl.constexpr, s_layout: gl.constexpr,
):  # fmt: skip
    """A piece's end: the row sums of both warpgroups exchanged, this warpgroup's half of the output normalized and
    written (with the log-sum-exp by warpgroup A)."""
    s_l_own.store(l_own)
    _hand_over(bars, own_slot)
    mbarrier.wait(bars.index(other_slot), phase)
    l_sum = l_own + s_l_other.load(gl.SliceLayout(1, s_layout))
    lse = (m + gl.log2(l_sum)) * 0.6931471805599453
    inv = gl.expand_dims(gl.convert_layout(out_scale / l_sum, gl.SliceLayout(1, o_layout)), 1)
    _store_half(o * inv, lse, cols0, b64, split, slot, slot_div, h0, PO, PL, OUT, stride_po_b, stride_po_h,
                stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, WRITE_LSE, BLOCK_H,
                D_HALF, o_layout, s_layout)  # fmt: skip


@gluon.jit
def _warpgroup_a(
    QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div,
    q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, bars, s_ma, s_mb, s_la, s_lb,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Default partition: q of each piece into shared memory; each pair's first tile (slot 0): its scores and
    softmax from the running max, P handed to B; output columns 0 .. D_HALF of both tiles."""
    D_HALF: gl.constexpr = D_CKV // 2
    CDT: gl.constexpr = kv_lo.dtype
    s_layout: gl.constexpr = _s_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = _o_layout(D_HALF, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    h0 = gl.program_id(0) * BLOCK_H
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)
    pc = 0  # pairs so far (hand-over phases)
    # tiles in slot 0 so far (its boxes' barrier phases). Always equal to pc; reading pc instead raised the spills
    # from 308 to 328 bytes, and 128 heads 128 x varied 8192 measured 731.0 us against 671.6-683.1 (H100), before
    # the opaque operand indices removed the spills
    na = 0
    pk = 0  # pieces so far
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            PT_row = PT + b64 * stride_pt_b
            nt = gl.cdiv(end - start, BLOCK_N)
            # A reads slot 0's lo and slot 1's lo and rope (P of B) last: it loads them
            _issue_box(desc_c, kv_lo.index(0), bars.index(0), PT_row, start, 0, PAGE_SIZE)
            if nt > 1:
                _issue_box(desc_c, kv_lo.index(1), bars.index(3), PT_row, start + BLOCK_N, 0, PAGE_SIZE)
                _issue_box(desc_pe, kv_pe.index(1), bars.index(5), PT_row, start + BLOCK_N, 2 * D_HALF, PAGE_SIZE)
            # q: B's score products of the last piece are done (A waited for every B hand-over)
            qn = QN + b64 * stride_qn_b + h0 * stride_qn_h
            _load_q(qn, stride_qn_h, q_lo.index(0), BLOCK_H, D_HALF, CDT, num_warps)
            _load_q(qn + D_HALF, stride_qn_h, q_hi.index(0), BLOCK_H, D_HALF, CDT, num_warps)
            _load_q(QP + b64 * stride_qp_b + h0 * stride_qp_h, stride_qp_h, q_pe.index(0), BLOCK_H, D_PE, CDT,
                    num_warps)  # fmt: skip
            _hand_over(bars, _Q_READY)

            m_prev = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
            o = gl.zeros([BLOCK_H, D_HALF], gl.float32, layout=o_layout)
            for j in range(gl.cdiv(nt, 2)):
                n0 = start + 2 * j * BLOCK_N
                s = _tile_scores(q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, bars, 0, na & 1, s_layout, BLOCK_H,
                                 BLOCK_N)
                na += 1
                s = gl.where(gl.expand_dims(cols_n < end - n0, 0), s * qk_scale, gl.full_like(s, float("-inf")))
                m_a = gl.maximum(m_prev, gl.max(s, 1))
                p = gl.exp2(s - gl.expand_dims(m_a, 1))
                p16 = p.to(CDT)
                kv_pe.index(0).store(p16)  # the rope slot is read: P for B
                s_ma.store(m_a)
                _hand_over(bars, _A_READY)
                alpha = gl.exp2(m_prev - m_a)
                l_i = l_i * alpha + gl.sum(p, 1)
                _zero_past(kv_lo.index(0), end - n0, BLOCK_N, D_HALF, num_warps)
                o = warpgroup_mma(gl.convert_layout(p16, p_layout), kv_lo.index(0),
                                  o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1), is_async=True)
                mbarrier.wait(bars.index(_B_READY), pc & 1)  # B's max and P
                m_b = s_mb.load(row_s)
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                if 2 * j + 2 < nt:  # slot 0's lo is read: the next pair's first tile
                    _issue_box(desc_c, kv_lo.index(0), bars.index(0), PT_row, n0 + 2 * BLOCK_N, 0, PAGE_SIZE)
                beta = gl.exp2(m_a - m_b)
                l_i = l_i * beta
                beta_o = gl.expand_dims(gl.convert_layout(beta, row_o), 1)
                if 2 * j + 1 < nt:
                    _zero_past(kv_lo.index(1), end - n0 - BLOCK_N, BLOCK_N, D_HALF, num_warps)
                    o = warpgroup_mma(kv_pe.index(1), kv_lo.index(1), o * beta_o, is_async=True)
                    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                    if 2 * j + 3 < nt:  # slot 1's lo and rope are read: the next pair's second tile
                        nxt = n0 + 3 * BLOCK_N
                        _issue_box(desc_c, kv_lo.index(1), bars.index(3), PT_row, nxt, 0, PAGE_SIZE)
                        _issue_box(desc_pe, kv_pe.index(1), bars.index(5), PT_row, nxt, 2 * D_HALF, PAGE_SIZE)
                else:
                    o = o * beta_o
                m_prev = m_b
                pc += 1
            _finish(o, m_prev, l_i, s_la, s_lb, bars, _LA_READY, _LB_READY, pk & 1, 0, out_scale, b64, split,
                    slot0 + (pid_p - p0), slot_div, h0, PO, PL, OUT, stride_po_b, stride_po_h, stride_po_s,
                    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, True, BLOCK_H, D_HALF, o_layout,
                    s_layout)  # fmt: skip
            pk += 1
        slot0 += pieces
        s_b = e_b


@gluon.jit
def _warpgroup_b(
    PT, SL, WORK, PO, PL, OUT, desc_c, desc_pe, qk_scale, out_scale, stride_pt_b, stride_po_b, stride_po_h,
    stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div,
    q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, bars, s_ma, s_mb, s_la, s_lb,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
):  # fmt: skip
    """Worker partition: each pair's second tile (slot 1): its scores, its softmax from A's max, its P handed to A;
    output columns D_HALF .. D_CKV of both tiles. A pair without a second tile (an odd count) hands A its max back
    and P of zeros is never read."""
    num_warps: gl.constexpr = SEESAW_WARPS
    D_HALF: gl.constexpr = D_CKV // 2
    CDT: gl.constexpr = kv_lo.dtype
    s_layout: gl.constexpr = _s_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = _o_layout(D_HALF, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    h0 = gl.program_id(0) * BLOCK_H
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)
    pc = 0
    nb = 0
    pk = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            PT_row = PT + b64 * stride_pt_b
            nt = gl.cdiv(end - start, BLOCK_N)
            # B reads slot 0's hi and rope (P of A) and slot 1's hi last: it loads them
            _issue_box(desc_c, kv_hi.index(0), bars.index(1), PT_row, start, D_HALF, PAGE_SIZE)
            _issue_box(desc_pe, kv_pe.index(0), bars.index(2), PT_row, start, 2 * D_HALF, PAGE_SIZE)
            if nt > 1:
                _issue_box(desc_c, kv_hi.index(1), bars.index(4), PT_row, start + BLOCK_N, D_HALF, PAGE_SIZE)
            mbarrier.wait(bars.index(_Q_READY), pk & 1)

            m_prev = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
            l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
            o = gl.zeros([BLOCK_H, D_HALF], gl.float32, layout=o_layout)
            for j in range(gl.cdiv(nt, 2)):
                n0 = start + 2 * j * BLOCK_N
                has_b = 2 * j + 1 < nt
                if has_b:
                    s = _tile_scores(q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, bars, 1, nb & 1, s_layout,
                                     BLOCK_H, BLOCK_N)
                    nb += 1
                    keep = cols_n < end - n0 - BLOCK_N
                    s = gl.where(gl.expand_dims(keep, 0), s * qk_scale, gl.full_like(s, float("-inf")))
                else:
                    s = gl.full([BLOCK_H, BLOCK_N], float("-inf"), gl.float32, layout=s_layout)
                mbarrier.wait(bars.index(_A_READY), pc & 1)  # A's max and P
                m_a = s_ma.load(row_s)
                m_b = gl.maximum(m_a, gl.max(s, 1))
                p = gl.exp2(s - gl.expand_dims(m_b, 1))
                p16 = p.to(CDT)
                if has_b:
                    kv_pe.index(1).store(p16)  # the rope slot is read: P for A
                s_mb.store(m_b)
                _hand_over(bars, _B_READY)
                alpha = gl.exp2(m_prev - m_a)
                beta = gl.exp2(m_a - m_b)
                l_i = l_i * (alpha * beta) + gl.sum(p, 1)
                _zero_past(kv_hi.index(0), end - n0, BLOCK_N, D_HALF, num_warps)
                o = warpgroup_mma(kv_pe.index(0), kv_hi.index(0),
                                  o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1), is_async=True)
                o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                if 2 * j + 2 < nt:  # slot 0's hi and rope are read: the next pair's first tile
                    nxt = n0 + 2 * BLOCK_N
                    _issue_box(desc_c, kv_hi.index(0), bars.index(1), PT_row, nxt, D_HALF, PAGE_SIZE)
                    _issue_box(desc_pe, kv_pe.index(0), bars.index(2), PT_row, nxt, 2 * D_HALF, PAGE_SIZE)
                beta_o = gl.expand_dims(gl.convert_layout(beta, row_o), 1)
                if has_b:
                    _zero_past(kv_hi.index(1), end - n0 - BLOCK_N, BLOCK_N, D_HALF, num_warps)
                    o = warpgroup_mma(gl.convert_layout(p16, p_layout), kv_hi.index(1), o * beta_o, is_async=True)
                    o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
                    if 2 * j + 3 < nt:  # slot 1's hi is read: the next pair's second tile
                        _issue_box(desc_c, kv_hi.index(1), bars.index(4), PT_row, n0 + 3 * BLOCK_N, D_HALF, PAGE_SIZE)
                else:
                    o = o * beta_o
                m_prev = m_b
                pc += 1
            _finish(o, m_prev, l_i, s_lb, s_la, bars, _LB_READY, _LA_READY, pk & 1, D_HALF, out_scale, b64, split,
                    slot0 + (pid_p - p0), slot_div, h0, PO, PL, OUT, stride_po_b, stride_po_h, stride_po_s,
                    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, False, BLOCK_H, D_HALF, o_layout,
                    s_layout)  # fmt: skip
            pk += 1
        slot0 += pieces
        s_b = e_b


@gluon.jit(do_not_specialize=["slot_div", "num_reqs"])
def _mla_decode_seesaw_kernel(
    QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, num_reqs,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, MERGE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """grid (H // BLOCK_H, programs), the 64-head kernel's arguments: ``num_warps`` (4) warps are warpgroup A,
    :data:`SEESAW_WARPS` more warpgroup B. Split requests are all merged by the merge kernel (``MERGE`` = 0)."""
    gl.static_assert(MERGE == 0, "the seesaw kernel leaves every split request to the merge kernel")
    gl.static_assert(BLOCK_H == 64, "64 heads per program (one wgmma row block)")
    D_HALF: gl.constexpr = D_CKV // 2
    CDT: gl.constexpr = desc_c.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_HALF], CDT)
    q_lo = gl.allocate_shared_memory(CDT, [1, BLOCK_H, D_HALF], q_layout)
    q_hi = gl.allocate_shared_memory(CDT, [1, BLOCK_H, D_HALF], q_layout)
    q_pe = gl.allocate_shared_memory(CDT, [1, BLOCK_H, D_PE],
                                     gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_PE], CDT))  # fmt: skip
    kv_lo = gl.allocate_shared_memory(CDT, [2, BLOCK_N, D_HALF], desc_c.layout)
    kv_hi = gl.allocate_shared_memory(CDT, [2, BLOCK_N, D_HALF], desc_c.layout)
    kv_pe = gl.allocate_shared_memory(CDT, [2, BLOCK_N, D_PE], desc_pe.layout)  # P goes here once it is read
    rows: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    s_ma = gl.allocate_shared_memory(gl.float32, [BLOCK_H], rows)
    s_mb = gl.allocate_shared_memory(gl.float32, [BLOCK_H], rows)
    s_la = gl.allocate_shared_memory(gl.float32, [BLOCK_H], rows)
    s_lb = gl.allocate_shared_memory(gl.float32, [BLOCK_H], rows)
    bars = gl.allocate_shared_memory(gl.int64, [_BARRIERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(_BARRIERS):
        mbarrier.init(bars.index(i), count=1)
    gl.warp_specialize(
        [
            (_warpgroup_a, (
                QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale, stride_qn_b, stride_qn_h,
                stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s, stride_pl_b,
                stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe,
                bars, s_ma, s_mb, s_la, s_lb, PAGE_SIZE, D_CKV, D_PE, BLOCK_H, BLOCK_N, num_warps,
            )),
            (_warpgroup_b, (
                PT, SL, WORK, PO, PL, OUT, desc_c, desc_pe, qk_scale, out_scale, stride_pt_b, stride_po_b,
                stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div,
                q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, bars, s_ma, s_mb, s_la, s_lb, PAGE_SIZE, D_CKV, BLOCK_H,
                BLOCK_N,
            )),
        ],
        [SEESAW_WARPS],
        [SEESAW_REGS],
    )  # fmt: skip
    for i in gl.static_range(_BARRIERS):
        mbarrier.invalidate(bars.index(i))
