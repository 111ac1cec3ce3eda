"""EMULATION (torch) of two Blackwell MLA decode kernels' calling contracts: not the kernels, not their speed.

``backend.kernel=emulate`` injects these callables in place of

* ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` (TensorRT-LLM-gen, SM100 / SM103), and
* ``tokenspeed_mla.tokenspeed_mla_decode`` (TokenSpeed CuTe DSL, SM100 / SM103 / SM107),

with the same keyword arguments, tensor layouts, block tables, scales and workspace arguments, so a backend's
metadata, workspace, speculative and CUDA-graph paths run end to end on the CPU and on Hopper. Each checks the
argument contract the real function enforces (or documents) and raises ``ValueError`` naming what it got, then
computes absorbed MLA in float64 (:data:`EMULATION_DTYPE`) over the paged cache:

* query ``[B, q_len, H, kv_lora + rope]`` (``q_nope | q_pe``; or, TRT-LLM-gen's compact variable-length form,
  ``[T, H, kv_lora + rope]`` with ``cum_seq_lens_q`` [B + 1] and ``max_q_len``);
* kv_cache ``[num_pages, page_size, kv_lora + rope]`` or ``[num_pages, 1, page_size, kv_lora + rope]``
  (``ckv | kpe``, V = ckv);
* block_tables ``[B, W]`` int32 page ids, token t of request b in page ``block_tables[b, t // page_size]``;
* seq_lens ``[B]`` int32: KV length including this step's new tokens; query row i of a request with n query
  rows sits at position ``seq_len - n + i`` and sees keys ``0 .. seq_len - n + i`` (bottom-right causal);
* scores scaled by ``bmm1_scale`` / ``softmax_scale`` (the whole softmax scale), output by ``bmm2_scale`` /
  ``output_scale``.

Unlike the kernels, the emulation keeps no partials in the workspace; it checks the workspace's dtype and size
(TokenSpeed: the bytes its split-KV heuristic needs for this call) and, for TRT-LLM-gen, that the multi-CTA
counter buffer is zero on entry (the kernel resets its semaphores at the end of every launch, so the buffer is
zeroed once at allocation and must stay zero between calls). Host-side checks that read device values are
skipped while a CUDA graph is being captured; the computation itself has static shapes and no host sync, so
it can be captured.
"""

from __future__ import annotations

import torch

from backends.mla_math import paged_absorbed_attention

TRTLLM_PAGE_SIZES = (32, 64)
#: the emulation computes in float64, so its bf16 / fp16 output does not depend on the static shapes a CUDA graph
#: pads to (a block table as wide as the graph's longest context, more masked keys in every sum). In float32 graph
#: replays gave other tokens than eager runs on an H200; the summation order is the likely cause (not rerun since)
EMULATION_DTYPE = torch.float64


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _fail(fn: str, what: str, got, expected: str) -> None:
    raise ValueError(f"{fn} (emulated): {what}: got {got}; expected {expected}")


