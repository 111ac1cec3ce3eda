"""Gluon stage-1 kernel of the absorbed-MLA decode over an fp8 (e4m3) cache, 16 or 32 heads per program (Hopper):
the scores as fp8 products straight from the landed tile, ``P @ V`` over the tile widened to fp16.

The scores ``S^T [64 tokens, H] = K [64, 576] . q^T`` have both operands K-major (the tile's rows, q's rows), the
one form an fp8 wgmma takes, so they need no widening: q is split into two e4m3 parts per head,
``q * s = hi + lo / 16`` (``s`` the power of two that puts the head's largest value in (224, 448]; ``hi`` =
e4m3(q s), ``lo`` = e4m3(16 (q s - hi))), stacked as the 2H columns of ``m64n32k32`` products: the tile is read
once, and ``S = (S_hi + S_lo / 16) / s``. Two e4m3 parts hold 8 significant bits, all of a bf16 q (values under
2^-14 of their head's largest excepted, where ``lo`` goes subnormal), and the cache's values are exact operands, so
the scores lose nothing but the fp8 accumulation's precision (see :func:`_wait_scores`). ``P @ V`` reads V along
the tokens (not K-major) and stays an fp16 product over the tile widened in shared memory:

* **the widener** (a worker partition: 8 warps at 16 heads, 4 at 32): issues the TMA loads of the fp8 tiles into
  ``STAGES`` stages; widens each landed tile's latent halves (the rope part is only read by the scores) in
  ``PARTS`` row parts, each into the next of ``WIDENED`` fp16 buffers once the multipliers have freed it, and
  signals it full; refills a stage once every multiplier's scores are done with it;
* **the multipliers** (one warpgroup per 16 heads: the default partition, and at 32 heads a worker partition as
  well): the scores of each tile as soon as it lands (not waiting for its widening), the softmax down the tokens,
  ``O^T += V^T P^T`` over each widened part once it is full (then hand it back), and the outputs.

All walk the same plan rows and pieces, so they count the same tiles: tile ``it`` lands in stage ``it % STAGES``,
part ``h`` of it is widened into buffer ``(it PARTS + h) % WIDENED``. Rows past a request's end are masked out of
the scores (never-written pool memory may hold NaN bit patterns) and zeroed in the widened buffer. Shared memory,
16 heads: 2 x 36 KiB of fp8 stages + 2 x 64 KiB of widened latent + 18 KiB of split q + 2 KiB of ``P^T`` (220 KiB);
32 heads: 2 x 36 + 2 x 32 (half tiles) + 2 x 18 + 2 x 2 (177 KiB).

Measured on an H100 (CUDA-graph replays, plan reused, docs/kernels.md), us: 16 heads 64 x 32768 455.4 (1.80x
the bf16 cache's 820.8), 128 x varied 8192 246.2; 32 heads 64 x 32768 621.9 (1.36x the bf16 cache's 847.5; the
kernel before, the tile loaded into the widener's registers and fp16 scores: 729.4), 128 x varied 8192 342.6
(396.0), 64 x 4096 128.8 (142.7); error against float32 1.7-1.8e-3 at 16 heads (five score chains), 1.9-2.1e-3 at
32 heads (three; bf16: 1.7e-3). At 32 heads a tile takes about 4400 cycles per SM against 3200: the two
multipliers' own work per tile (more widener warps did not help; splitting the latent columns instead of the heads
between them was slower, docs/kernels.md). From ``FP8_ROLES_MIN_BATCH`` requests 32 heads run the roles
kernel instead (:mod:`backends.kernels.mla_decode.mla_decode_wgmma_fp8_roles_kernels`: 502 us at 64 x 32768), which
shares this kernel's widener.
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

from backends.kernels.mla_decode.mla_decode_wgmma_kernels import (
    _hand_over,
    _issue_next,
    _pdl_enter,
    _request_span,
    _widen,
    _work_row,
)
from backends.kernels.mla_decode.mla_decode_wgmma_tokens_kernels import (
    _finish_t,
    _fresh_state_t,
    _softmax_t,
    _tokens_acc_layout,
)

#: Registers per thread of the widener's warps (the multiplier takes the rest of the register file).
WIDEN_REGS = gl.constexpr(128)
#: Warps of the widener.
WIDEN_WARPS = gl.constexpr(8)
#: Heads of one multiplier warpgroup (32-head programs run two).
HEADS_PER_MULTIPLIER = gl.constexpr(16)
#: With two multipliers (12 warps): the widener's warps, and the registers per thread of the widener's warps and of
#: the second multiplier's (the lead multiplier, the default partition, takes the rest of the register file).
WIDEN_WARPS_2 = gl.constexpr(4)
WIDEN_REGS_2 = gl.constexpr(64)
MULTIPLIER_REGS_2 = gl.constexpr(216)
#: The split's scale: ``lo`` holds 16 x the remainder of ``hi`` (e4m3 keeps 3 fraction bits, so the remainder is at
#: most 1/16 of ``hi``'s magnitude and stays in e4m3's normal range for the values that matter).
LO_SCALE = gl.constexpr(16.0)


@gluon.jit
def _split_rows(x, s, hi_smem, lo_smem):
    """x * s (fp32 [H, C], s: [H, 1] powers of two) -> hi = e4m3(x s) into hi_smem, lo = e4m3(16 (x s - hi)) into
    lo_smem."""
    xs = x * s
    hi = xs.to(gl.float8e4nv)
    hi_smem.store(hi)
    lo_smem.store(((xs - hi.to(gl.float32)) * LO_SCALE).to(gl.float8e4nv))


@gluon.jit
def _load_q_scaled(
    QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, BLOCK_H: gl.constexpr,
    D_HALF: gl.constexpr, D_PE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A piece's q (heads h0 .. h0 + BLOCK_H) in fp32: the latent halves and the rope part ([BLOCK_H, C] each), and
    per head the power of two ``s`` = 2^floor(log2(448 / max |q|)) that puts its largest value in (224, 448] (exact,
    so q s is exact in fp32; a zero or non-finite row keeps s = 1). Returns (x_lo, x_hi, x_pe, s)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.expand_dims(gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout)), 1)
    c_half = gl.expand_dims(gl.arange(0, D_HALF, layout=gl.SliceLayout(0, layout)), 0)
    c_pe = gl.expand_dims(gl.arange(0, D_PE, layout=gl.SliceLayout(0, layout)), 0)
    qn = QN + b64 * stride_qn_b + (h0 + rows) * stride_qn_h
    x_lo = gl.load(qn + c_half).to(gl.float32)
    x_hi = gl.load(qn + D_HALF + c_half).to(gl.float32)
    x_pe = gl.load(QP + b64 * stride_qp_b + (h0 + rows) * stride_qp_h + c_pe).to(gl.float32)
    amax = gl.maximum(gl.maximum(gl.max(gl.abs(x_lo), 1), gl.max(gl.abs(x_hi), 1)), gl.max(gl.abs(x_pe), 1))
    e = gl.floor(gl.log2(448.0 / amax))
    s = gl.where((amax > 0) & (e == e) & (gl.abs(e) < 126), gl.exp2(e), gl.full_like(amax, 1.0))
    return x_lo, x_hi, x_pe, s


@gluon.jit
def _load_q_split(
    QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi, q_pe, col_l: gl.constexpr,
    BLOCK_H: gl.constexpr, D_HALF: gl.constexpr, D_PE: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """A piece's q (heads h0 .. h0 + BLOCK_H) split into two e4m3 parts per head (:func:`_load_q_scaled`'s scale):
    rows [0, BLOCK_H) of q_lo / q_hi / q_pe (the latent halves and the rope part) take ``hi``, rows [BLOCK_H,
    2 BLOCK_H) take ``lo``. Returns 1 / s per head ([BLOCK_H] fp32 in ``col_l``)."""
    x_lo, x_hi, x_pe, s = _load_q_scaled(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h,
                                         BLOCK_H, D_HALF, D_PE, num_warps)  # fmt: skip
    s2 = gl.expand_dims(s, 1)
    gl.thread_barrier()  # the previous piece's scores have read q
    _split_rows(x_lo, s2, q_lo.slice(0, BLOCK_H, dim=0), q_lo.slice(BLOCK_H, BLOCK_H, dim=0))
    _split_rows(x_hi, s2, q_hi.slice(0, BLOCK_H, dim=0), q_hi.slice(BLOCK_H, BLOCK_H, dim=0))
    _split_rows(x_pe, s2, q_pe.slice(0, BLOCK_H, dim=0), q_pe.slice(BLOCK_H, BLOCK_H, dim=0))
    fence_async_shared()
    gl.thread_barrier()
    return gl.convert_layout(1.0 / s, col_l)


@gluon.jit
def _scores8(kv_lo, kv_hi, kv_pe, stage, q_lo, q_hi, q_pe, s_zero, CHAIN: gl.constexpr):
    """S2^T [BLOCK_N, 2H] = K . [hi | lo]^T over the fp8 stage's latent halves and rope part: fp8 wgmma groups of
    ``CHAIN`` (256 or 128) columns each (the rope part: one of 64), issued (not waited for), each into an
    accumulator of its own (see :func:`_wait_scores`)."""
    if CHAIN == 256:
        a = warpgroup_mma(kv_lo.index(stage), q_lo.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        b = warpgroup_mma(kv_hi.index(stage), q_hi.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        c = warpgroup_mma(kv_pe.index(stage), q_pe.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        r = (a, b, c)
    else:
        a0 = _chain(kv_lo.index(stage), q_lo, 0, s_zero, CHAIN)
        a1 = _chain(kv_lo.index(stage), q_lo, 1, s_zero, CHAIN)
        b0 = _chain(kv_hi.index(stage), q_hi, 0, s_zero, CHAIN)
        b1 = _chain(kv_hi.index(stage), q_hi, 1, s_zero, CHAIN)
        c = warpgroup_mma(kv_pe.index(stage), q_pe.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        r = (a0, a1, b0, b1, c)
    return r


@gluon.jit
def _chain(kv, q, j: gl.constexpr, s_zero, CHAIN: gl.constexpr):
    """One accumulator chain of the scores: columns ``j CHAIN`` .. ``(j + 1) CHAIN`` of a latent half."""
    k = kv.slice(j * CHAIN, CHAIN, dim=1)
    return warpgroup_mma(k, q.slice(j * CHAIN, CHAIN, dim=1).permute((1, 0)), s_zero, use_acc=False, is_async=True)


@gluon.jit
def _wait_scores(s, n: gl.constexpr):
    """The parts of :func:`_scores8` once at most ``n`` wgmma groups are in flight, added in fp32. An fp8 wgmma
    accumulates in less than fp32 precision on Hopper (H100, error of the decode against float32): one chain over
    the 576 columns 3.4-3.6e-3, three chains of 256 / 256 / 64 columns 1.9-2.2e-3, five of 128 x 4 / 64 1.7e-3 (the
    fp16 products' error; promoting after every instruction, ``max_num_imprecise_acc=32``, gave 1.7e-3 at 1.6x the
    time). Five cost nothing at 16 heads (64 x 32768 457.0 against 457.8 us) but 5.6% at 32 heads, where the two
    more accumulators spill (667.7 against 632.4 us), so 32 heads keep three."""
    parts = warpgroup_mma_wait(num_outstanding=n, deps=s)
    acc = parts[0]
    for i in gl.static_range(1, len(parts)):
        acc = acc + parts[i]
    return acc


@gluon.jit
def _combine(s2, acc_layout: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_H: gl.constexpr):
    """S^T s [BLOCK_N, H] = S_hi + S_lo / 16 from S2^T [BLOCK_N, 2H] (columns: H ``hi`` then H ``lo``; the 1 / s is
    in the softmax's per-head scale). Each thread holds column c and c + H of a row, so the split moves no data: its
    halves are ``acc_layout``."""
    parts = gl.permute(gl.reshape(s2, [BLOCK_N, 2, BLOCK_H]), (0, 2, 1))
    s_hi, s_lo = gl.split(parts)
    return gl.convert_layout(s_hi, acc_layout) + gl.convert_layout(s_lo, acc_layout) * (1.0 / LO_SCALE)


@gluon.jit
def _widener(
    desc_c, desc_pe, PT, SL, WORK, stride_pt_b, kv_lo, kv_hi, kv_pe, w_lo, w_hi, bars, read, full, empty,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    WIDENED: gl.constexpr, PARTS: gl.constexpr, NW: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """Worker partition (``NW`` warps): issues the TMA loads of this program's pieces; widens every tile, as it
    lands, into buffer ``it % WIDENED`` once the multipliers have freed it (``empty``) and hands it over (``full``);
    refills the tile's stage with the tile ``STAGES`` ahead once every multiplier's scores are done with it
    (``read``)."""
    _pdl_enter(PDL)
    D_HALF: gl.constexpr = D_CKV // 2
    R: gl.constexpr = BLOCK_N // PARTS
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, gl.program_id(1))
    it = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        PT_row = PT + (s_b * 0 + b).to(gl.int64) * stride_pt_b
        nt = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        for j in gl.static_range(STAGES):  # every stage in flight (the previous piece's tiles are all read)
            _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, (it + j) % STAGES, PT_row, start + j * BLOCK_N,
                        end, j < nt, PAGE_SIZE, D_HALF)  # fmt: skip
        for i in range(nt):
            stage = it % STAGES
            mbarrier.wait(bars.index(stage), (it // STAGES) & 1)  # landed
            for h in gl.static_range(PARTS):  # the tile's rows in PARTS parts, each into the next buffer
                wt = it * PARTS + h
                buf = wt % WIDENED
                mbarrier.wait(empty.index(buf), ((wt // WIDENED) & 1) ^ 1)  # the P @ Vs that read it are done
                valid = end - start - i * BLOCK_N - h * R
                _widen(kv_lo.index(stage).slice(h * R, R, dim=0), w_lo.index(buf), valid, R, D_HALF, NW)
                _widen(kv_hi.index(stage).slice(h * R, R, dim=0), w_hi.index(buf), valid, R, D_HALF, NW)
                _hand_over(full, buf)
            mbarrier.wait(read.index(stage), (it // STAGES) & 1)  # every multiplier's scores are done with the stage
            _issue_next(desc_c, desc_pe, kv_lo, kv_hi, kv_pe, bars, stage, PT_row, start + (i + STAGES) * BLOCK_N,
                        end, i + STAGES < nt, PAGE_SIZE, D_HALF)  # fmt: skip
            it += 1
        s_b = e_b


@gluon.jit
def _widener_rings(desc_c, desc_pe, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WIDENED: gl.constexpr,
                   R: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr):  # fmt: skip
    """The shared memory :func:`_widener` fills: ``STAGES`` fp8 TMA stages (latent halves and rope part) and
    ``WIDENED`` fp16 buffers of ``R`` rows of each latent half. Returns (kv_lo, kv_hi, kv_pe, w_lo, w_hi)."""
    D_HALF: gl.constexpr = D_CKV // 2
    kv_lo = gl.allocate_shared_memory(desc_c.dtype, [STAGES, BLOCK_N, D_HALF], desc_c.layout)
    kv_hi = gl.allocate_shared_memory(desc_c.dtype, [STAGES, BLOCK_N, D_HALF], desc_c.layout)
    kv_pe = gl.allocate_shared_memory(desc_c.dtype, [STAGES, BLOCK_N, D_PE], desc_pe.layout)
    w_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, D_HALF], gl.float16)
    w_lo = gl.allocate_shared_memory(gl.float16, [WIDENED, R, D_HALF], w_layout)
    w_hi = gl.allocate_shared_memory(gl.float16, [WIDENED, R, D_HALF], w_layout)
    return kv_lo, kv_hi, kv_pe, w_lo, w_hi


@gluon.jit
def _widener_barriers(STAGES: gl.constexpr, WIDENED: gl.constexpr, READERS: gl.constexpr):
    """The barriers of :func:`_widener`'s rings, initialized: a stage landed (``bars``, the TMA's bytes) and read
    by the scores of ``READERS`` warpgroups (``read``); a widened buffer full (``full``) and emptied by the ``P @ V``
    of ``READERS`` warpgroups (``empty``). Returns (bars, read, full, empty)."""
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    read = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    full = gl.allocate_shared_memory(gl.int64, [WIDENED, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [WIDENED, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
        mbarrier.init(read.index(s), count=READERS)
    for s in gl.static_range(WIDENED):
        mbarrier.init(full.index(s), count=1)
        mbarrier.init(empty.index(s), count=READERS)
    return bars, read, full, empty


@gluon.jit
def _tile(
    s, m_i, l_i, o_lo, o_hi, rows_n, valid, qk_h, p_smem, w_lo, w_hi, kv_lo, kv_hi, kv_pe, q_lo, q_hi, q_pe,
    s_zero, bars, read, full, empty, it, has_next, acc_layout: gl.constexpr, BLOCK_N: gl.constexpr,
    HB: gl.constexpr, STAGES: gl.constexpr, WIDENED: gl.constexpr, PARTS: gl.constexpr, CHAIN: gl.constexpr,
):  # fmt: skip
    """One tile of a multiplier (its scores ``s`` done): softmax, ``P @ V`` over the tile's ``PARTS`` widened
    buffers as each is full, the next tile's scores queued behind it (when ``has_next``; the widener is then told
    they are done with their stage), each buffer handed back once its ``P @ V`` is done. Returns the next tile's
    scores (done), the running max and sum and the output accumulators."""
    R: gl.constexpr = BLOCK_N // PARTS
    alpha_o, m_i, l_i = _softmax_t(_combine(s, acc_layout, BLOCK_N, HB), m_i, l_i, rows_n, valid, qk_h, p_smem)
    pv_lo = o_lo * alpha_o
    pv_hi = o_hi * alpha_o
    for h in gl.static_range(PARTS):
        wt = it * PARTS + h
        buf = wt % WIDENED
        mbarrier.wait(full.index(buf), (wt // WIDENED) & 1)
        p_h = p_smem.slice(h * R, R, dim=0)
        pv_lo = warpgroup_mma(w_lo.index(buf).permute((1, 0)), p_h, pv_lo, is_async=True)
        pv_hi = warpgroup_mma(w_hi.index(buf).permute((1, 0)), p_h, pv_hi, is_async=True)
    if has_next:
        nxt = (it + 1) % STAGES
        mbarrier.wait(bars.index(nxt), ((it + 1) // STAGES) & 1)
        s = _scores8(kv_lo, kv_hi, kv_pe, nxt, q_lo, q_hi, q_pe, s_zero, CHAIN)
        o_lo, o_hi = _release_parts(pv_lo, pv_hi, empty, it, 2 * (256 // CHAIN) + 1, WIDENED, PARTS)
        s = _wait_scores(s, 0)
        _done_with(read, nxt)
    else:
        o_lo, o_hi = _release_parts(pv_lo, pv_hi, empty, it, 0, WIDENED, PARTS)
    return s, m_i, l_i, o_lo, o_hi


@gluon.jit
def _release_parts(o_lo, o_hi, empty, it, after: gl.constexpr, WIDENED: gl.constexpr, PARTS: gl.constexpr):
    """Each of tile ``it``'s widened buffers handed back as soon as its ``P @ V`` (two wgmma groups, issued in part
    order, ``after`` more groups behind them) is done. Returns the output accumulators, done."""
    for h in gl.static_range(PARTS - 1):
        o_lo, o_hi = warpgroup_mma_wait(num_outstanding=after + 2 * (PARTS - 1 - h), deps=(o_lo, o_hi))
        _done_with(empty, (it * PARTS + h) % WIDENED)
    o_lo, o_hi = warpgroup_mma_wait(num_outstanding=after, deps=(o_lo, o_hi))
    _done_with(empty, (it * PARTS + PARTS - 1) % WIDENED)
    return o_lo, o_hi


@gluon.jit
def _done_with(bar, i):
    """Once every warp of the multiplier is past this point, one arrival on ``bar[i]``."""
    gl.thread_barrier()
    mbarrier.arrive(bar.index(i), count=1)


@gluon.jit
def _multiplier(
    QN, QP, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div,
    q_lo, q_hi, q_pe, kv_lo, kv_hi, kv_pe, w_lo, w_hi, p_smem, bars, read, full, empty,
    D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    WIDENED: gl.constexpr, PARTS: gl.constexpr, CHAIN: gl.constexpr, M: gl.constexpr, PDL: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """Multiplier ``M`` (one warpgroup): heads ``16 M`` .. ``16 M + 16`` of the program's block, their products over
    the shared stages and widened buffers, their outputs."""
    if M > 0:  # a worker partition: starts after the kernel's own wait
        _pdl_enter(PDL)
    HB: gl.constexpr = HEADS_PER_MULTIPLIER
    D_HALF: gl.constexpr = D_CKV // 2
    acc_layout: gl.constexpr = _tokens_acc_layout(HB, num_warps)
    s2_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 2 * HB, 32]
    )
    col_l: gl.constexpr = gl.SliceLayout(0, acc_layout)
    rows_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    s_zero = gl.zeros([BLOCK_N, 2 * HB], gl.float32, layout=s2_layout)
    h0 = gl.program_id(0) * BLOCK_H + M * HB
    pid_p = gl.program_id(1)
    b0, s_b, slot0, b_end, chunk, hi_g, lo_g = _work_row(WORK, pid_p)
    it = 0
    for b in range(b0, b_end):
        e_b, start, end, p0, split, pieces = _request_span(SL, b, s_b, lo_g, hi_g, chunk, BLOCK_N)
        if start < end:
            b64 = (s_b * 0 + b).to(gl.int64)
            inv_s = _load_q_split(QN, QP, b64, h0, stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, q_lo, q_hi,
                                  q_pe, col_l, HB, D_HALF, D_PE, num_warps)  # fmt: skip
            qk_h = gl.expand_dims(inv_s * qk_scale, 0)  # the softmax's scale per head [1, HB], 1 / s folded in
            m_i, l_i, o_lo, o_hi = _fresh_state_t(acc_layout, HB, D_HALF)
            nt = gl.cdiv(end - start, BLOCK_N)
            mbarrier.wait(bars.index(it % STAGES), (it // STAGES) & 1)
            s = _scores8(kv_lo, kv_hi, kv_pe, it % STAGES, q_lo, q_hi, q_pe, s_zero, CHAIN)
            s = _wait_scores(s, 0)
            _done_with(read, it % STAGES)
            for i in range(nt):  # s: tile i's scores, done
                s, m_i, l_i, o_lo, o_hi = _tile(
                    s, m_i, l_i, o_lo, o_hi, rows_n, end - start - i * BLOCK_N, qk_h, p_smem, w_lo, w_hi, kv_lo,
                    kv_hi, kv_pe, q_lo, q_hi, q_pe, s_zero, bars, read, full, empty, it, i + 1 < nt, acc_layout,
                    BLOCK_N, HB, STAGES, WIDENED, PARTS, CHAIN,
                )  # fmt: skip
                it += 1
            _finish_t(o_lo, o_hi, m_i, l_i, out_scale, b64, split, slot0 + (pid_p - p0), slot_div, h0, PO, PL, OUT,
                      stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b,
                      stride_o_h, D_HALF, HB, num_warps)  # fmt: skip
        slot0 += pieces
        s_b = e_b


@gluon.jit(do_not_specialize=["slot_div", "num_reqs"])
def _mla_decode_wgmma_fp8_kernel(
    QN, QP, desc_c, desc_pe, PT, SL, WORK, PO, PL, OUT, qk_scale, out_scale,
    stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_pt_b, stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h, stride_pl_s, stride_o_b, stride_o_h, slot_div, num_reqs,
    PAGE_SIZE: gl.constexpr, D_CKV: gl.constexpr, D_PE: gl.constexpr, BLOCK_H: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WIDENED: gl.constexpr, PARTS: gl.constexpr, CHAIN: gl.constexpr,
    MERGE: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    """grid (H // BLOCK_H, programs), the tokens kernel's arguments over an fp8 cache: ``BLOCK_H`` 16 or 32 heads, one
    multiplier warpgroup per 16 (the kernel's ``num_warps`` = 4 warps, then the widener's :data:`WIDEN_WARPS` (8;
    :data:`WIDEN_WARPS_2` = 4 at 32 heads), then at 32 heads the second multiplier's 4), ``STAGES`` fp8 stages,
    ``WIDENED`` widened buffers of ``BLOCK_N / PARTS`` rows, score chains of ``CHAIN`` columns. Split requests are
    all merged by the merge kernel (``MERGE`` = 0, ``num_reqs`` unused)."""
    gl.static_assert(MERGE == 0, "the fp8 kernel leaves every split request to the merge kernel")
    gl.static_assert((CHAIN == 256) | (CHAIN == 128), "score chains of 256 or 128 columns of a latent half")
    gl.static_assert(BLOCK_H % HEADS_PER_MULTIPLIER == 0, "16 or 32 heads per program")
    _pdl_enter(PDL)  # the worker warps start at the partition below, after this wait (and wait again themselves)
    HB: gl.constexpr = HEADS_PER_MULTIPLIER
    MULT: gl.constexpr = BLOCK_H // HB
    D_HALF: gl.constexpr = D_CKV // 2
    F8: gl.constexpr = gl.float8e4nv
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * HB, D_HALF], F8)
    qpe_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * HB, D_PE], F8)
    q_lo = gl.allocate_shared_memory(F8, [MULT, 2 * HB, D_HALF], q_layout)
    q_hi = gl.allocate_shared_memory(F8, [MULT, 2 * HB, D_HALF], q_layout)
    q_pe = gl.allocate_shared_memory(F8, [MULT, 2 * HB, D_PE], qpe_layout)
    kv_lo, kv_hi, kv_pe, w_lo, w_hi = _widener_rings(desc_c, desc_pe, BLOCK_N, STAGES, WIDENED, BLOCK_N // PARTS,
                                                     D_CKV, D_PE)  # fmt: skip
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HB], gl.float16)
    p_smem = gl.allocate_shared_memory(gl.float16, [MULT, BLOCK_N, HB], p_layout)
    bars, read, full, empty = _widener_barriers(STAGES, WIDENED, MULT)  # every multiplier reads each stage and buffer

    # the partitions' argument tuples are written out in full: tuples of constexprs built and joined in the kernel
    # body lose their constexpr-ness (triton 3.6)
    if MULT == 1:
        gl.warp_specialize(
            [
                (_multiplier, (
                    QN, QP, SL, WORK, PO, PL, OUT, qk_scale, out_scale, stride_qn_b, stride_qn_h, stride_qp_b,
                    stride_qp_h, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s,
                    stride_o_b, stride_o_h, slot_div, q_lo.index(0), q_hi.index(0), q_pe.index(0), kv_lo, kv_hi, kv_pe,
                    w_lo, w_hi, p_smem.index(0), bars, read, full, empty, D_CKV, D_PE, BLOCK_H, BLOCK_N, STAGES,
                    WIDENED, PARTS, CHAIN, 0, PDL, num_warps,
                )),
                (_widener, (desc_c, desc_pe, PT, SL, WORK, stride_pt_b, kv_lo, kv_hi, kv_pe, w_lo, w_hi, bars, read,
                            full, empty, PAGE_SIZE, D_CKV, BLOCK_N, STAGES, WIDENED, PARTS, WIDEN_WARPS, PDL)),
            ],
            [WIDEN_WARPS],
            [WIDEN_REGS],
        )
    else:  # the second multiplier's warps after the widener's, so that they make a whole warpgroup
        gl.warp_specialize(
            [
                (_multiplier, (
                    QN, QP, SL, WORK, PO, PL, OUT, qk_scale, out_scale, stride_qn_b, stride_qn_h, stride_qp_b,
                    stride_qp_h, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s,
                    stride_o_b, stride_o_h, slot_div, q_lo.index(0), q_hi.index(0), q_pe.index(0), kv_lo, kv_hi, kv_pe,
                    w_lo, w_hi, p_smem.index(0), bars, read, full, empty, D_CKV, D_PE, BLOCK_H, BLOCK_N, STAGES,
                    WIDENED, PARTS, CHAIN, 0, PDL, num_warps,
                )),
                (_widener, (desc_c, desc_pe, PT, SL, WORK, stride_pt_b, kv_lo, kv_hi, kv_pe, w_lo, w_hi, bars, read,
                            full, empty, PAGE_SIZE, D_CKV, BLOCK_N, STAGES, WIDENED, PARTS, WIDEN_WARPS_2, PDL)),
                (_multiplier, (
                    QN, QP, SL, WORK, PO, PL, OUT, qk_scale, out_scale, stride_qn_b, stride_qn_h, stride_qp_b,
                    stride_qp_h, stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_pl_s,
                    stride_o_b, stride_o_h, slot_div, q_lo.index(1), q_hi.index(1), q_pe.index(1), kv_lo, kv_hi, kv_pe,
                    w_lo, w_hi, p_smem.index(1), bars, read, full, empty, D_CKV, D_PE, BLOCK_H, BLOCK_N, STAGES,
                    WIDENED, PARTS, CHAIN, 1, PDL, num_warps,
                )),
            ],
            [WIDEN_WARPS_2, num_warps],
            [WIDEN_REGS_2, MULTIPLIER_REGS_2],
        )  # fmt: skip
