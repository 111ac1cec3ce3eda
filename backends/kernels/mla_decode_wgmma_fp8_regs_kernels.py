"""Gluon stage-1 kernel of the absorbed-MLA decode over an fp8 (e4m3) cache, 32 heads per program (Hopper).

The products are the tokens kernel's (:mod:`backends.kernels.mla_decode_wgmma_tokens_kernels`), both in fp16 over
each tile widened first: a 16-bit q cannot multiply an fp8 tile, and ``P @ V`` reads V along the tokens, which an
fp8 wgmma does not take. The 16-head fp8 kernel (:mod:`backends.kernels.mla_decode_wgmma_fp8_kernels`) runs its
scores as fp8 products of a split q straight from its fp8 TMA stages, but 32 heads of q (36 KiB) do not fit beside
those stages and two widened tiles. Here the widener warps load the fp8 tile from global memory into their
registers instead (no fp8 stage in shared memory), so shared memory holds q, two widened tiles (2 x 72 KiB, rope
part included) and ``P^T``: 184 KiB at 32 heads.

* **the widener** (a worker partition of 8 warps, 128 registers): walks the same plan rows and pieces as the
  multiplier; keeps the next two tiles of a piece in flight in its registers (one row per thread, 16 bytes per 64
  columns, four e4m3 values per int32 so the values stay packed across loop iterations: 36 registers a tile); once
  the multiplier has freed buffer ``it % 2`` it widens tile ``it`` into it (``cvt.rn.f16x2.e4m3x2``, exact), each
  part's registers then taking the part of the tile two ahead, and signals it full. Rows past a request's end are
  loaded as 0 (masked loads), so never-written pool memory cannot reach the products.
* **the multiplier** (the default partition, one warpgroup): the tokens kernel's products over the widened
  buffers, each tile's scores queued behind the previous tile's ``P @ V``; it frees a buffer once that product is
  done and writes the outputs.

Measured on an H100 (CUDA-graph replays, bench/TRITON_NOTES.md), 32 heads, µs: 64 x 32768 730.3 (two 16-head
programs of the 16-head fp8 kernel as it was then, with fp16 scores: 943.6; that kernel at 32 heads with one fp8
stage: 782.4; one tile ahead in registers: 767.2; our bf16 cache 858.2), 128 x varied 8192 393.6. At 16 heads this
design lost to the TMA stages of the 16-head kernel (631.2 / 597.8 with two / one tiles ahead against 503.0 at
64 x 32768, before its fp8 scores).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from backends.kernels.mla_decode_wgmma_fp8_kernels import WIDEN_REGS, WIDEN_WARPS
from backends.kernels.mla_decode_wgmma_kernels import _pdl_enter, _request_span, _work_row
from backends.kernels.mla_decode_wgmma_tokens_kernels import _finish_t, _scores_t, _softmax_t, _start_piece_t


@gluon.jit
def _tile_rows(KV4, PT_row, n0, end, stride_kv4, PAGE_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, NW: gl.constexpr):
    """Where the rows of the tile at request token n0 start in ``KV4`` (the cache viewed as int32, four e4m3 values
    each), and which rows are real (< end): one row per thread of the widener's load layout."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [NW, 1], [1, 0])
    page = gl.load(PT_row + gl.maximum(gl.minimum(n0, end - 1), 0) // PAGE_SIZE)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    base = KV4 + gl.expand_dims((page.to(gl.int64) * PAGE_SIZE + n0 % PAGE_SIZE + rows) * stride_kv4, 1)
    return base, gl.expand_dims(rows < end - n0, 1)


@gluon.jit
def _load_part(base, mask, COL0: gl.constexpr, COLS: gl.constexpr):
    """int32 columns COL0 .. COL0 + COLS of a tile's rows (16 consecutive bytes per thread per 64 fp8 columns; rows
    past the end read as 0, so never-written pool memory cannot reach the products); issued, not waited for."""
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, base.type.layout))
    return gl.load(base + COL0 + gl.expand_dims(cols, 0), mask=mask, other=0)


@gluon.jit
def _store_widened(x, dst, NW: gl.constexpr):
    """Four e4m3 values per int32 of x [ROWS, C] -> dst (fp16 [ROWS, 4 C] in shared memory), widened two at a time
    (``cvt.rn.f16x2.e4m3x2``, exact) and written through an int32 view of dst (two fp16 per int32; the 128-byte
    swizzle is a pattern of bytes, so the view addresses the same bytes)."""
    ROWS: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    a, b = gl.inline_asm_elementwise(
        "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; cvt.rn.f16x2.e4m3x2 $1, h; }",
        "=r,=r,r", [x], dtype=(gl.int32, gl.int32), is_pure=True, pack=1,
    )  # fmt: skip
    y = gl.convert_layout(gl.reshape(gl.join(a, b), [ROWS, 2 * C]),
                          gl.BlockedLayout([1, 8], [8, 4], [NW, 1], [1, 0]))  # fmt: skip
    view_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    dst._reinterpret(gl.int32, [ROWS, 2 * C], view_layout).store(y)


