"""DeepSeek-V3.2 sparse-attention indexer: per query token, the top-k previous tokens by indexer score.

For query token ``t`` of request ``b`` (row ``req_rows[b]`` of the request-to-token table), key position ``j``
(``0 <= j <= positions[t]``, causal, inclusive) scores::

    score(t, j) = sum_h weights[t, h] * relu(q[t, h] . k_cache[req_to_token[req_rows[b], j]])

and the indexer returns the positions of the ``top_k`` highest scores (token positions, not KV slots), sorted
by descending score, ``-1`` where fewer than ``top_k`` positions are visible.

Two implementations with one signature:

* :func:`indexer_topk_reference`: torch, any device, float32 math; the oracle for tests and the CPU path.
* :func:`indexer_topk`: a Triton scoring kernel (keys gathered through the request table inside the kernel, so
  no ``[B, ctx, Di]`` copy is made) into a ``[T, max_len]`` float32 score buffer, then ``torch.topk`` and a
  fix-up kernel (int32 positions, -1 / -inf padding). A Triton radix-select top-k (one program per token) is
  the alternative (``topk_impl="triton"``); it measured slower at decode shapes. Graph-safe when given ``max_len`` and
  preallocated ``out_pos`` / ``out_scores`` / ``scratch``: no allocation, no host sync.

Triton is imported lazily, so the reference works where Triton is not installed.
"""

from __future__ import annotations

import torch

from backends.kernels.checks import interpreted, require

__all__ = [
    "default_indexer_config",
    "indexer_scores",
    "indexer_scratch_bytes",
    "indexer_topk",
    "indexer_topk_reference",
    "scores_topk",
]

#: Key positions scored per program of the scoring kernel (the query stays in registers across them).
KEYS_PER_PROGRAM = 1024
#: The top-k used by default: torch.topk measured faster at decode shapes (B 32 x 32k, k 2048, H100: 94 us vs
#: 135-184 us for the Triton radix select, whose one program per row leaves most SMs idle; docs/hisparse.md).
DEFAULT_TOPK_IMPL = "torch"
#: The Triton top-k sorts its k candidates in registers: up to this many.
MAX_TRITON_TOPK = 4096
#: Scores per step of the Triton top-k's passes over a row.
TOPK_BLOCK = 4096

#: Query tokens scored per reference step (bounds the [tokens, heads, keys] float32 intermediate).
_REF_TOKENS_PER_STEP = 64


def _check_args(q, weights, k_cache, req_to_token, req_rows, positions, qo_indptr, top_k) -> None:
    require(q.dim() == 3, f"q [T, Hi, Di]; got shape {tuple(q.shape)}")
    T, Hi, Di = q.shape
    require(weights.shape == (T, Hi), f"weights [T, Hi] = {(T, Hi)}; got {tuple(weights.shape)}")
    require(k_cache.dim() == 2 and k_cache.shape[1] == Di, f"k_cache [S, Di={Di}]; got {tuple(k_cache.shape)}")
    require(req_to_token.dim() == 2, f"req_to_token [R, max_ctx]; got {tuple(req_to_token.shape)}")
    require(positions.shape == (T,), f"positions [T={T}]; got {tuple(positions.shape)}")
    require(qo_indptr.dim() == 1 and qo_indptr.shape[0] >= 1, "qo_indptr [B + 1]")
    require(req_rows.shape == (qo_indptr.shape[0] - 1,), "req_rows [B] with qo_indptr [B + 1]")
    require(int(top_k) >= 1, f"top_k >= 1; got {top_k}")


