"""Gluon stage-1 kernel of the absorbed-MLA decode for 64 heads per program (Hopper, bf16 / fp16 / fp8 cache).

Why a separate kernel: with 64 heads per program the per-token work is a real matrix product, and Triton's
``tl.dot`` (Triton 3.6) lays the score product ``Q K^T`` out so that both warpgroups compute the same
``[64 heads, 64 tokens]`` score tile (``warpsPerCTA [8, 1]``, because the ``P @ V`` product sits in its forward
slice): 1.5x the tensor work, at about 30% of the matmul peak (docs/kernels.md). Gluon states the layouts
explicitly, so here each warpgroup computes the scores of its own 32 tokens of the tile (``warps_per_cta [4,
2]``: the token dimension split between the warpgroups), the softmax row statistics are combined across the two
warpgroups, and each warpgroup then accumulates half of the 512 output columns of both latent halves from the
whole probability tile (``P`` passed to the tensor cores from registers).

Per program (one head block of 64, one chunk of the global token space, see
:mod:`backends.kernels.mla_decode.mla_decode_kernels`): ``q`` in shared memory ([64, 256] x 2 + [64, 64]), KV tiles of
64 tokens loaded by TMA into two stages (three boxes per tile: latent halves and rope key), ``mbarrier`` completion.
The tile after the current one is in flight while the current one is multiplied. Shared memory: 72 KiB of ``q``
+ 2 x 72 KiB of KV + 8 KiB to hand ``P`` from the score layout to the operand layout = ~224 KiB, one program per
SM. The ragged last tile of a piece is zeroed past the request's end in shared memory before it is used (those
rows may be never-written pool memory, NaN, and ``0 * NaN`` in ``P @ V`` would poison the output).

The plan (which requests and token ranges a program handles) is not recomputed here: a small Triton kernel
(:mod:`backends.kernels.mla_decode.mla_decode_plan_kernels`) writes each program's first request, its global start, its
first split slot, the end of its request range, the chunk and the chunk's end; this kernel walks those requests as the
Triton stage 1 does, and writes the same outputs (finished requests to ``out``, split pieces to workspace slots),
so the Triton merge kernel combines them (reading the plan's per-request rows).

Over an fp8 (e4m3) cache the same products run in fp16: both wgmma operands share one type and ``P @ V`` reads V
transposed, which wgmma allows for 16-bit types only. Each landed tile is widened (``cvt.rn.f16x2.e4m3x2``, exact)
by the same 8 warps into one fp16 tile in shared memory (rows past the request's end zeroed there), and its stage
then takes the tile two ahead at once: 72 KiB of fp16 q + 2 x 36 KiB of fp8 stages + 72 KiB widened, the bf16
kernel's shared memory. H100: 64 heads 64 x 32768 902.4 us against the Triton fp8 stage 1's 1444.5 (the bf16
cache here: 861.8); 128 heads 1732.4 against 2792.4 (16 rows widened a step instead of 32: 1021.2 and 2038.8).
Widening tile i + 1's low latent half and rope part while ``P @ V_hi`` of tile i ran on the tensor cores measured
the same (1060.6 against 1059.9 us), so the loop keeps the simple order.

The score products read q (and, over fp8, the widened tile) at an index the compiler cannot fold
(:func:`_opaque_zero`): with fixed indices their wgmma descriptors were hoisted out of the tile loop and kept live
across it, and the registers spilled (bf16 136 bytes; fp8 616 bytes, 1486.6 against 1059.9 us at 64 heads 64 x
32768).

Measured on an H100 (docs/kernels.md): 1.5-1.9x the Triton stage 1's speed at 64 and 128 heads (bf16), 231
registers and no spills, 225,296 bytes of shared memory. Issuing each tile's P @ V and the next tile's scores
back to back (one wait, the next tile's load then issued later) measured the same or up to 2% slower, so the
loop keeps the simple order.
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


@gluon.jit
def _pdl_enter(PDL: gl.constexpr):
    """With PDL (:mod:`backends.kernels.pdl`, Triton's ``pdl_enter`` for Gluon): wait until the previous grid's
    writes (the plan kernel's work rows and counters) are visible, then let the next grid (the merge) launch. Used
    by the 16 / 32-head kernels (tokens and fp8)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _issue_tile(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, stage, row, pred, D_HALF: gl.constexpr):
    """TMA loads of one KV tile (rows row .. row + BLOCK_N of the cache) into ``stage``, completing on its barrier."""
    bar = bars.index(stage)
    nbytes: gl.constexpr = 2 * desc_c.block_type.nbytes + desc_pe.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc_c, [row, 0], bar, kv_lo.index(stage), pred=pred)
    tma.async_copy_global_to_shared(desc_c, [row, D_HALF], bar, kv_hi.index(stage), pred=pred)
    tma.async_copy_global_to_shared(desc_pe, [row, 2 * D_HALF], bar, kv_pe.index(stage), pred=pred)


@gluon.jit
def _zero_rows_past(buf, valid, BLOCK_N: gl.constexpr, COLS: gl.constexpr, num_warps: gl.constexpr):
    """Rows >= valid of a [BLOCK_N, COLS] shared tile set to 0, through registers, 16 rows at a time and only the
    row blocks that reach past ``valid``."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    for r0 in gl.static_range(0, BLOCK_N, 16):
        if r0 + 16 > valid:
            part = buf.slice(r0, 16, dim=0)
            x = part.load(layout)
            rows = r0 + gl.arange(0, 16, layout=gl.SliceLayout(1, layout))
            part.store(gl.where(gl.expand_dims(rows < valid, 1), x, gl.zeros_like(x)))


def _widen_layout(warps: int) -> gl.constexpr:
    """_widen's layout for a [32, 256] chunk of an fp8 tile over 8 or 4 warps: each thread 16 consecutive bytes of
    a row (registers), 4 lanes along 64 bytes and the lanes' rows {0, 5, 2, 7, 4, 1, 6, 3} (a linear layout: lane
    bit 2 steps 5 rows, not 1), 4 warps along the row, and rows 8 .. 15 of each 16 taken by 2 warps down (8 warps) or
    by each thread's registers (4 warps). Each 8 lanes of a 128-bit access (one wavefront) then touch every bank once:
    they hold rows r and r ^ 5 of the 128-byte swizzle (16-byte chunk c of row r sits at c ^ (r % 8)), so the fp8
    loads read chunks {0..3} ^ r and {0..3} ^ r ^ 5 (with rows r and r + 1, as in a blocked layout, two lanes shared
    each bank) and the fp16 stores (two chunks per thread) {0, 2, 4, 6} ^ r and ^ r ^ 5."""
    down = [[8, 0]]
    return gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [16, 0]] + (down if warps == 4 else []),
        lane_bases=[[0, 16], [0, 32], [5, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 64], [0, 128]] + (down if warps == 8 else []), block_bases=[], shape=[32, 256],
    ))  # fmt: skip


WIDEN_LAYOUT = _widen_layout(8)
WIDEN_LAYOUT_4 = _widen_layout(4)


@gluon.jit
def _hand_over(bars, slot):
    """Every warp's shared-memory writes made visible to the async proxy (wgmma, TMA), then one arrival on
    ``bars[slot]``: a buffer handed to another partition."""
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bars.index(slot), count=1)


@gluon.jit
def _widen_rows(src, dst, valid, layout: gl.constexpr, ROWS: gl.constexpr, CHUNK: gl.constexpr):
    """src (fp8 [ROWS, COLS], shared) -> dst (fp16), CHUNK rows at a time in ``layout``; rows >= valid set to 0."""
    for r0 in gl.static_range(0, ROWS, CHUNK):
        x = src.slice(r0, CHUNK, dim=0).load(layout).to(dst.dtype)
        if r0 + CHUNK > valid:
            rows = r0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            x = gl.where(gl.expand_dims(rows < valid, 1), x, gl.zeros_like(x))
        dst.slice(r0, CHUNK, dim=0).store(x)


@gluon.jit
def _widen(src, dst, valid, ROWS: gl.constexpr, COLS: gl.constexpr, num_warps: gl.constexpr):
    """An fp8 [ROWS, COLS] shared tile -> dst (fp16), CHUNK rows at a time (each thread: 16 consecutive bytes per
    row, no warp repeats another's rows); rows >= valid set to 0. The latent halves ([32 or 64, 256], 8 or 4 warps)
    go through :data:`WIDEN_LAYOUT` / :data:`WIDEN_LAYOUT_4`, without bank conflicts."""
    if COLS == 256 and num_warps == 8:
        _widen_rows(src, dst, valid, WIDEN_LAYOUT, ROWS, 32)
    elif COLS == 256 and num_warps == 4:
        _widen_rows(src, dst, valid, WIDEN_LAYOUT_4, ROWS, 32)
    else:
        WC: gl.constexpr = num_warps if COLS // 64 >= num_warps else COLS // 64  # warps side by side along a row
        CHUNK: gl.constexpr = 32 if 8 * (num_warps // WC) <= 32 else 8 * (num_warps // WC)
        _widen_rows(src, dst, valid, gl.BlockedLayout([1, 16], [8, 4], [num_warps // WC, WC], [1, 0]), ROWS, CHUNK)


@gluon.jit
def _opaque_zero():
    """0, as a value the compiler cannot see through (an index that keeps address math inside a loop)."""
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_q(Q, stride_h, q_smem, ROWS: gl.constexpr, COLS: gl.constexpr, CDT: gl.constexpr, num_warps: gl.constexpr):
    """q rows [ROWS, COLS] (row stride stride_h, columns contiguous) -> shared memory in the products' dtype (a bf16
    q for fp16 products is clamped to fp16's range, 65504, instead of becoming inf)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    q = gl.load(Q + gl.expand_dims(rows, 1) * stride_h + gl.expand_dims(cols, 0))
    if (CDT == gl.float16) & (q.dtype == gl.bfloat16):
        q = gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0)
    q_smem.store(q.to(CDT))