@gluon.jit
def _widener(
    KV4, PT, SL, WORK, stride_pt_b, stride_kv4, w_lo, w_hi, w_pe, full, empty,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_N: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """Worker partition: every tile of this program's pieces loaded from global memory into registers two tiles
    ahead, then, once the multiplier has freed buffer ``it % 2`` (``empty``), widened into it and handed over
    (``full``)."""
    _pdl_enter(PDL)
    NW: gl.constexpr = WIDEN_WARPS
    Q: gl.constexpr = D_CKV // 8  # int32 columns of a latent half
    P: gl.constexpr = D_PE // 4
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, gl.program_id(1))
    it = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        PT_row = PT + (s_b * 0 + b).to(gl.int64) * stride_pt_b
        base, mask = _tile_rows(KV4, PT_row, start, end, stride_kv4, PAGE_SIZE, BLOCK_N, NW)
        x_lo, x_hi, x_pe = _load_part(base, mask, 0, Q), _load_part(base, mask, Q, Q), _load_part(base, mask, 2 * Q, P)
        base, mask = _tile_rows(KV4, PT_row, start + BLOCK_N, end, stride_kv4, PAGE_SIZE, BLOCK_N, NW)
        y_lo, y_hi, y_pe = _load_part(base, mask, 0, Q), _load_part(base, mask, Q, Q), _load_part(base, mask, 2 * Q, P)
        for i in range(gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)):
            buf = it % 2
            mbarrier.wait(empty.index(buf), ((it // 2) & 1) ^ 1)  # the products of tile it - 2 are done
            base, mask = _tile_rows(KV4, PT_row, start + (i + 2) * BLOCK_N, end, stride_kv4, PAGE_SIZE, BLOCK_N, NW)
            _store_widened(x_lo, w_lo.index(buf), NW)  # each part's registers then take tile i + 2's part
            z_lo = _load_part(base, mask, 0, Q)
            _store_widened(x_hi, w_hi.index(buf), NW)
            z_hi = _load_part(base, mask, Q, Q)
            _store_widened(x_pe, w_pe.index(buf), NW)
            z_pe = _load_part(base, mask, 2 * Q, P)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(full.index(buf), count=1)
            x_lo, x_hi, x_pe = y_lo, y_hi, y_pe
            y_lo, y_hi, y_pe = z_lo, z_hi, z_pe
            it += 1
        s_b = e_b


@gluon.jit
def _scores_when_widened(full, it, w_lo, w_hi, w_pe, q_lo, q_hi, q_pe, s_zero):
    """Tile ``it``'s scores over widened buffer ``it % 2`` (latent halves and rope part), issued once the widener
    has filled it (not waited for)."""
    buf = it % 2
    mbarrier.wait(full.index(buf), (it // 2) & 1)
    return _scores_t(w_lo.index(buf), w_hi.index(buf), w_pe.index(buf), q_lo, q_hi, q_pe, s_zero)


@gluon.jit
def _widened_tile_products(
    s, m_i, l_i, o_lo, o_hi, rows_n, valid, qk_scale, p_smem, w_lo, w_hi, w_pe, q_lo, q_hi, q_pe, s_zero, full, empty,
    it, has_next,
):  # fmt: skip
    """One tile of the multiplier: tile ``it``'s softmax (its scores ``s`` done) and ``P @ V`` over widened buffer
    ``it % 2``, the next tile's scores queued behind it on the tensor cores when ``has_next`` (three groups), the
    buffer handed back to the widener once ``P @ V`` is done. Returns the next tile's scores (done), the running max
    and sum and the output accumulators."""
    buf = it % 2
    alpha_o, m_i, l_i = _softmax_t(s, m_i, l_i, rows_n, valid, qk_scale, p_smem)
    pv_lo = warpgroup_mma(w_lo.index(buf).permute((1, 0)), p_smem, o_lo * alpha_o, is_async=True)
    pv_hi = warpgroup_mma(w_hi.index(buf).permute((1, 0)), p_smem, o_hi * alpha_o, is_async=True)
    if has_next:
        s = _scores_when_widened(full, it + 1, w_lo, w_hi, w_pe, q_lo, q_hi, q_pe, s_zero)
        o_lo, o_hi = warpgroup_mma_wait(num_outstanding=3, deps=(pv_lo, pv_hi))
        gl.thread_barrier()  # every multiplier warp's P @ V is done: the buffer is free
        mbarrier.arrive(empty.index(buf), count=1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    else:
        o_lo, o_hi = warpgroup_mma_wait(num_outstanding=0, deps=(pv_lo, pv_hi))
        gl.thread_barrier()
        mbarrier.arrive(empty.index(buf), count=1)
    return s, m_i, l_i, o_lo, o_hi


@gluon.jit
def _multiplier(
    QN, QP, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div,
    q_lo, q_hi, q_pe, w_lo, w_hi, w_pe, p_smem, full, empty,
    D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """Default partition: the plan walk, the products over the widened buffers, the outputs."""
    D_HALF: gl.constexpr = D_CKV // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_H, 16]
    )
    rows_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    s_zero = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=acc_layout)
    h0 = gl.program_id(0) * BLOCK_H
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)
    it = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            m_i, l_i, o_lo, o_hi = _start_piece_t(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
                                                  q_lo, q_hi, q_pe, acc_layout, BLOCK_H, D_HALF, D_PE, num_warps)
            nt = gl.cdiv(end - start, BLOCK_N)
            s = _scores_when_widened(full, it, w_lo, w_hi, w_pe, q_lo, q_hi, q_pe, s_zero)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            for i in range(nt):  # s: tile i's scores, done
                n0 = start + i * BLOCK_N
                s, m_i, l_i, o_lo, o_hi = _widened_tile_products(
                    s, m_i, l_i, o_lo, o_hi, rows_n, end - n0, qk_scale, p_smem, w_lo, w_hi, w_pe, q_lo, q_hi, q_pe,
                    s_zero, full, empty, it, i + 1 < nt,
                )  # fmt: skip
                it += 1
            _finish_t(o_lo, o_hi, m_i, l_i, out_scale, b64, split, slot0 + (pid_p - p0), slot_div, h0, PO, PL, OUT,
                      stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b,
                      stride_o_h, D_HALF, BLOCK_H, num_warps)  # fmt: skip
        slot0 += pieces
        s_b = e_b


@gluon.jit(do_not_specialize=["slot_div", "num_reqs"])
def _mla_decode_wgmma_fp8_regs_kernel(
    QN, QP, KV4, stride_kv4, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, num_reqs,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MERGE: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """grid (H // BLOCK_H, programs), the tokens kernel's arguments with the cache as int32 (``KV4``, four e4m3
    values each, rows ``stride_kv4`` int32 apart) in place of its TMA descriptors: ``num_warps`` (4) warps
    multiply, :data:`WIDEN_WARPS` (8) more load and widen. Split requests are all merged by the merge kernel
    (``MERGE`` = 0, ``num_reqs`` unused). ``STAGES`` is unused (two widened buffers, two tiles in registers)."""
    gl.static_assert(MERGE == 0, "the fp8 kernel leaves every split request to the merge kernel")
    _pdl_enter(PDL)  # the widener warps start at the partition below, after this wait (and wait again themselves)
    D_HALF: gl.constexpr = D_CKV // 2
    CDT: gl.constexpr = gl.float16
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_HALF], CDT)
    q_lo = gl.allocate_shared_memory(CDT, [BLOCK_H, D_HALF], q_layout)
    q_hi = gl.allocate_shared_memory(CDT, [BLOCK_H, D_HALF], q_layout)
    q_pe = gl.allocate_shared_memory(CDT, [BLOCK_H, D_PE], gl.NVMMASharedLayout.get_default_for([BLOCK_H, D_PE], CDT))
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_HALF], CDT)
    w_lo = gl.allocate_shared_memory(CDT, [2, BLOCK_N, D_HALF], w_layout)
    w_hi = gl.allocate_shared_memory(CDT, [2, BLOCK_N, D_HALF], w_layout)
    w_pe = gl.allocate_shared_memory(CDT, [2, BLOCK_N, D_PE], gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_PE], CDT))
    p_smem = gl.allocate_shared_memory(CDT, [BLOCK_N, BLOCK_H], gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], CDT))
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    gl.warp_specialize(
        [
            (_multiplier, (
                QN, QP, SL, WORK, PO, PL, OUT, qk_scale, out_scale, stride_qn_b, stride_qn_h, stride_qp_b,
                stride_qp_h, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b,
                stride_o_h, slot_div, q_lo, q_hi, q_pe, w_lo, w_hi, w_pe, p_smem, full, empty, D_CKV, D_PE, BLOCK_H,
                BLOCK_N, num_warps,
            )),
            (_widener, (KV4, PT, SL, WORK, stride_pt_b, stride_kv4, w_lo, w_hi, w_pe, full, empty, PAGE_SIZE, D_CKV,
                        D_PE, BLOCK_N, PDL)),
        ],
        [WIDEN_WARPS],
        [WIDEN_REGS],
    )  # fmt: skip
