"""Triton kernels of the one-shot all-reduce over symmetric (CUDA IPC) buffers (launchers:
:mod:`backends.kernels.comm.peer_allreduce`).

Every rank runs the same grid. Program ``b`` of each rank

1. copies its share of the input (chunks ``b, b + grid, ...``; the fused kernel: rows) into this rank's buffer,
2. meets program ``b`` of every other rank at a barrier of signal flags (:func:`block_barrier`),
3. reads the same share from every rank's buffer (peer pointers; own one included), sums in float32 in rank order
   (the same bits on every rank) and stores the result (the fused kernel: + residual, RMSNorm),
4. meets them again, so no rank overwrites its buffer (the next all-reduce) while a peer still reads it.

Program ``b`` of a rank only reads what program ``b`` of every rank wrote, so a per-program barrier is enough.

The barrier is the zero-reset signal pad of PyTorch's symmetric memory: a sender spins on a system-scope
compare-and-swap 0 -> 1 of the flag ``[slot, sender]`` in the receiver's pad, the receiver spins on 1 -> 0 of it.
Every flag is back at 0 after each barrier, so the kernels need no counter and replay in CUDA graphs. Start
barriers use slots ``0 .. MAX_PROGRAMS - 1``, end barriers the next ``MAX_PROGRAMS``. Plain stores and loads over
NVLink peer mappings only: no multicast (multimem / NVLS) instruction anywhere.

``SYNC=False`` (Triton's CPU interpreter, which runs no inline PTX) skips the barriers: the single-process tests
fill the other "ranks'" buffers themselves and check the arithmetic and the peer-pointer reads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _flat_tid():
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _cas_spin(addrs, SEM: tl.constexpr, OLD: tl.constexpr, NEW: tl.constexpr):
    """Spin until the flag at each address goes OLD -> NEW (system-scope compare-and-swap, ``SEM`` order): the
    sender's 0 -> 1, the receiver's 1 -> 0 (the flags end at zero, so graphs replay without counters)."""
    tl.inline_asm_elementwise(
        f"""{{
        .reg .u32 %old;
        .reg .pred %ok;
        cas_retry:
        atom.{SEM}.sys.global.cas.b32 %old, [$1], {OLD}, {NEW};
        setp.eq.u32 %ok, %old, {OLD};
        @!%ok bra cas_retry;
        mov.u32 $0, %old;
        }}""",
        "=r, l", [addrs], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def block_barrier(PADS, slot, RANK: tl.constexpr, WORLD: tl.constexpr, RELEASE: tl.constexpr,
                  ACQUIRE: tl.constexpr):
    """Program ``slot`` of every rank meets here. ``PADS``: int64 [WORLD], each rank's signal pad address (uint32
    flags ``[slot, rank]``). RELEASE: this program's earlier stores are visible to the peers after it; ACQUIRE:
    the peers' earlier stores are visible to this program after it. Threads 0 .. WORLD - 1 signal (thread r: rank
    r's flag; a [WORLD] tensor is held by those threads, replicated on the others)."""
    ranks = tl.arange(0, WORLD)
    peer_pads = tl.load(PADS + ranks).to(tl.pointer_type(tl.uint32))
    own_pad = tl.load(PADS + RANK).to(tl.pointer_type(tl.uint32))
    send = peer_pads + slot * WORLD + RANK
    wait = own_pad + slot * WORLD + ranks
    if RELEASE:
        tl.debug_barrier()
    if _flat_tid() < WORLD:
        _cas_spin(send, "release" if RELEASE else "relaxed", 0, 1)
        _cas_spin(wait, "acquire" if ACQUIRE else "relaxed", 1, 0)
    if ACQUIRE:
        tl.debug_barrier()


@triton.jit
def _peer_sum(BUFS, offs, mask, DT: tl.constexpr, WORLD: tl.constexpr):
    """sum over r of buffer_r[offs] in float32, r = 0 .. WORLD - 1 in order (bypassing L1: peers wrote it)."""
    acc = tl.zeros(offs.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        src = tl.load(BUFS + r).to(tl.pointer_type(DT))
        acc += tl.load(src + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    return acc


@triton.jit
def oneshot_kernel(X, OUT, BUFS, PADS, numel, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                   MAX_PROGRAMS: tl.constexpr, SYNC: tl.constexpr):
    """OUT [numel] = sum over the ranks of X [numel] (X's dtype; float32 sums). BUFS / PADS: int64 [WORLD] buffer and
    signal pad addresses, this rank's at RANK."""
    DT: tl.constexpr = X.dtype.element_ty
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    own = tl.load(BUFS + RANK).to(tl.pointer_type(DT))
    for start in range(pid * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        m = offs < numel
        tl.store(own + offs, tl.load(X + offs, mask=m), mask=m)
    if SYNC:
        block_barrier(PADS, pid, RANK, WORLD, True, True)
    for start in range(pid * BLOCK, numel, step):
        offs = start + tl.arange(0, BLOCK)
        m = offs < numel
        tl.store(OUT + offs, _peer_sum(BUFS, offs, m, DT, WORLD).to(DT), mask=m)
    if SYNC:
        block_barrier(PADS, MAX_PROGRAMS + pid, RANK, WORLD, True, False)


@triton.jit
def fused_add_rms_norm_kernel(P, RES, W, RES_OUT, Y, T, D, eps, BUFS, PADS, RANK: tl.constexpr,
                              WORLD: tl.constexpr, BLOCK_D: tl.constexpr, MAX_PROGRAMS: tl.constexpr,
                              SYNC: tl.constexpr):
    """Per row t of P / RES [T, D] (contiguous, one dtype DT), W [D]:
    s = sum over the ranks of P[t] (float32, rounded to DT: the all-reduce's result), r = (RES[t] + s) rounded
    -> RES_OUT[t]; Y[t] = ((r * rsqrt(mean(r^2) + eps)) rounded) * W, rounded: the unfused all-reduce then
    add + RMSNorm (decoder_kernels._rms_norm_kernel), bit for bit up to float32 summation order."""
    DT: tl.constexpr = P.dtype.element_ty
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    own = tl.load(BUFS + RANK).to(tl.pointer_type(DT))
    for t in range(pid, T, n_prog):
        row = t * D  # < 2**31: the message fits the buffer
        tl.store(own + row + cols, tl.load(P + row + cols, mask=cm), mask=cm)
    if SYNC:
        block_barrier(PADS, pid, RANK, WORLD, True, True)
    w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float32)
    for t in range(pid, T, n_prog):
        row = t * D  # < 2**31: the message fits the buffer
        s = _peer_sum(BUFS, row + cols, cm, DT, WORLD).to(DT).to(tl.float32)
        r = (tl.load(RES + row + cols, mask=cm, other=0.0).to(tl.float32) + s).to(DT)
        tl.store(RES_OUT + row + cols, r, mask=cm)
        x = r.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        y = (x * rstd).to(DT).to(tl.float32) * w
        tl.store(Y + row + cols, y.to(DT), mask=cm)
    if SYNC:
        block_barrier(PADS, MAX_PROGRAMS + pid, RANK, WORLD, True, False)