@gluon.jit
def _load_q_piece(
    QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi, q_pe,
    BLOCK_H: gl.constexpr, D_HALF: gl.constexpr, D_PE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A piece's q (latent halves and rope part of heads h0 .. h0 + BLOCK_H) into shared memory, once the previous
    piece's products are done reading it, fenced for the tensor cores."""
    CDT: gl.constexpr = q_lo.dtype
    gl.thread_barrier()  # the previous piece's products have read q
    _load_q(QN + b64 * stride_qn_b + h0 * stride_qn_h, stride_qn_h, q_lo, BLOCK_H, D_HALF, CDT, num_warps)
    _load_q(QN + b64 * stride_qn_b + h0 * stride_qn_h + D_HALF, stride_qn_h, q_hi, BLOCK_H, D_HALF, CDT, num_warps)
    _load_q(QP + b64 * stride_qp_b + h0 * stride_qp_h, stride_qp_h, q_pe, BLOCK_H, D_PE, CDT, num_warps)
    fence_async_shared()


@gluon.jit
def _work_row(WORK, pid_p):
    """Program pid_p's row of the plan (mla_decode_plan_kernels, 8 int32): first request, its global start, its
    first split slot, end of the request range, chunk, chunk end; and the chunk's start."""
    w = WORK + pid_p * 8
    chunk = gl.load(w + 4)
    return gl.load(w), gl.load(w + 1), gl.load(w + 2), gl.load(w + 3), chunk, gl.load(w + 5), pid_p * chunk


@gluon.jit
def _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N: gl.constexpr):
    """Request b (global start s_b) in the chunk [lo_g, hi_g): its padded end, token range [start, end) in this
    chunk, first chunk, whether it is split and the split pieces it takes in the slot space (0: one chunk holds it,
    or it is empty), as the Triton kernels' ``_span``."""
    seq_len = gl.load(SL + b)
    e_b = s_b + gl.cdiv(seq_len, BLOCK_N) * BLOCK_N
    start = gl.maximum(lo_g, s_b) - s_b
    end = gl.minimum(gl.minimum(hi_g, e_b) - s_b, seq_len)
    p0 = s_b // chunk
    p1 = gl.maximum(e_b - 1, 0) // chunk
    return e_b, start, end, p0, p1 > p0, gl.where((seq_len > 0) & (p1 > p0), p1 - p0 + 1, 0)


