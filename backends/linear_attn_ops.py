"""Gated linear attention with a per-head scalar decay (lightning / simple-GLA form): the torch math and the
fla-core GPU path.

For head h with log-decay ``g[h] < 0`` (fixed per head), state ``S`` of shape [Dk, Dv], and every token t::

    S_t = exp(g[h]) * S_{t-1} + k_t^T v_t        (decay first, then add the current token)
    o_t = scale * q_t @ S_t                      (the output includes the current token)

This is fla-core 0.6.0's convention for ``chunk_simple_gla`` / ``fused_recurrent_simple_gla`` called with
``g_gamma=g`` ([H], natural-log decay, data independent), ``scale`` applied to q, states in the [K, V] layout
(``state_v_first=False``), inputs time-first ([B, T, H, D]), ``initial_state`` [N, H, K, V] and the final state
returned in float32. fla's ``naive_recurrent_simple_gla`` (fla/ops/simple_gla/naive.py) is the same loop as
:func:`recurrent_reference` with a per-token ``g`` [B, T, H] equal to ``g_gamma`` broadcast over T.

Compute dtype: float32 for float16 / bfloat16 / float32 inputs, float64 for float64 inputs (so the reference can
run in float64 as the oracle). Outputs ``o`` come back in q's dtype (as fla returns them); states stay in the
compute dtype (float32 in the runtime, as fla's final states).

Every function here is host-sync free (no ``.item()``, no ``.tolist()`` on device tensors): the decode step runs
inside a CUDA graph. The fla wrappers import fla inside the function, so this module imports on a CPU machine.
"""

from __future__ import annotations

import torch

FLA_INSTALL_FIX = (
    "install fla-core>=0.6.0 with Triton on a CUDA machine (pip install 'mla-runtime[gpu]'), "
    "or use the torch implementation (backend impl=torch)"
)


# ------------------------------------------------------------------------------------------------- decays
def decay_rates(num_heads: int) -> torch.Tensor:
    """Per-head log-decay, ALiBi-style slopes: ``g[h] = -(2 ** (-8 * (h + 1) / num_heads))``.

    Parameters
    ----------
    num_heads : int
        H >= 1.

    Returns
    -------
    torch.Tensor
        [H] float32 on the CPU, every value in [-0.5, 0) (head 0 forgets fastest, head H-1 decays by
        ``exp(-2**-8)`` per token).
    """
    if int(num_heads) < 1:
        raise ValueError(
            f"decay_rates: got num_heads={num_heads}; expected an integer >= 1. "
            "Fix: pass the number of linear-attention heads of the layer."
        )
    h = torch.arange(1, int(num_heads) + 1, dtype=torch.float64)
    return (-torch.exp2(-8.0 * h / int(num_heads))).to(torch.float32)


# ------------------------------------------------------------------------------------------------- checks
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(fn: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{fn}: {name} has shape {tuple(t.shape)}; expected {tuple(shape)}. "
            "Fix: pass q, k [T or B, H, Dk], v [.., H, Dv], g [H] and the state [.., H, Dk, Dv] of the same "
            "heads and head dims."
        )


def _check_token_major(fn: str, q, k, v, g) -> tuple[int, int, int, int]:
    """q, k [N, H, Dk], v [N, H, Dv], g [H] -> (N, H, Dk, Dv)."""
    if q.dim() != 3:
        raise ValueError(
            f"{fn}: q has {q.dim()} dims (shape {tuple(q.shape)}); expected 3, [N, H, Dk]. "
            "Fix: pack tokens along dim 0 (no batch dim)."
        )
    n, h, dk = q.shape
    _check(fn, "k", k, (n, h, dk))
    if v.dim() != 3 or tuple(v.shape[:2]) != (n, h):
        raise ValueError(
            f"{fn}: v has shape {tuple(v.shape)}; expected ({n}, {h}, Dv) to match q {tuple(q.shape)}. "
            "Fix: pack v like q."
        )
    _check(fn, "g", g, (h,))
    return n, h, dk, int(v.shape[-1])