def indexer_topk_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    positions: torch.Tensor,
    qo_indptr: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer top-k in plain torch (float32 math, any device; host syncs, so not for CUDA graphs).

    Parameters
    ----------
    q : [T, Hi, Di] model dtype
        Indexer queries of the batch's query tokens (requests laid end to end, see ``qo_indptr``).
    weights : [T, Hi] float32
        Per-token head weights (already including any scale).
    k_cache : [S, Di] model dtype
        Indexer keys by KV slot.
    req_to_token : [R, max_ctx] int32 or int64
        KV slot of each request row's token positions.
    req_rows : [B] int64
        Row of ``req_to_token`` of each request.
    positions : [T] int64
        Absolute position of each query token; it sees key positions ``0 .. positions[t]``.
    qo_indptr : [B + 1] int32
        Query tokens of request ``b`` are ``qo_indptr[b] .. qo_indptr[b + 1] - 1``.
    top_k : int

    Returns
    -------
    topk_pos : [T, top_k] int32
        Token positions of the highest scores, by descending score; -1 where fewer are visible.
    topk_scores : [T, top_k] float32
        Their scores; -inf at padding.
    """
    _check_args(q, weights, k_cache, req_to_token, req_rows, positions, qo_indptr, top_k)
    T = q.shape[0]
    dev = q.device
    out_pos = torch.full((T, top_k), -1, dtype=torch.int32, device=dev)
    out_scores = torch.full((T, top_k), float("-inf"), dtype=torch.float32, device=dev)
    indptr = qo_indptr.tolist()
    rows = req_rows.tolist()
    pos_all = positions.to(torch.int64)
    for b, row in enumerate(rows):
        t0, t1 = indptr[b], indptr[b + 1]
        if t1 <= t0:
            continue
        n_keys = int(pos_all[t0:t1].max()) + 1
        slots = req_to_token[row, :n_keys].long()
        keys = k_cache[slots].float()  # [L, Di]
        for s0 in range(t0, t1, _REF_TOKENS_PER_STEP):
            s1 = min(s0 + _REF_TOKENS_PER_STEP, t1)
            logits = torch.einsum("thd,ld->thl", q[s0:s1].float(), keys).relu_()
            scores = torch.einsum("th,thl->tl", weights[s0:s1].float(), logits)  # [n, L]
            pos = pos_all[s0:s1]
            visible = torch.arange(n_keys, device=dev)[None, :] <= pos[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            k = min(top_k, n_keys)
            vals, idx = torch.topk(scores, k, dim=1, largest=True, sorted=True)
            # ranks past the visible count hold masked (-inf) entries: padding
            keep = torch.arange(k, device=dev)[None, :] < (pos[:, None] + 1)
            out_pos[s0:s1, :k] = torch.where(keep, idx, -1).to(torch.int32)
            out_scores[s0:s1, :k] = torch.where(keep, vals, float("-inf"))
    return out_pos, out_scores


def _scratch_layout(tokens: int, max_len: int, top_k: int) -> tuple[int, int, int, int]:
    """Byte offsets in the scratch: (scores, top-k values, top-k indices, end). Scores float32 [T, max_len],
    values float32 [T, k], indices int64 [T, k] (8-byte aligned), k = min(top_k, max_len)."""
    k = min(top_k, max_len)
    vals = 4 * tokens * max_len
    idx = vals + 4 * tokens * k
    idx += -idx % 8
    return 0, vals, idx, idx + 8 * tokens * k


def indexer_scratch_bytes(max_tokens: int, max_len: int, top_k: int) -> int:
    """Bytes of the scratch :func:`indexer_topk` needs for up to ``max_tokens`` query tokens that see at most
    ``max_len`` key positions (a score buffer [max_tokens, max_len] and the top-k values and indices)."""
    return _scratch_layout(max_tokens, max_len, top_k)[3]


def default_indexer_config(heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    """Scoring-kernel tiling: BLOCK_N keys per dot, KEYS_PER_PROGRAM keys per program."""
    block_n = 64 if heads * head_dim <= 64 * 128 else 32
    if dtype == torch.float32:
        block_n = 32
    return dict(block_n=block_n, keys_per_program=KEYS_PER_PROGRAM, num_warps=4, num_stages=3)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    positions: torch.Tensor,
    qo_indptr: torch.Tensor,
    top_k: int,
    *,
    max_len: int | None = None,
    out_pos: torch.Tensor | None = None,
    out_scores: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    block_n: int | None = None,
    keys_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    topk_impl: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer top-k with a Triton scoring kernel and a Triton radix-select top-k; the inputs and outputs of
    :func:`indexer_topk_reference` (equal scores may pick different positions).

    Parameters (beyond the reference's)
    ----------
    max_len : int, optional
        A bound on ``positions + 1`` over the batch (the engine knows it on the host: its longest sequence).
        Scores and the top-k run over ``max_len`` columns; positions past it are never selected. None ->
        ``req_to_token.shape[1]`` (always correct, slower when the table is much wider than the batch).
    out_pos : [T, top_k] int32, optional; out_scores : [T, top_k] float32, optional
        Written in place and returned (None: allocated).
    scratch : uint8 or float32 contiguous tensor of >= :func:`indexer_scratch_bytes` bytes, optional
        Score buffer and top-k values/indices (None: allocated).
    block_n, keys_per_program, num_warps, num_stages : scoring-kernel tiling (None:
        :func:`default_indexer_config`).
    topk_impl : "torch" (``torch.topk`` + a fix-up kernel) or "triton" (radix select + in-register sort, one
        program per token; top_k <= MAX_TRITON_TOPK); None -> DEFAULT_TOPK_IMPL.

    No host sync; CUDA-graph safe for a fixed ``max_len`` when ``out_pos``, ``out_scores`` and ``scratch`` are
    given. With ``topk_impl="triton"`` nothing is allocated; ``torch.topk`` takes its internal temporaries from
    the caching allocator (the graph's private pool under capture).
    """
    import triton

    _check_args(q, weights, k_cache, req_to_token, req_rows, positions, qo_indptr, top_k)
    T, Hi, Di = q.shape
    dev = q.device
    top_k = int(top_k)
    max_len = req_to_token.shape[1] if max_len is None else int(max_len)
    require(1 <= max_len <= req_to_token.shape[1], f"1 <= max_len <= req_to_token.shape[1]; got {max_len}")
    require(triton.next_power_of_2(Di) == Di and Di >= 16, f"indexer head dim a power of two >= 16; got {Di}")
    for name, x in (("q", q), ("weights", weights), ("k_cache", k_cache), ("req_to_token", req_to_token)):
        require(x.stride(-1) == 1, f"{name} with a contiguous last dim")
    if out_pos is None:
        out_pos = torch.empty(T, top_k, dtype=torch.int32, device=dev)
    if out_scores is None:
        out_scores = torch.empty(T, top_k, dtype=torch.float32, device=dev)
    require(
        out_pos.shape == (T, top_k) and out_pos.dtype == torch.int32 and out_pos.stride(-1) == 1,
        f"out_pos int32 [T, top_k] = {(T, top_k)}",
    )
    require(
        out_scores.shape == (T, top_k) and out_scores.dtype == torch.float32 and out_scores.stride(-1) == 1,
        f"out_scores float32 [T, top_k] = {(T, top_k)}",
    )
    if T == 0:
        return out_pos, out_scores

    o_scores, o_vals, o_idx, nbytes = _scratch_layout(T, max_len, top_k)
    if scratch is None:
        scratch = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    require(scratch.is_contiguous(), "a contiguous scratch tensor")
    raw = scratch.view(-1).view(torch.uint8) if scratch.dtype != torch.uint8 else scratch.view(-1)
    require(raw.numel() >= nbytes, f"scratch of >= indexer_scratch_bytes({T}, {max_len}, {top_k}) = {nbytes} bytes")
    k = min(top_k, max_len)
    scores = raw[o_scores:o_vals].view(torch.float32).view(T, max_len)
    vals = raw[o_vals : o_vals + 4 * T * k].view(torch.float32).view(T, k)
    idx = raw[o_idx:nbytes].view(torch.int64).view(T, k)

    indexer_scores(
        q, weights, k_cache, req_to_token, req_rows, positions, qo_indptr, scores,
        block_n=block_n, keys_per_program=keys_per_program, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    scores_topk(scores, top_k, out_pos, out_scores, vals, idx, impl=topk_impl)
    return out_pos, out_scores


def indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    positions: torch.Tensor,
    qo_indptr: torch.Tensor,
    scores: torch.Tensor,
    *,
    block_n: int | None = None,
    keys_per_program: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> None:
    """The scoring kernel alone: ``scores[t, j]`` = score(t, j) for ``j <= positions[t]``, -inf after, over the
    ``max_len = scores.shape[1]`` columns (inputs as :func:`indexer_topk_reference`; scores float32 [T, max_len],
    rows contiguous). Used by :func:`indexer_topk`; exposed for benchmarks."""
    import triton

    from backends.kernels.sparse import indexer_kernels as kern

    T, Hi, Di = q.shape
    max_len = scores.shape[1]
    require(scores.dtype == torch.float32 and scores.shape[0] == T and scores.stride(1) == 1, "scores f32 [T, L]")
    cfg = default_indexer_config(Hi, Di, k_cache.dtype)
    block_n = cfg["block_n"] if block_n is None else block_n
    keys = cfg["keys_per_program"] if keys_per_program is None else keys_per_program
    keys = triton.cdiv(max(keys, block_n), block_n) * block_n
    interp = interpreted(kern._indexer_scores_kernel)
    extra = {} if interp else dict(num_warps=cfg["num_warps"] if num_warps is None else num_warps,
                                   num_stages=cfg["num_stages"] if num_stages is None else num_stages)  # fmt: skip
    kern._indexer_scores_kernel[(triton.cdiv(max_len, keys), T)](
        q, weights, k_cache, req_to_token, req_rows, positions, qo_indptr, scores,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), req_to_token.stride(0), scores.stride(0),
        req_rows.shape[0], max_len, keys,
        HI=Hi, DI=Di, BLOCK_H=max(16, triton.next_power_of_2(Hi)), BLOCK_N=block_n, BLOCK_B=128,
        PREC="ieee" if k_cache.dtype == torch.float32 else "tf32",
        UPCAST=interp and k_cache.dtype == torch.bfloat16,
        **extra,
    )  # fmt: skip