@gluon.jit
def _store_half(
    o, lse, cols0, b64, split, slot, slot_div, h0, PO, PL, OUT,
    stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h,
    WRITE_LSE: gl.constexpr, BLOCK_H: gl.constexpr, D_HALF: gl.constexpr, o_layout: gl.constexpr,
    s_layout: gl.constexpr,
):  # fmt: skip
    """o [BLOCK_H, D_HALF] (normalized) -> OUT (a finished request) or a workspace slot (a split piece)."""
    rows = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    cols = cols0 + gl.arange(0, D_HALF, layout=gl.SliceLayout(0, o_layout))
    if split:
        ws_b = (slot // slot_div).to(gl.int64)
        ws_s = slot % slot_div
        base = PO + ws_b * stride_po_b + ws_s * stride_po_s
        gl.store(base + gl.expand_dims(rows, 1) * stride_po_h + gl.expand_dims(cols, 0), o)
        if WRITE_LSE:
            rows_s = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
            gl.store(PL + ws_b * stride_pl_b + rows_s * stride_pl_h + ws_s * stride_pl_s, lse)
    else:
        ptrs = OUT + b64 * stride_o_b + gl.expand_dims(rows, 1) * stride_o_h + gl.expand_dims(cols, 0)
        gl.store(ptrs, o.to(OUT.dtype.element_ty))


@gluon.jit
def _finish_piece(
    o_lo, o_hi, m_i, l_i, out_scale, b64, split, slot, slot_div, h0, PO, PL, OUT,
    stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h,
    BLOCK_H: gl.constexpr, D_HALF: gl.constexpr, o_layout: gl.constexpr, s_layout: gl.constexpr,
):  # fmt: skip
    """A piece's end in the 64-head kernels whose warpgroups split the tile's tokens for the scores and the output
    columns for ``P @ V``: both latent halves normalized and written (with the log-sum-exp), see
    :func:`_store_half`."""
    lse = (m_i + gl.log2(l_i)) * 0.6931471805599453
    inv = gl.expand_dims(gl.convert_layout(out_scale / l_i, gl.SliceLayout(1, o_layout)), 1)
    _store_half(o_lo * inv, lse, 0, b64, split, slot, slot_div, h0, PO, PL, OUT, stride_po_b, stride_po_h,
                stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, True, BLOCK_H, D_HALF,
                o_layout, s_layout)  # fmt: skip
    _store_half(o_hi * inv, lse, D_HALF, b64, split, slot, slot_div, h0, PO, PL, OUT, stride_po_b, stride_po_h,
                stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, False, BLOCK_H, D_HALF,
                o_layout, s_layout)  # fmt: skip


@gluon.constexpr_function
def _token_split_layout(BLOCK_N, K):
    """The 64-head kernels' scores [64 heads, BLOCK_N]: each of the two warpgroups the scores of its half of the
    tile's tokens (``K``: the instruction's depth, 16 for 16-bit operands, 32 for fp8)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, K])


@gluon.constexpr_function
def _column_split_layout(D_HALF):
    """The 64-head kernels' output [64 heads, D_HALF] of a latent half: each warpgroup half its columns, from the
    whole probability tile."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_HALF // 2, 16])


@gluon.jit
def _merge_chunk_ends(
    WORK, SL, PO, PL, OUT, s_end, slot_end, h0, slot_div, num_reqs, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
    D_CKV: gl.constexpr, MERGE_MAX: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """After a program's last piece: the split requests it has a piece of (only its chunk's first and last request
    can be split) through :func:`_merge_if_last`. ``s_end`` / ``slot_end``: the global token and the slot after its
    last request (the request walk's final values), from which the last request's start and slot are recovered
    (nothing is carried through the walk: the 64-head kernel has no register to spare)."""
    b0, s_b0, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, gl.program_id(1))
    if b_end > b0:
        _, _, _, _, split, pieces = _request_span(SL, b0, s_b0, lo_g, hi_g, chunk, BLOCK_N)
        if split & (pieces <= MERGE_MAX):
            _merge_if_last(WORK, PO, PL, OUT, b0, h0, slot0, pieces, slot_div, num_reqs, stride_po_b, stride_po_h,
                           stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, BLOCK_H, D_CKV,
                           num_warps)  # fmt: skip
        b1 = b_end - 1
        if b1 > b0:
            s_b1 = s_end - gl.cdiv(gl.load(SL + b1), BLOCK_N) * BLOCK_N
            _, _, _, _, split, pieces = _request_span(SL, b1, s_b1, lo_g, hi_g, chunk, BLOCK_N)
            if split & (pieces <= MERGE_MAX):
                _merge_if_last(WORK, PO, PL, OUT, b1, h0, slot_end - pieces, pieces, slot_div, num_reqs,
                               stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s,
                               stride_o_b, stride_o_h, BLOCK_H, D_CKV, num_warps)  # fmt: skip


@gluon.jit
def _merge_if_last(
    WORK, PO, PL, OUT, b, h0, slot_first, pieces, slot_div, num_reqs, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, BLOCK_H: gl.constexpr, D_CKV: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """For split request b, of which this program wrote a piece (heads h0 .. h0 + BLOCK_H): count
    the piece in the plan's counter of (request, head block); the program that counts the last one merges every
    piece's output and log-sum-exp into OUT, as the merge kernel would (no merge launch), and sets the counter back
    to 0: a plan written once serves every layer of a step. The partial writes of every warp are ordered before the
    count (barrier, then a release at GPU scope) and the last program's reads after it (acquire, loads that bypass
    L1)."""
    b64 = b.to(gl.int64)
    cnt = WORK + 8 * gl.num_programs(1) + 2 * num_reqs + b64 * gl.num_programs(0) + gl.program_id(0)
    gl.thread_barrier()  # every warp's partial stores issued before the count
    done = gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if done == pieces - 1:
        gl.store(cnt, 0)  # every piece is counted: re-armed for the next call that reuses the plan (the next layer)
        # [BLOCK_H, COLS] tiles of 64 floats a thread (16 heads: the whole row), each piece's tile one load: the
        # pieces' round trips follow one another, so a merge costs pieces x D_CKV / COLS of them
        COLS: gl.constexpr = min(D_CKV, 64 * 32 * num_warps // BLOCK_H)
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
        heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
        for c0 in gl.static_range(0, D_CKV, COLS):
            cols = c0 + gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
            m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, layout))
            den = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, layout))
            acc = gl.zeros([BLOCK_H, COLS], gl.float32, layout=layout)
            for p in range(pieces):
                ws_b = ((slot_first + p) // slot_div).to(gl.int64)
                ws_s = (slot_first + p) % slot_div
                lse = gl.load(PL + ws_b * stride_pl_b + ws_s * stride_pl_s + heads * stride_pl_h,
                              cache_modifier=".cg")  # fmt: skip
                o = gl.load(PO + ws_b * stride_po_b + ws_s * stride_po_s
                            + (gl.expand_dims(heads, 1) * stride_po_h + gl.expand_dims(cols, 0)),
                            cache_modifier=".cg")  # fmt: skip
                m_new = gl.maximum(m, lse)
                alpha = gl.exp(m - m_new)
                w = gl.exp(lse - m_new)
                acc = acc * gl.expand_dims(alpha, 1) + o * gl.expand_dims(w, 1)
                den = den * alpha + w
                m = m_new
            ptrs = OUT + b64 * stride_o_b + (gl.expand_dims(heads, 1) * stride_o_h + gl.expand_dims(cols, 0))
            gl.store(ptrs, (acc / gl.expand_dims(den, 1)).to(OUT.dtype.element_ty))


@gluon.jit
def _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, stage, PT_row, n, end, pred,
                PAGE_SIZE: gl.constexpr, D_HALF: gl.constexpr):  # fmt: skip
    """The tile at request token n into ``stage`` when ``pred`` (its page read at a clamped index otherwise)."""
    n = gl.minimum(n, end - 1)
    page = gl.load(PT_row + n // PAGE_SIZE)
    _issue_tile(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, stage, page * PAGE_SIZE + n % PAGE_SIZE, pred, D_HALF)


@gluon.jit
def _ready(k_lo, k_hi, valid, BLOCK_N: gl.constexpr, D_HALF: gl.constexpr, num_warps: gl.constexpr):
    """A landed tile made safe for P @ V: in the ragged last tile of a piece (valid < BLOCK_N) the latent rows
    past the end (never-written pool memory, possibly NaN) are zeroed; their scores are masked to -inf."""
    if valid < BLOCK_N:
        _zero_rows_past(k_lo, valid, BLOCK_N, D_HALF, num_warps)
        _zero_rows_past(k_hi, valid, BLOCK_N, D_HALF, num_warps)
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _scores(q_lo, q_hi, q_pe, k_lo, k_hi, k_pe, s_zero):
    """q . k over the latent halves and the rope part of one tile, issued (not waited for)."""
    s = warpgroup_mma(q_lo, k_lo.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma(q_hi, k_hi.permute((1, 0)), s, is_async=True)
    return warpgroup_mma(q_pe, k_pe.permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax(s, m_i, l_i, keep, qk_scale, CDT: gl.constexpr, row_o: gl.constexpr, p_layout: gl.constexpr):
    """Online softmax over one tile's scores (columns not in ``keep`` masked): P as the tensor-core operand, the
    rescale of the running output, and the new running max and sum."""
    s = gl.where(gl.expand_dims(keep, 0), s * qk_scale, gl.full_like(s, float("-inf")))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    alpha_o = gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
    return gl.convert_layout(p.to(CDT), p_layout), alpha_o, m_new, l_i


@gluon.jit
def _decode_piece_wgmma(
    QN, QP, desc_c, desc_pe, PT_row, PO, PL, OUT, q_lo3, q_hi3, q_pe3, kv_lo, kv_hi, kv_pe, w_lo, w_hi, w_pe, bars, it,
    qk_scale, out_scale, b64, start, end, split, slot, slot_div, h0,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Tokens [start, end) of request b64 for heads h0 .. h0 + BLOCK_H. ``it`` counts the tiles this program has
    consumed so far (each stage's barrier phase follows from it); returns the updated count. ``q_lo3`` / ``q_hi3`` /
    ``q_pe3`` (and ``w_*``) are one-deep buffers, indexed per tile through an opaque 0. Over an fp8 cache
    (``FP8``) each landed tile is widened into ``w_lo`` / ``w_hi`` / ``w_pe`` (fp16) and the products read those;
    its stage is then free at once, so the tile two ahead is loaded into it (two tiles in flight, as many bytes as
    one 16-bit tile). Otherwise the products read the stage itself and the next tile loads into the other one."""
    D_HALF: gl.constexpr = D_CKV // 2
    q_lo, q_hi, q_pe = q_lo3.index(0), q_hi3.index(0), q_pe3.index(0)
    CDT: gl.constexpr = q_lo.dtype
    FP8: gl.constexpr = kv_lo.dtype == gl.float8e4nv
    s_layout: gl.constexpr = _token_split_layout(BLOCK_N, 16)
    o_layout: gl.constexpr = _column_split_layout(D_HALF)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    _load_q_piece(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi, q_pe, BLOCK_H,
                  D_HALF, D_PE, num_warps)  # fmt: skip

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=row_s)
    o_lo = gl.zeros([BLOCK_H, D_HALF], gl.float32, layout=o_layout)
    o_hi = gl.zeros([BLOCK_H, D_HALF], gl.float32, layout=o_layout)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    cols_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    nt = gl.cdiv(end - start, BLOCK_N)
    page = gl.load(PT_row + start // PAGE_SIZE)
    _issue_tile(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, it % 2, page * PAGE_SIZE + start % PAGE_SIZE, True, D_HALF)
    if FP8:  # the second tile too: a stage is refilled as soon as its tile is widened
        _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, (it + 1) % 2, PT_row, start + BLOCK_N, end, nt > 1,
                    PAGE_SIZE, D_HALF)  # fmt: skip
    for i in range(nt):  # tile i + 1 (fp8: and i + 2) loads while tile i is multiplied
        stage = it % 2
        n0 = start + i * BLOCK_N
        mbarrier.wait(bars.index(stage), (it // 2) & 1)
        gl.thread_barrier()  # every warp is done with the previous tile: its stage (fp8: the widened tile) is free
        z = _opaque_zero()  # q and the widened tile at an index the compiler cannot fold (see the module's docstring)
        if FP8:
            v_lo, v_hi, v_pe = w_lo.index(z), w_hi.index(z), w_pe.index(z)
            _widen(kv_lo.index(stage), v_lo, end - n0, BLOCK_N, D_HALF, num_warps)
            _widen(kv_hi.index(stage), v_hi, end - n0, BLOCK_N, D_HALF, num_warps)
            _widen(kv_pe.index(stage), v_pe, end - n0, BLOCK_N, D_PE, num_warps)
            fence_async_shared()
            gl.thread_barrier()  # widened by every warp, and the stage read: refilled with the tile two ahead
            _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, stage, PT_row, n0 + 2 * BLOCK_N, end,
                        i + 2 < nt, PAGE_SIZE, D_HALF)  # fmt: skip
        else:
            _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, 1 - stage, PT_row, n0 + BLOCK_N, end, i + 1 < nt,
                        PAGE_SIZE, D_HALF)  # fmt: skip
            _ready(kv_lo.index(stage), kv_hi.index(stage), end - n0, BLOCK_N, D_HALF, num_warps)
            v_lo, v_hi, v_pe = kv_lo.index(stage), kv_hi.index(stage), kv_pe.index(stage)
        s = _scores(q_lo3.index(z), q_hi3.index(z), q_pe3.index(z), v_lo, v_hi, v_pe, s_zero)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p_op, alpha_o, m_i, l_i = _softmax(s, m_i, l_i, cols_n < end - n0, qk_scale, CDT, row_o, p_layout)
        o_lo = warpgroup_mma(p_op, v_lo, o_lo * alpha_o, is_async=True)
        o_hi = warpgroup_mma(p_op, v_hi, o_hi * alpha_o, is_async=True)
        o_lo, o_hi = warpgroup_mma_wait(num_outstanding=0, deps=(o_lo, o_hi))
        it += 1

    _finish_piece(o_lo, o_hi, m_i, l_i, out_scale, b64, split, slot, slot_div, h0, PO, PL, OUT, stride_po_b,
                  stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, BLOCK_H,
                  D_HALF, o_layout, s_layout)  # fmt: skip
    return it


@gluon.jit(do_not_specialize=["slot_div", "num_reqs"])
def _mla_decode_wgmma_kernel(
    QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, num_reqs,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, MERGE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """grid (H // BLOCK_H, programs): program (h, p) runs the pieces of work row p for heads h * BLOCK_H .. +
    BLOCK_H (the head block varies fastest, so the programs that read the same KV tiles run together)."""
    D_HALF: gl.constexpr = D_CKV // 2
    h0 = gl.program_id(0) * BLOCK_H
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)

    FP8: gl.constexpr = desc_c.dtype == gl.float8e4nv
    CDT: gl.constexpr = gl.float16 if FP8 else desc_c.dtype  # the products' dtype (fp8: widened to fp16)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_HALF], CDT)
    qpe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_PE], CDT)
    q_lo = gl.allocate_shared_memory(CDT, [1, BLOCK_H, D_HALF], q_layout)
    q_hi = gl.allocate_shared_memory(CDT, [1, BLOCK_H, D_HALF], q_layout)
    q_pe = gl.allocate_shared_memory(CDT, [1, BLOCK_H, D_PE], qpe_layout)
    kv_lo = gl.allocate_shared_memory(desc_c.dtype, [2, BLOCK_N, D_HALF], desc_c.layout)
    kv_hi = gl.allocate_shared_memory(desc_c.dtype, [2, BLOCK_N, D_HALF], desc_c.layout)
    kv_pe = gl.allocate_shared_memory(desc_c.dtype, [2, BLOCK_N, D_PE], desc_pe.layout)
    if FP8:  # one widened tile: 2 x 32 + 8 KiB
        w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_HALF], CDT)
        w_lo = gl.allocate_shared_memory(CDT, [1, BLOCK_N, D_HALF], w_layout)
        w_hi = gl.allocate_shared_memory(CDT, [1, BLOCK_N, D_HALF], w_layout)
        w_pe = gl.allocate_shared_memory(CDT, [1, BLOCK_N, D_PE],
                                         gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_PE], CDT))  # fmt: skip
    else:  # unused: the products read the stages
        w_lo, w_hi, w_pe = kv_lo, kv_hi, kv_pe
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)

    it = 0
    for b in range(b0, b_end):  # the requests that overlap this program's chunk
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            it = _decode_piece_wgmma(
                QN, QP, desc_c, desc_pe, PT + b64 * stride_pt_b, PO, PL, OUT, q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe,
                w_lo, w_hi, w_pe, bars, it, qk_scale, out_scale, b64, start, end, split, slot0 + (pid_p - p0),
                slot_div, h0,
                stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_po_b, stride_po_h, stride_po_s,
                stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, PAGE_SIZE, D_CKV, D_PE, BLOCK_H,
                BLOCK_N, num_warps,
            )  # fmt: skip
        slot0 += pieces
        s_b = e_b
    if MERGE > 0:  # the last program to finish a split request's pieces merges them
        _merge_chunk_ends(WORK, SL, PO, PL, OUT, s_b, slot0, h0, slot_div, num_reqs, stride_po_b, stride_po_h,
                          stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, BLOCK_H, BLOCK_N,
                          D_CKV, MERGE, num_warps)  # fmt: skip
    mbarrier.invalidate(bars.index(0))
    mbarrier.invalidate(bars.index(1))