# ---------------------------------------------------------------------------------------------- torch path
def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor, scale: float
) -> torch.Tensor:
    """One token per request; updates ``state`` in place.

    Parameters
    ----------
    q, k : torch.Tensor
        [B, H, Dk], any float dtype.
    v : torch.Tensor
        [B, H, Dv], any float dtype.
    g : torch.Tensor
        [H] log-decay (< 0), any float dtype, on the state's device.
    state : torch.Tensor
        [B, H, Dk, Dv] float32 (or float64), contiguous or not; overwritten with ``exp(g) * state + k^T v``.
    scale : float
        Applied to q (``Dk ** -0.5`` in the runtime).

    Returns
    -------
    torch.Tensor
        o [B, H, Dv] in q's dtype: ``scale * q @ state_new``.

    No host sync and no data-dependent shapes: safe inside a CUDA graph.
    """
    b, h, dk, dv = _check_token_major("recurrent_step", q, k, v, g)
    _check("recurrent_step", "state", state, (b, h, dk, dv))
    if state.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"recurrent_step: state is {state.dtype}; expected torch.float32 (or float64). "
            "Fix: keep recurrent states in float32 (LinearStatePool does)."
        )
    cd = state.dtype
    state.mul_(torch.exp(g.to(cd))[None, :, None, None])
    state.add_(k.to(cd).unsqueeze(-1) * v.to(cd).unsqueeze(-2))
    o = torch.matmul(q.to(cd).unsqueeze(-2), state).squeeze(-2) * scale
    return o.to(q.dtype)


def recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-by-token loop: the oracle every other path is compared with.

    Parameters
    ----------
    q, k : torch.Tensor
        [T, H, Dk] of one request, any float dtype (float64 makes the whole loop float64).
    v : torch.Tensor
        [T, H, Dv].
    g : torch.Tensor
        [H] log-decay.
    initial_state : torch.Tensor
        [H, Dk, Dv], any float dtype; not modified.
    scale : float

    Returns
    -------
    o : torch.Tensor
        [T, H, Dv] in q's dtype.
    final_state : torch.Tensor
        [H, Dk, Dv] in the compute dtype (float32, or float64 for float64 inputs).
    """
    t, h, dk, dv = _check_token_major("recurrent_reference", q, k, v, g)
    _check("recurrent_reference", "initial_state", initial_state, (h, dk, dv))
    cd = _compute_dtype(q.dtype)
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    decay = torch.exp(g.to(cd))[:, None, None]
    s = initial_state.to(cd).clone()
    o = torch.empty(t, h, dv, dtype=cd, device=q.device)
    for i in range(t):
        s = decay * s + kc[i].unsqueeze(-1) * vc[i].unsqueeze(-2)
        o[i] = torch.einsum("hk,hkv->hv", qc[i], s) * scale
    return o.to(q.dtype), s


def chunked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked algorithm for one request: quadratic with a decay mask inside each chunk, the recurrent state
    carried between chunks (the same decomposition as fla's ``chunk_simple_gla`` with ``g_gamma``).

    Within a chunk of ``L`` tokens starting from state ``S`` (positions i, j = 0..L-1)::

        o_i   = scale * (exp(g (i+1)) q_i S  +  sum_{j<=i} exp(g (i-j)) (q_i . k_j) v_j)
        S_new = exp(g L) S  +  sum_j exp(g (L-1-j)) k_j^T v_j

    The intra-chunk parts of all chunks run as one batched product; only the [H, Dk, Dv] state passes from chunk
    to chunk (a loop over ``ceil(T / chunk_size)`` chunks, not over tokens).

    Parameters
    ----------
    q, k : torch.Tensor
        [T, H, Dk], any float dtype; T may be 0.
    v : torch.Tensor
        [T, H, Dv].
    g : torch.Tensor
        [H] log-decay.
    initial_state : torch.Tensor
        [H, Dk, Dv]; zeros for a fresh request, the carried state for a chunked-prefill continuation.
        Not modified.
    scale : float
    chunk_size : int
        Tokens per chunk, >= 1 (fla needs a power of two; this path takes any).

    Returns
    -------
    o : torch.Tensor
        [T, H, Dv] in q's dtype.
    final_state : torch.Tensor
        [H, Dk, Dv] in the compute dtype (float32, or float64 for float64 inputs).
    """
    t, h, dk, dv = _check_token_major("chunked_prefill", q, k, v, g)
    _check("chunked_prefill", "initial_state", initial_state, (h, dk, dv))
    if int(chunk_size) < 1:
        raise ValueError(f"chunked_prefill: got chunk_size={chunk_size}; expected >= 1. Fix: pass e.g. 64.")
    cd, dev = _compute_dtype(q.dtype), q.device
    c = int(chunk_size)
    n = -(-t // c)
    s = initial_state.to(cd).clone()
    if t == 0:
        return torch.empty(0, h, dv, dtype=q.dtype, device=dev), s
    pad = n * c - t
    # head-first, chunked: [H, N, C, D]; padded tokens have k = v = 0 so they add nothing to any state
    qc, kc, vc = (
        torch.nn.functional.pad(x.to(cd), (0, 0, 0, 0, 0, pad)).view(n, c, h, -1).permute(2, 0, 1, 3)
        for x in (q, k, v)
    )
    gc = g.to(cd)
    pos = torch.arange(c, dtype=cd, device=dev)
    lens = torch.full((n,), c, dtype=cd, device=dev)
    lens[-1] = t - (n - 1) * c
    # decay from the chunk start through token i (inclusive): exp(g (i+1))            [H, 1, C]
    q_decay = torch.exp(gc[:, None, None] * (pos + 1)[None, None, :])
    # decay from token j to the chunk's end: exp(g (L-1-j)); padding (j >= L) has k = 0  [H, N, C]
    to_end = (lens[:, None] - 1 - pos[None, :]).clamp_min(0)
    k_decay = torch.exp(gc[:, None, None] * to_end[None])
    # causal decay mask exp(g (i-j)) for j <= i                                        [H, C, C]
    diff = pos[:, None] - pos[None, :]
    mask = torch.exp(gc[:, None, None] * diff.clamp_min(0)[None]) * (diff >= 0)[None].to(cd)
    # intra-chunk outputs and per-chunk state contributions, all chunks at once
    attn = torch.matmul(qc, kc.transpose(-1, -2)) * mask[:, None]  # [H, N, C, C]
    o = torch.matmul(attn, vc)  # [H, N, C, Dv]
    contrib = torch.matmul((kc * k_decay[..., None]).transpose(-1, -2), vc)  # [H, N, Dk, Dv]
    chunk_decay = torch.exp(gc[:, None] * lens[None, :])  # [H, N]
    # inter-chunk: the state entering each chunk, then its contribution to that chunk's outputs
    starts = torch.empty(h, n, dk, dv, dtype=cd, device=dev)
    for i in range(n):
        starts[:, i] = s
        s = chunk_decay[:, i, None, None] * s + contrib[:, i]
    o = o + torch.matmul(qc * q_decay[..., None], starts)
    o = (o * scale).permute(1, 2, 0, 3).reshape(n * c, h, dv)[:t]
    return o.to(q.dtype), s


# ------------------------------------------------------------------------------------------------ fla path
def _import_fla():
    try:
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    except ImportError as e:
        raise ImportError(f"fla-core is not importable ({e}). Fix: {FLA_INSTALL_FIX}.") from e
    return chunk_simple_gla, fused_recurrent_simple_gla


def _check_fla_chunk_size(fn: str, chunk_size: int) -> None:
    c = int(chunk_size)
    if c < 16 or c & (c - 1):
        raise ValueError(
            f"{fn}: got chunk_size={chunk_size}; expected a power of two >= 16 (fla-core's chunk kernels). "
            "Fix: pass 64 (fla's default)."
        )


def fla_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_state: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunked_prefill` through fla-core's ``chunk_simple_gla`` (Triton, CUDA only).

    Same arguments and results: q, k [T, H, Dk], v [T, H, Dv], g [H], initial_state [H, Dk, Dv] ->
    (o [T, H, Dv] in q's dtype, final_state [H, Dk, Dv] float32). k and v are cast to q's dtype (fla's
    ``tl.dot`` needs one dtype); fla keeps the per-chunk states in that dtype, so bf16 inputs carry about 1e-2
    relative error.
    """
    t, h, dk, dv = _check_token_major("fla_chunk_prefill", q, k, v, g)
    _check("fla_chunk_prefill", "initial_state", initial_state, (h, dk, dv))
    o, ht = fla_chunk_prefill_varlen(
        q, k, v, g, initial_state.unsqueeze(0), torch.tensor([0, t], dtype=torch.int64, device=q.device),
        torch.tensor([0, t], dtype=torch.int64), scale, chunk_size,
    )
    return o, ht[0]


def fla_chunk_prefill_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    initial_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many requests in one ``chunk_simple_gla`` call (its ``cu_seqlens`` variable-length form).

    Parameters
    ----------
    q, k : torch.Tensor
        [T, H, Dk] packed request by request.
    v : torch.Tensor
        [T, H, Dv].
    g : torch.Tensor
        [H] log-decay (passed as fla's ``g_gamma``).
    initial_states : torch.Tensor
        [N, H, Dk, Dv], one per request (float32 recommended; fla reads it as float32).
    cu_seqlens : torch.Tensor
        [N+1] int64 on q's device: request n is rows ``cu_seqlens[n]:cu_seqlens[n+1]``; every request >= 1 token.
    cu_seqlens_cpu : torch.Tensor
        [N+1] int64 host mirror (spares fla a device-to-host copy).
    scale : float
    chunk_size : int
        Power of two >= 16.

    Returns
    -------
    o : torch.Tensor
        [T, H, Dv] in q's dtype.
    final_states : torch.Tensor
        [N, H, Dk, Dv] float32.
    """
    t, h, dk, dv = _check_token_major("fla_chunk_prefill_varlen", q, k, v, g)
    n = int(cu_seqlens_cpu.shape[0]) - 1
    _check("fla_chunk_prefill_varlen", "initial_states", initial_states, (n, h, dk, dv))
    _check_fla_chunk_size("fla_chunk_prefill_varlen", chunk_size)
    chunk_simple_gla, _ = _import_fla()
    o, ht = chunk_simple_gla(
        q.unsqueeze(0),
        k.to(q.dtype).unsqueeze(0),
        v.to(q.dtype).unsqueeze(0),
        g_gamma=g.to(torch.float32).contiguous(),
        scale=float(scale),
        initial_state=initial_states.contiguous(),
        output_final_state=True,
        cu_seqlens=cu_seqlens.to(torch.int64),
        cu_seqlens_cpu=cu_seqlens_cpu.to(torch.int64),
        chunk_size=int(chunk_size),
    )
    return o[0].to(q.dtype), ht


def fla_recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, state: torch.Tensor, scale: float
) -> torch.Tensor:
    """:func:`recurrent_step` through fla-core's ``fused_recurrent_simple_gla`` (Triton, CUDA only).

    Same arguments and result: q, k [B, H, Dk], v [B, H, Dv], g [H], state [B, H, Dk, Dv] float32 (updated in
    place from fla's float32 final state) -> o [B, H, Dv] in q's dtype. Host-sync free; inside a CUDA graph it
    needs one eager call first (Triton autotunes on its first call).
    """
    b, h, dk, dv = _check_token_major("fla_recurrent_step", q, k, v, g)
    _check("fla_recurrent_step", "state", state, (b, h, dk, dv))
    if state.dtype != torch.float32:
        raise ValueError(
            f"fla_recurrent_step: state is {state.dtype}; expected torch.float32. "
            "Fix: keep recurrent states in float32 (LinearStatePool does)."
        )
    _, fused_recurrent_simple_gla = _import_fla()
    o, ht = fused_recurrent_simple_gla(
        q.unsqueeze(1),
        k.to(q.dtype).unsqueeze(1),
        v.to(q.dtype).unsqueeze(1),
        g_gamma=g.to(torch.float32).contiguous(),
        scale=float(scale),
        initial_state=state.contiguous(),
        output_final_state=True,
    )
    state.copy_(ht)
    return o[:, 0].to(q.dtype)