def scores_topk(
    scores: torch.Tensor,
    top_k: int,
    out_pos: torch.Tensor,
    out_scores: torch.Tensor,
    vals: torch.Tensor,
    idx: torch.Tensor,
    *,
    impl: str | None = None,
    num_warps: int = 8,
    block: int = TOPK_BLOCK,
    radix_bits: int = 4,
) -> None:
    """Top-k of each row of ``scores`` float32 [T, L] into ``out_pos`` int32 [T, top_k] (column index, -1 at
    padding: past L, or -inf scores) and ``out_scores`` float32 [T, top_k] (-inf at padding), by descending
    score. ``vals`` float32 [T, k] and ``idx`` int64 [T, k] (k = min(top_k, L)) are scratch. impl: "torch"
    (``torch.topk`` + a fix-up kernel) or "triton" (radix select, ``radix_bits`` 4 or 8 per pass, top_k <=
    MAX_TRITON_TOPK, the candidates in ``idx``); None -> DEFAULT_TOPK_IMPL."""
    require(radix_bits in (4, 8), f"radix_bits 4 or 8; got {radix_bits}")
    import triton

    from backends.kernels.sparse import indexer_kernels as kern

    T, L = scores.shape
    k = min(top_k, L)
    interp = interpreted(kern._topk_rows_kernel)
    if impl is None:
        impl = DEFAULT_TOPK_IMPL
    if impl == "triton":
        require(top_k <= MAX_TRITON_TOPK, f"impl='triton' needs top_k <= {MAX_TRITON_TOPK}; got {top_k}")
        extra = {} if interp else dict(num_warps=num_warps)
        kern._topk_rows_kernel[(T,)](
            scores, idx, out_pos, out_scores, L, k, scores.stride(0), idx.stride(0), out_pos.stride(0),
            out_scores.stride(0), TOP_K=top_k, K_P2=triton.next_power_of_2(top_k),
            BLOCK=min(block, triton.next_power_of_2(L)), RADIX_BITS=radix_bits, **extra,
        )  # fmt: skip
    else:
        require(impl == "torch", f"topk impl 'triton' or 'torch'; got {impl!r}")
        torch.topk(scores, k, dim=1, largest=True, sorted=True, out=(vals, idx))
        blk = min(1024, triton.next_power_of_2(top_k))
        kern._topk_fixup_kernel[(T, triton.cdiv(top_k, blk))](
            vals, idx, out_pos, out_scores, T, k, vals.stride(0), idx.stride(0), out_pos.stride(0),
            out_scores.stride(0), TOP_K=top_k, BLOCK=blk,
        )  # fmt: skip
