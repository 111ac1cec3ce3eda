"""Launchers of the fused decoder-layer kernels (:mod:`backends.kernels.decoder.decoder_kernels`).

CUDA-graph safe: outputs are allocated with ``torch.empty`` (the graph's pool), grids come from shapes, no host
sync. Each launcher's torch equivalent is the unfused path in :mod:`runtime.model.deepseek.ops` (``TorchOps``),
which the GPU tests compare against.
"""

from __future__ import annotations

import torch
import triton

from backends.kernels.checks import interpreted, require
from backends.kernels.decoder import decoder_kernels as k
from backends.kernels.gemm import skinny
from backends.kernels.pdl import use_pdl


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight) in one pass; delta None: (x, RMSNorm(x) * weight).

    x, delta [T, D] (rows may be strided, the last dim contiguous), weight [D], all in one dtype ->
    (residual [T, D] (x itself when delta is None), normed [T, D]) contiguous, in x's dtype.
    """
    t, d = x.shape
    require(x.stride(-1) == 1 and weight.shape == (d,) and weight.dtype == x.dtype,
            lambda: f"x [T, D] with a contiguous last dim and weight [D] of x's dtype; got x {tuple(x.shape)} "
                    f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    y = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if delta is None:
        r, dd, has = x, x, False
    else:
        require(delta.shape == x.shape and delta.dtype == x.dtype and delta.stride(-1) == 1,
                lambda: f"delta of x's shape and dtype; got {tuple(delta.shape)} {delta.dtype}")
        r, dd, has = torch.empty_like(y), delta, True
    if t:
        block = _pow2(d)
        p = use_pdl(pdl, k._rms_norm_kernel, x.device)
        k._rms_norm_kernel[(t,)](x, dd, weight, r, y, x.stride(0), dd.stride(0), r.stride(0), y.stride(0), d,
                                 float(eps), HAS_DELTA=has, BLOCK=block, PDL=p, launch_pdl=p,
                                 num_warps=min(16, max(1, block // 512)))
    return r, y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """RMSNorm(x) * weight: x [T, D] (rows may be strided) -> [T, D] contiguous."""
    return add_rms_norm(x, None, weight, eps, pdl)[1]


#: the widest row :func:`v4_rms_norm` takes in one program (V4-Flash's mHC input: 4 streams x 4096)
V4_NORM_MAX = 32768
#: the input and output dtypes :func:`v4_rms_norm` takes
V4_NORM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def v4_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None,
                pdl: bool = False) -> torch.Tensor:
    """DeepSeek-V4's RMSNorms over the last dim in one launch (``runtime.model.dsv4.norms``): with ``weight``,
    ``(weight * (x * rsqrt(mean(x^2) + eps))).to(dtype)`` computed in float32 and rounded once; without,
    ``x * rsqrt(mean(x^2) + eps).to(dtype)``. ``dtype``: ``out_dtype`` (default x's; x is read as it is, so
    ``out_dtype=float32`` equals the torch norm of ``x.to(float32)``). x [..., D] bf16 / fp16 / float32, its rows
    of D contiguous; weight [D] (any float dtype) or None; D <= :data:`V4_NORM_MAX`. Returns x's shape,
    contiguous."""
    d = x.shape[-1] if x.dim() else 0
    out_dtype = out_dtype or x.dtype
    require(x.dim() >= 1 and x.dtype in V4_NORM_DTYPES and out_dtype in V4_NORM_DTYPES and 0 < d <= V4_NORM_MAX
            and (weight is None or (weight.shape == (d,) and weight.is_contiguous())),
            lambda: f"v4_rms_norm: x [..., D] bf16 / fp16 / float32 with 0 < D <= {V4_NORM_MAX}, weight [D] contiguous "
                    f"or None, out_dtype bf16 / fp16 / float32; got x {tuple(x.shape)} {x.dtype}, weight "
                    f"{None if weight is None else (tuple(weight.shape), weight.dtype)}, out_dtype {out_dtype}. Fix: "
                    f"runtime.model.dsv4.norms (torch)")
    rows = x.reshape(-1, d)  # a view where the rows allow it, else a copy
    require(rows.stride(-1) == 1, lambda: f"v4_rms_norm: x's last dim contiguous; got strides {tuple(x.stride())}")
    y = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        block = _pow2(d)
        p = use_pdl(pdl, k._rms_norm_kernel, x.device)
        w = rows if weight is None else weight
        k._rms_norm_kernel[(rows.shape[0],)](rows, rows, w, y, y, rows.stride(0), rows.stride(0), y.stride(0),
                                             y.stride(0), d, float(eps), HAS_DELTA=False, BLOCK=block, PDL=p,
                                             MODE=2 if weight is None else 1, launch_pdl=p,
                                             num_warps=min(16, max(1, block // 512)))
    return y.view(x.shape)


def rope_latent(q: torch.Tensor | None, nope: int, kv: torch.Tensor | None, weight: torch.Tensor | None,
                cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor | None, cache: torch.Tensor | None,
                eps: float, interleave: bool, pdl: bool = False,
                w_uk: torch.Tensor | None = None) -> torch.Tensor | None:
    """The MLA's q/kv preparation, in place, in one launch (either half may be None):

    * q [T, H, nope + R] (last dim contiguous): RoPE on ``q[..., nope:]``.
    * kv [T, C + R] (the kv_a_proj_with_mqa output; rows may be strided), weight [C]: RMSNorm of ``kv[:, :C]``
      (times weight), RoPE of ``kv[:, C:]``, each row also stored at its slot of the cache (slots [T] int64,
      cache [num_slots, C + R] with contiguous rows, or both None: no write).
    * w_uk [H, nope, N] (q given, T <= 16, q's dtype bf16 / fp16): also the absorbed query
      ``q[..., :nope] @ w_uk`` per head, returned as [T, H, N] (as :func:`skinny.head_linear`); None otherwise.

    cos, sin [T, R/2] float32.
    """
    t = cos.shape[0]
    half = cos.shape[1]
    require(cos.shape == sin.shape and cos.stride(0) == sin.stride(0) and cos.stride(-1) == 1,
            lambda: f"cos / sin [T, R/2] of one layout; got {tuple(cos.shape)}, {tuple(sin.shape)}")
    do_q, do_kv, absorb = q is not None, kv is not None, w_uk is not None
    if do_q:
        require(q.dim() == 3 and q.shape[0] == t and q.shape[2] == nope + 2 * half and q.stride(-1) == 1,
                lambda: f"q [T, H, nope + R] = [{t}, H, {nope + 2 * half}] with a contiguous last dim; got "
                        f"{tuple(q.shape)}")
    c = weight.shape[0] if do_kv else 0
    if do_kv:
        require(kv.shape == (t, c + 2 * half) and kv.stride(-1) == 1 and weight.dtype == kv.dtype,
                lambda: f"kv [T, C + R] = [{t}, {c + 2 * half}] and weight [C] of kv's dtype; got kv {tuple(kv.shape)} "
                        f"{kv.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    write = do_kv and cache is not None
    if write:
        require(cache.shape[-1] == c + 2 * half and cache.stride(-1) == 1 and slots.shape == (t,),
                lambda: f"cache [slots, {c + 2 * half}] and slots [T]; got cache {tuple(cache.shape)}, slots "
                        f"{tuple(slots.shape)}")
    q_abs, n_abs, n_blocks, block_n = None, 0, 1, 16
    if absorb:
        require(do_q and t <= skinny.MAX_ROWS and q.dtype in skinny.DOT_DTYPES and w_uk.dtype == q.dtype
                and w_uk.dim() == 3 and w_uk.shape[:2] == (q.shape[1], nope) and w_uk.stride(-1) == 1,
                lambda: f"w_uk [H, nope, N] of q's dtype (bf16, fp16) with T <= {skinny.MAX_ROWS}; got w_uk "
                        f"{tuple(w_uk.shape)} {w_uk.dtype}, q {None if q is None else (tuple(q.shape), q.dtype)}")
        n_abs = w_uk.shape[2]
        q_abs = torch.empty(t, q.shape[1], n_abs, dtype=q.dtype, device=q.device)
        block_n = skinny.head_block_n(n_abs, q.shape[1])
        n_blocks = triton.cdiv(n_abs, block_n)
    if t == 0 or not (do_q or do_kv):
        return q_abs
    qq, kk, ww = (q if do_q else cos), (kv if do_kv else cos), (w_uk if absorb else cos)
    p = use_pdl(pdl, k._rope_latent_kernel, cos.device)
    grid = 2 * t + (n_blocks * q.shape[1] if absorb else 0)
    k._rope_latent_kernel[(grid,)](
        qq, kk, weight if do_kv else cos, cos, sin, slots if write else cos, cache if write else cos, ww,
        q_abs if absorb else cos, t, n_blocks, q.stride(0) if do_q else 0, q.stride(1) if do_q else 0,
        kv.stride(0) if do_kv else 0, cos.stride(0), cache.stride(0) if write else 0,
        w_uk.stride(0) if absorb else 0, w_uk.stride(1) if absorb else 0, q_abs.stride(0) if absorb else 0,
        q_abs.stride(1) if absorb else 0, q.shape[1] if do_q else 0, n_abs, float(eps), NOPE=nope, C=c, HALF=half,
        BLOCK_H=_pow2(q.shape[1] if do_q else 1), BLOCK_C=_pow2(c), BLOCK_J=_pow2(half),
        INTERLEAVE=bool(interleave), DO_Q=do_q, DO_LATENT=do_kv, WRITE_CACHE=write, ABSORB=absorb,
        BLOCK_N=block_n, BLOCK_K=min(128, _pow2(max(nope, 16))), PDL=p, launch_pdl=p, num_warps=4,
        num_stages=3)
    return q_abs


def silu_mul(x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """[N, 2I] (gate, then up; rows may be strided) -> silu(gate) * up [N, I]."""
    n, two_i = x.shape
    inter = two_i // 2
    require(x.stride(-1) == 1 and two_i % 2 == 0, lambda: f"x [N, 2I] with a contiguous last dim; got {tuple(x.shape)}")
    return _silu_mul(x[:, :inter], x[:, inter:], None, pdl)


#: the dtypes :func:`v4_swiglu` and :func:`v4_route` take (the V4 model dtypes FusedOps serves)
V4_MOE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def v4_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, pdl: bool = False) -> torch.Tensor:
    """DeepSeek-V4's clamped SwiGLU in one launch (``runtime.model.dsv4.moe.swiglu``): gate, up [N, I] (two
    tensors, e.g. the shared expert's two products; rows may be strided, last dims contiguous) of one dtype in
    :data:`V4_MOE_DTYPES` -> silu(min(gate, limit)) * clamp(up, -limit, limit) [N, I] contiguous, each torch op's
    rounding kept."""
    require(gate.dim() == 2 and up.shape == gate.shape and up.dtype == gate.dtype and gate.dtype in V4_MOE_DTYPES
            and gate.stride(-1) == 1 and up.stride(-1) == 1,
            lambda: f"v4_swiglu: gate and up [N, I] of one dtype in {V4_MOE_DTYPES}, last dims contiguous; got gate "
                    f"{tuple(gate.shape)} {gate.dtype} strides {gate.stride()}, up {tuple(up.shape)} {up.dtype} "
                    f"strides {up.stride()}. Fix: runtime.model.dsv4.moe.swiglu (torch)")
    return _silu_mul(gate, up, float(limit), pdl)


def _silu_mul(gate: torch.Tensor, up: torch.Tensor, limit: float | None, pdl: bool) -> torch.Tensor:
    n, inter = gate.shape
    y = torch.empty(n, inter, dtype=gate.dtype, device=gate.device)
    if n and inter:
        block = min(1024, _pow2(inter))
        p = use_pdl(pdl, k._silu_mul_kernel, gate.device)
        k._silu_mul_kernel[(n, triton.cdiv(inter, block))](gate, up, y, gate.stride(0), up.stride(0), y.stride(0),
                                                           inter, 0.0 if limit is None else limit, BLOCK=block,
                                                           CLAMP=limit is not None, PDL=p, launch_pdl=p,
                                                           num_warps=4)
    return y


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor | None, n_group: int, topk_group: int, top_k: int,
                  norm: bool, scale: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 noaux_tc routing in one kernel: logits [T, E] float32, bias [E] float32 or None ->
    (weights [T, k] float32, expert ids [T, k] int64), as ``runtime.model.deepseek.moe.route``."""
    t, e = logits.shape
    per = e // n_group
    require(logits.dtype == torch.float32 and logits.stride(-1) == 1 and e % n_group == 0 and top_k <= e,
            lambda: f"float32 logits [T, E] with E divisible by n_group and top_k <= E; got {tuple(logits.shape)} "
                    f"{logits.dtype}, n_group {n_group}, top_k {top_k}")
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        p = use_pdl(pdl, k._route_sigmoid_kernel, logits.device)
        k._route_sigmoid_kernel[(t,)](logits, bias if bias is not None else logits, w, ids, logits.stride(0),
                                      float(scale), G=n_group, PER=per, TOPK_GROUP=topk_group, K=top_k,
                                      BLOCK_G=_pow2(n_group), BLOCK_P=_pow2(per), BLOCK_K=_pow2(top_k),
                                      HAS_BIAS=bias is not None, NORM=bool(norm), TOP2=per >= 2, PDL=p,
                                      launch_pdl=p, num_warps=1)  # one warp: the 2K reductions stay in registers
    return w, ids


#: V4's scoring functions (``runtime.model.deepseek.routing.ScoringFunc`` values), in the order of
#: :func:`decoder_kernels._v4_scores`'s SCORING
V4_SCORES = ("sqrtsoftplus", "softmax", "sigmoid")
#: the most experts :func:`v4_route` takes (one program holds a token's row)
V4_ROUTE_MAX_E = 4096


def v4_route(logits: torch.Tensor, scoring: str, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
             input_ids: torch.Tensor | None, top_k: int, norm_eps: float, scale: float,
             pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 routing in one kernel, as ``runtime.model.deepseek.routing.route`` with V4's router (no expert
    groups, always renormalised): logits [T, E] (bf16 / fp16 / float32, E <= :data:`V4_ROUTE_MAX_E`), ``scoring``
    one of :data:`V4_SCORES`; top-k layers: bias [E] (any float dtype, rounded to the logits' dtype) or None;
    hash layers: tid2eid [vocab, k] integer and input_ids [T] integer (the ids from the table's rows; an id past
    E weighs 0 where torch raises) -> (weights [T, k] in the logits' dtype, expert ids [T, k] int64). Top-k ids
    come in descending choice order, the lowest id first among equal choices (torch's unsorted order is
    unspecified: only the order the experts' outputs are summed in differs)."""
    t, e = logits.shape
    hashed = tid2eid is not None
    require(logits.dtype in V4_MOE_DTYPES and logits.stride(-1) == 1 and 0 < top_k <= e <= V4_ROUTE_MAX_E
            and scoring in V4_SCORES and (bias is None or (bias.shape == (e,) and bias.is_contiguous()))
            and (not hashed or (input_ids is not None and input_ids.shape == (t,) and tid2eid.dim() == 2
                                and tid2eid.shape[1] == top_k and tid2eid.stride(-1) == 1)),
            lambda: f"v4_route: logits [T, E] in {V4_MOE_DTYPES} with 0 < top_k <= E <= {V4_ROUTE_MAX_E}, scoring in "
                    f"{V4_SCORES}, bias [E] contiguous or None, hash layers tid2eid [vocab, top_k] and input_ids [T]; "
                    f"got logits {tuple(logits.shape)} {logits.dtype}, scoring {scoring!r}, top_k {top_k}, bias "
                    f"{None if bias is None else tuple(bias.shape)}, tid2eid "
                    f"{None if not hashed else tuple(tid2eid.shape)}, input_ids "
                    f"{None if input_ids is None else tuple(input_ids.shape)}. Fix: runtime.model.dsv4.moe.route "
                    f"(torch)")
    w = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t:
        kern = k._v4_route_kernel
        p = use_pdl(pdl, kern, logits.device)
        block_e = _pow2(e)
        kern[(t,)](logits, bias if bias is not None else logits, tid2eid if hashed else ids,
                   input_ids if hashed else ids, w, ids, logits.stride(0), tid2eid.stride(0) if hashed else 0, e,
                   float(scale), float(norm_eps), SCORING=V4_SCORES.index(scoring), K=top_k, BLOCK_E=block_e,
                   BLOCK_K=_pow2(top_k), HAS_BIAS=bias is not None and not hashed, HASH=hashed,
                   LIBDEVICE=not interpreted(kern), PDL=p, launch_pdl=p, enable_fp_fusion=False,
                   num_warps=1 if block_e <= 256 else 4)  # V4-Flash's 256 experts: one warp, as route_sigmoid
    return w, ids


#: (token, slot) pairs from which :func:`moe_dispatch` takes the block counting sort (three launches: a histogram
#: per block of :data:`DISPATCH_BLOCK` pairs, one scan program, a stable scatter) instead of the one-launch counting
#: kernel, which compares every pair with every other: O(N^2), 7.4 ms a call at 8192 prefill tokens x 8 slots on an
#: H200 (44% of a prefill step of 8 DeepSeek-V3 TP8 layers); a decode batch of 256 x 8 stays on the kernel
SORT_DISPATCH_FROM = 4096
#: pairs per block of the block counting sort: each pair is compared with the pairs of its block only
DISPATCH_BLOCK = 256


def moe_dispatch(ids: torch.Tensor, num_experts: int, sort_from: int = SORT_DISPATCH_FROM, shared: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert, stably: ids [T, k] int64 in [0, num_experts) ->
    (tokens [T*k] int64: the token of each sorted position, inv [T*k] int64: each pair's sorted position,
    offsets [E] int32: inclusive cumulative rows per expert). Below ``sort_from`` pairs one counting-sort launch,
    from it the block counting sort (three launches); no host sync either way, the same three tensors as a
    stable argsort of the ids. ``shared``: one more group, E, of every token in order after the pairs (the
    shared expert stacked after the routed ones): tokens [T*k + T], offsets [E + 1]."""
    t, top_k = ids.shape
    n = t * top_k
    extra = t if shared else 0
    require(ids.is_contiguous(), lambda: f"contiguous ids [T, k]; got strides {ids.stride()}")
    tokens = torch.empty(n + extra, dtype=torch.int64, device=ids.device)
    inv = torch.empty(n, dtype=torch.int64, device=ids.device)
    offs = torch.empty(num_experts + shared, dtype=torch.int32, device=ids.device)
    if n >= sort_from:
        nb, block_e = triton.cdiv(n, DISPATCH_BLOCK), _pow2(num_experts + 1)  # a spare bin past the experts
        starts = torch.empty(nb, block_e, dtype=torch.int32, device=ids.device)
        k._moe_block_count_kernel[(nb,)](ids, starts, n, BLOCK=DISPATCH_BLOCK, BLOCK_E=block_e, num_warps=4)
        k._moe_block_scan_kernel[(1,)](starts, offs, tokens, n, nb, num_experts, extra, BLOCK_B=16, BLOCK_E=block_e,
                                       num_warps=8)
        k._moe_block_scatter_kernel[(nb,)](ids, starts, tokens, inv, n, K=top_k, BLOCK=DISPATCH_BLOCK,
                                           BLOCK_E=block_e, BLOCK_J=32, num_warps=4)
        return tokens, inv, offs
    block_i = 64 if n <= 1024 else 128
    k._moe_dispatch_kernel[(max(1, triton.cdiv(n, block_i)),)](ids, tokens, inv, offs, n, num_experts, extra, K=top_k,
                                                                BLOCK_I=block_i, BLOCK_J=64,
                                                                BLOCK_E=_pow2(num_experts), num_warps=4)
    return tokens, inv, offs


def moe_combine(y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                dtype: torch.dtype, limit: torch.Tensor | None = None) -> torch.Tensor:
    """Per token the weighted sum of its k expert rows (float32, slot order), rounded to ``dtype``, plus the
    shared experts' output. y [T*k, D] (sorted by expert); inv [T*k]; weights [T, k] float32; shared [T, D] or
    None; ``limit``: a 1-element int32 / int64 tensor, rows of y from it on (other ranks' pairs, left unwritten by
    the grouped GEMMs) read as zeros (on the device: no host sync) -> [T, D] in ``dtype``."""
    t, top_k = weights.shape
    d = y.shape[1]
    require(y.stride(-1) == 1 and weights.is_contiguous() and inv.shape == (t * top_k,)
            and (shared is None or (shared.shape == (t, d) and shared.stride(-1) == 1)),
            lambda: f"y [T*k, D], inv [T*k], weights [T, k], shared [T, D]; got y {tuple(y.shape)}, inv "
                    f"{tuple(inv.shape)}, weights {tuple(weights.shape)}")
    require(limit is None or (limit.numel() == 1 and limit.dtype in (torch.int32, torch.int64)),
            lambda: f"limit a 1-element int32 / int64 tensor or None; got "
                    f"{None if limit is None else tuple(limit.shape)}")
    out = torch.empty(t, d, dtype=dtype, device=y.device)
    if t:
        block = min(1024, _pow2(d))
        k._moe_combine_kernel[(t, triton.cdiv(d, block))](
            y, inv, weights, shared if shared is not None else y, limit if limit is not None else inv, out, d,
            y.stride(0), shared.stride(0) if shared is not None else 0, out.stride(0), K=top_k,
            HAS_SHARED=shared is not None, HAS_LIMIT=limit is not None, BLOCK_D=block, num_warps=4)
    return out