def _check_common(fn: str, query: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int, qk_rope_head_dim: int,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, batch: int, max_seq_len: int) -> int:
    """Layout checks shared by both contracts; returns the page size."""
    d = kv_lora_rank + qk_rope_head_dim
    if query.shape[-1] != d:
        _fail(fn, "query head dim", query.shape[-1], f"kv_lora_rank + qk_rope_head_dim = {d}")
    if kv_cache.dim() not in (3, 4) or kv_cache.shape[-1] != d or (kv_cache.dim() == 4 and kv_cache.shape[1] != 1):
        _fail(fn, "kv_cache shape", tuple(kv_cache.shape), f"[num_pages, page_size, {d}] or [num_pages, 1, page_size, {d}]")
    if kv_cache.dtype != query.dtype:
        _fail(fn, "kv_cache dtype", kv_cache.dtype, f"the query dtype {query.dtype}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.shape[0] != batch:
        _fail(fn, "block_tables", f"{block_tables.dtype} {tuple(block_tables.shape)}", f"int32 [{batch}, max_pages]")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        _fail(fn, "seq_lens", f"{seq_lens.dtype} {tuple(seq_lens.shape)}", f"int32 [{batch}]")
    if max_seq_len <= 0:
        _fail(fn, "max_seq_len", max_seq_len, "> 0")
    ps = kv_cache.shape[-2]
    if not _capturing(seq_lens) and batch:
        longest = int(seq_lens.max())
        if longest > max_seq_len:
            _fail(fn, "max_seq_len", max_seq_len, f">= the longest seq_len ({longest})")
        if block_tables.shape[1] * ps < longest:
            _fail(fn, "block_tables width", block_tables.shape[1], f">= ceil({longest} / {ps}) pages")
    return ps


def trtllm_counter_bytes(batch_size: int, num_qo_heads: int, sm_count: int) -> int:
    """Bytes of TRT-LLM-gen's multi-CTA KV counter semaphores (FlashInfer's
    ``get_trtllm_gen_multi_ctas_kv_counter_bytes``): one int32 per (request, head), at least one per SM,
    rounded up to 8."""
    n = max(batch_size * num_qo_heads, sm_count)
    return -(-n // 8) * 8 * 4


class EmulatedTrtllmMLADecode:
    """EMULATION of ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` (the arguments the runtime uses).

    Parameters
    ----------
    sm_count : int
        SMs the counter-buffer size is checked against (the GPU's; 0 on the CPU).
    """

    name = "trtllm_batch_decode_with_kv_cache_mla"

    def __init__(self, sm_count: int):
        self.sm_count = int(sm_count)
        self.calls = 0

    def __call__(self, query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                 block_tables, seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0,
                 backend="auto", cum_seq_lens_q=None, max_q_len=None, multi_ctas_kv_counter_buffer=None,
                 enable_pdl=None):
        fn = self.name
        if backend not in ("auto", "trtllm-gen"):
            _fail(fn, "backend", repr(backend), "'trtllm-gen' (or 'auto', which picks it on SM100 / SM103)")
        if max_q_len is not None and cum_seq_lens_q is None:
            _fail(fn, "max_q_len", max_q_len, "only together with cum_seq_lens_q")
        if cum_seq_lens_q is not None:
            if query.dim() != 3 or max_q_len is None or max_q_len <= 0:
                _fail(fn, "variable-length query", f"query {tuple(query.shape)}, max_q_len {max_q_len}",
                      "[total_q, H, D] with cum_seq_lens_q [B + 1] int32 and max_q_len > 0")
            if cum_seq_lens_q.dtype != torch.int32 or cum_seq_lens_q.dim() != 1:
                _fail(fn, "cum_seq_lens_q", f"{cum_seq_lens_q.dtype} {tuple(cum_seq_lens_q.shape)}", "int32 [B + 1]")
            batch, heads = cum_seq_lens_q.shape[0] - 1, query.shape[1]
        else:
            if query.dim() != 4:
                _fail(fn, "query shape", tuple(query.shape), "[B, q_len, H, D] (or [T, H, D] with cum_seq_lens_q)")
            batch, heads = query.shape[0], query.shape[2]
        ps = _check_common(fn, query, kv_cache, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens, batch,
                           max_seq_len)
        if ps not in TRTLLM_PAGE_SIZES:
            _fail(fn, "page size (block_size)", ps, f"one of {TRTLLM_PAGE_SIZES}")
        if 64 < heads < 128:
            _fail(fn, "num_heads", heads, "<= 64 or 128 (trtllm-gen has no kernel for 64 < H < 128)")
        if workspace_buffer.dtype not in (torch.uint8, torch.int8) or not workspace_buffer.is_contiguous():
            _fail(fn, "workspace_buffer", f"{workspace_buffer.dtype}, contiguous={workspace_buffer.is_contiguous()}",
                  "a contiguous byte buffer")
        if isinstance(bmm1_scale, torch.Tensor) or isinstance(bmm2_scale, torch.Tensor):
            _fail(fn, "bmm1_scale / bmm2_scale", "a tensor", "python floats (static scales, safe for CUDA graphs)")
        counters = multi_ctas_kv_counter_buffer
        if counters is not None:
            need = trtllm_counter_bytes(batch, heads, self.sm_count)
            if not counters.is_contiguous() or counters.numel() * counters.element_size() < need:
                _fail(fn, "multi_ctas_kv_counter_buffer", f"{counters.numel() * counters.element_size()} bytes",
                      f"a contiguous buffer of >= {need} bytes")
            if not _capturing(counters) and bool(counters.any()):
                _fail(fn, "multi_ctas_kv_counter_buffer", "non-zero counters on entry",
                      "zeros (zero it once at allocation; the kernel leaves it zero after every launch; "
                      "never share it with a concurrent launch)")
        out_shape = tuple(query.shape[:-1]) + (kv_lora_rank,)
        if out is not None and (tuple(out.shape) != out_shape or out.dtype != query.dtype):
            _fail(fn, "out", f"{out.dtype} {tuple(out.shape)}", f"{query.dtype} {out_shape}")
        self.calls += 1
        if cum_seq_lens_q is None:
            res = paged_absorbed_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank, bmm1_scale,
                                           bmm2_scale, compute_dtype=EMULATION_DTYPE)
        else:  # compact variable-length queries: one request at a time (eager only: reads the offsets)
            res = torch.empty(out_shape, dtype=query.dtype, device=query.device)
            cum = cum_seq_lens_q.tolist()
            for r in range(batch):
                s, e = cum[r], cum[r + 1]
                if e > s:
                    res[s:e] = paged_absorbed_attention(
                        query[None, s:e], kv_cache, block_tables[r : r + 1], seq_lens[r : r + 1], kv_lora_rank,
                        bmm1_scale, bmm2_scale, compute_dtype=EMULATION_DTYPE)[0]
        if out is None:
            return res
        out.copy_(res)
        return out


def tokenspeed_workspace_bytes(batch: int, q_len: int, num_heads: int, kv_lora_rank: int, sm_count: int) -> int:
    """Workspace bytes ``tokenspeed_mla_decode`` (bf16 / fp16) needs for one call, from its split-KV heuristic.

    The kernel folds F query tokens into the head axis (the largest F dividing q_len with H * F <= 128), or packs
    query/head rows into 128-row tiles when that takes fewer tiles; then ``split_kv = min(max(1, SMs // B //
    (2 * q_len_eff)), 32)`` and, when split_kv > 1, it keeps float32 partials and LSEs:
    ``B * H_eff * q_len_eff * split_kv * (kv_lora_rank + 1) * 4`` bytes.
    """
    fold = max(f for f in range(1, q_len + 1) if q_len % f == 0 and num_heads * f <= 128) if num_heads <= 128 else 1
    h_eff, s_eff = num_heads * fold, q_len // fold
    tiles = -(-(num_heads * q_len) // 128)
    if tiles < s_eff:  # packed 128-row query/head tiles
        h_eff, s_eff = 128, tiles
    split = min(max(1, sm_count // max(batch, 1) // (s_eff * 2)), 32)
    return 0 if split == 1 else batch * h_eff * s_eff * split * (kv_lora_rank + 1) * 4


def tokenspeed_workspace_bound(sm_count: int, num_heads: int, kv_lora_rank: int, max_q_len: int) -> int:
    """Workspace bytes that cover every ``tokenspeed_mla_decode`` call of up to ``max_q_len`` query tokens per
    request, at any batch size: with split_kv > 1, ``B * q_len_eff * split_kv <= SMs / 2`` and
    ``H_eff <= min(128, H * q_len)``, so ``SMs // 2 * min(128, H * max_q_len) * (kv_lora_rank + 1) * 4``."""
    return sm_count // 2 * min(128, num_heads * max_q_len) * (kv_lora_rank + 1) * 4


class EmulatedTokenSpeedMLADecode:
    """EMULATION of ``tokenspeed_mla.tokenspeed_mla_decode`` (the arguments the runtime uses).

    Parameters
    ----------
    sm_count : int
        SMs the kernel's split-KV heuristic (and so the workspace size it needs) is computed for.
    """

    name = "tokenspeed_mla_decode"

    def __init__(self, sm_count: int):
        self.sm_count = int(sm_count)
        self.calls = 0

    def __call__(self, query, kv_cache, workspace_buffer, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens,
                 max_seq_len, softmax_scale, output_scale=1.0, out=None, is_var_seq=True, causal_mask=True,
                 enable_pdl=False):
        fn = self.name
        if query.dim() != 4:
            _fail(fn, "query shape", tuple(query.shape), "[B, q_len, H, kv_lora_rank + qk_rope_head_dim]")
        batch, q_len, heads = query.shape[:3]
        ps = _check_common(fn, query, kv_cache, kv_lora_rank, qk_rope_head_dim, block_tables, seq_lens, batch,
                           max_seq_len)
        if ps == 1 or 128 % ps:
            _fail(fn, "page size", ps, "a divisor of 128 other than 1 (TMA tiles of 128 keys)")
        if not 0 < heads <= 128:
            _fail(fn, "num_heads", heads, "1..128")
        if workspace_buffer.dtype != torch.int8 or not workspace_buffer.is_contiguous():
            _fail(fn, "workspace_buffer", f"{workspace_buffer.dtype}, contiguous={workspace_buffer.is_contiguous()}",
                  "a contiguous torch.int8 buffer")
        need = tokenspeed_workspace_bytes(batch, q_len, heads, kv_lora_rank, self.sm_count)
        if workspace_buffer.numel() < need:
            _fail(fn, "workspace_buffer size", f"{workspace_buffer.numel()} bytes",
                  f">= {need} bytes (B={batch}, q_len={q_len}, H={heads}, {self.sm_count} SMs)")
        out_shape = (batch, q_len, heads, kv_lora_rank)
        if out is not None and (tuple(out.shape) != out_shape or out.dtype != query.dtype):
            _fail(fn, "out", f"{out.dtype} {tuple(out.shape)}", f"{query.dtype} {out_shape}")
        self.calls += 1
        res = paged_absorbed_attention(query, kv_cache, block_tables, seq_lens, kv_lora_rank, softmax_scale,
                                       output_scale, causal=causal_mask, compute_dtype=EMULATION_DTYPE)
        if out is None:
            return res
        out.copy_(res)
        return out
