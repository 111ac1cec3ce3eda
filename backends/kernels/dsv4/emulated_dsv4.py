"""EMULATION (torch) of FlashInfer's DeepSeek-V4 sparse MLA decode's calling contract: not the kernel, not its speed.

``backend=dsv4 backend.impl=flashinfer backend.kernel=emulate`` injects :class:`EmulatedDSV4SparseDecode` in place of
``flashinfer.mla.trtllm_batch_decode_sparse_mla_dsv4`` (TRT-LLM-gen on SM100 / SM103; FlashInfer routes SM120 /
SM121 to its own sparse-MLA kernel behind the same function), with the same keyword arguments. The contract, as
FlashInfer's source documents and checks it (read, not copied):

* query ``[B, q_len, H, 512]`` (or ``[sum_q, H, 512]`` with ``cum_seq_lens_q`` [B + 1] int32 and ``max_q_len``),
  bfloat16 or float8_e4m3fn; H in {8, 16, 32, 64, 128}; q and k share the 512 channels, V = K;
* ``swa_kv_cache`` and ``compressed_kv_cache``: paged ``[num_pages, page_size, 512]`` (HND shorthand) or
  ``[num_pages, 1, page_size, 512]``, the query's dtype; a physical index is ``page * page_size + offset``;
* ``sparse_indices`` ``[sum_q, capacity]`` int32, capacity >= 128 and a multiple of 4: columns 0..127 index the
  SWA cache, the rest the compressed cache;
* ``sparse_topk_lens`` ``[sum_q]`` int32: active columns, the fixed 128 SWA columns included (128 <= len <=
  capacity);
* ``seq_lens`` ``[B]`` int32 (>= q_len): the SWA tile's valid length for query row i of request b is
  ``min(seq_lens[b] - q_len + i + 1, 128)``: the first that many SWA columns are attended, the rest of the 128
  are not;
* scores scaled by ``bmm1_scale``, one softmax per head over the active columns and the head's sink logit
  (``sinks`` [H] float32; the sink takes probability mass and contributes no value), output scaled by
  ``bmm2_scale``, written as bfloat16 ``[B, q_len, H, 512]`` (``out``, when given);
* ``workspace_buffer``: a zero-initialised byte buffer on the query's device (TRT-LLM-gen keeps split-KV
  partials and semaphores in it).

Every violation raises ``ValueError`` naming what was got and what is expected. The emulation is stricter than
the kernel in one way: every column of ``sparse_indices``, active or not, must be a valid row (the padding the
backend writes is 0), since what a kernel loads from an inactive column is not documented.
"""

from __future__ import annotations

import torch

SWA_COLUMNS = 128
HEAD_DIM = 512
HEADS = (8, 16, 32, 64, 128)
FN = "trtllm_batch_decode_sparse_mla_dsv4"


def _fail(what: str, got, expected: str) -> None:
    raise ValueError(f"{FN} (emulated): {what}: got {got}; expected {expected}")


def _rows(cache: torch.Tensor, name: str, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """The paged cache as [num_pages * page_size, 512] rows."""
    if layout != "HND":
        _fail("kv_layout", layout, "HND (the layout the dsv4 backend passes)")
    ok = (cache.dim() == 3 or (cache.dim() == 4 and cache.shape[1] == 1)) and cache.shape[-1] == HEAD_DIM
    if not ok:
        _fail(f"{name} shape", tuple(cache.shape), "[num_pages, page_size, 512] or [num_pages, 1, page_size, 512]")
    if cache.dtype != dtype:
        _fail(f"{name} dtype", cache.dtype, f"the query dtype {dtype}")
    return cache.reshape(-1, HEAD_DIM)


class EmulatedDSV4SparseDecode:
    """Callable with ``trtllm_batch_decode_sparse_mla_dsv4``'s keyword arguments (see the module docstring)."""

    def __init__(self) -> None:
        self._seen: set[int] = set()  # workspaces already used (checked zero on first use)
        self.calls = 0

    def __call__(self, *, query, swa_kv_cache, workspace_buffer, sparse_indices, compressed_kv_cache,
                 sparse_topk_lens, seq_lens, out=None, bmm1_scale=1.0, bmm2_scale=1.0, sinks=None, kv_layout="HND",
                 cum_seq_lens_q=None, max_q_len=None, enable_pdl=None) -> torch.Tensor:
        dev = query.device
        if cum_seq_lens_q is None:
            if query.dim() != 4:
                _fail("query shape", tuple(query.shape), "[batch, q_len, heads, 512] (or [sum_q, heads, 512] with "
                      "cum_seq_lens_q)")
            b, q_len, h, d = query.shape
            q_lens = torch.full((b,), q_len, dtype=torch.int64, device=dev)
            out_shape = tuple(query.shape)
        else:
            if query.dim() != 3 or cum_seq_lens_q.dtype != torch.int32 or max_q_len is None:
                _fail("varlen query", f"{tuple(query.shape)}, cum_seq_lens_q {cum_seq_lens_q.dtype}, max_q_len "
                      f"{max_q_len}", "[sum_q, heads, 512], int32 cum_seq_lens_q [B + 1], max_q_len set")
            b, (_, h, d) = cum_seq_lens_q.numel() - 1, query.shape
            q_lens = (cum_seq_lens_q[1:] - cum_seq_lens_q[:-1]).long()
            out_shape = tuple(query.shape)
        if query.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            _fail("query dtype", query.dtype, "bfloat16 or float8_e4m3fn")
        if d != HEAD_DIM or h not in HEADS:
            _fail("query heads / head dim", f"{h} / {d}", f"heads in {HEADS}, head dim {HEAD_DIM}")
        qf = query.reshape(-1, h, d)
        sum_q = qf.shape[0]
        if sparse_indices.dtype != torch.int32 or sparse_indices.dim() != 2 or sparse_indices.shape[0] != sum_q:
            _fail("sparse_indices", f"{sparse_indices.dtype} {tuple(sparse_indices.shape)}", f"int32 [{sum_q}, capacity]")
        cap = sparse_indices.shape[1]
        if cap < SWA_COLUMNS or cap % 4:
            _fail("sparse_indices capacity", cap, ">= 128 (the SWA columns) and a multiple of 4")
        swa = _rows(swa_kv_cache, "swa_kv_cache", query.dtype, kv_layout)
        comp = _rows(compressed_kv_cache, "compressed_kv_cache", query.dtype, kv_layout)
        if sparse_topk_lens.dtype != torch.int32 or tuple(sparse_topk_lens.shape) != (sum_q,):
            _fail("sparse_topk_lens", f"{sparse_topk_lens.dtype} {tuple(sparse_topk_lens.shape)}", f"int32 [{sum_q}]")
        if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (b,):
            _fail("seq_lens", f"{seq_lens.dtype} {tuple(seq_lens.shape)}", f"int32 [{b}]")
        if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (h,)):
            _fail("sinks", f"{sinks.dtype} {tuple(sinks.shape)}", f"float32 [{h}]")
        if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != out_shape):
            _fail("out", f"{out.dtype} {tuple(out.shape)}", f"bfloat16 {out_shape}")
        fresh = workspace_buffer.data_ptr() not in self._seen  # zero on first use (FlashInfer's requirement)
        if workspace_buffer.device != dev or workspace_buffer.numel() == 0 or (fresh and bool(workspace_buffer.any())):
            _fail("workspace_buffer", f"{workspace_buffer.numel()} elements on {workspace_buffer.device}",
                  f"a non-empty buffer on {dev}, zero-initialised before its first use")
        self._seen.add(workspace_buffer.data_ptr())
        if bool((seq_lens.long() < q_lens).any()):
            _fail("seq_lens", seq_lens.tolist(), f">= the query lengths {q_lens.tolist()}")
        lens = sparse_topk_lens.long()
        if bool(((lens < SWA_COLUMNS) | (lens > cap)).any()):
            _fail("sparse_topk_lens", lens.tolist(), f"128 <= len <= capacity {cap}")
        idx = sparse_indices.long()
        for name, cols, rows in (("SWA", idx[:, :SWA_COLUMNS], swa), ("compressed", idx[:, SWA_COLUMNS:], comp)):
            if cols.numel() and bool(((cols < 0) | (cols >= rows.shape[0])).any()):
                _fail(f"sparse_indices ({name} columns)", f"values in [{int(cols.min())}, {int(cols.max())}]",
                      f"rows of the {name} cache, 0..{rows.shape[0] - 1}")
        # query row -> its request, and its SWA tile's valid length
        req = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=sum_q)
        first = torch.cumsum(q_lens, 0) - q_lens
        i = torch.arange(sum_q, device=dev) - first[req]
        swa_valid = torch.clamp(seq_lens.long()[req] - q_lens[req] + i + 1, max=SWA_COLUMNS)
        col = torch.arange(cap, device=dev)[None, :]
        active = torch.where(col < SWA_COLUMNS, col < swa_valid[:, None], col < lens[:, None])
        keys = torch.cat([swa[idx[:, :SWA_COLUMNS]], comp[idx[:, SWA_COLUMNS:]]], dim=1).float()  # [sum_q, cap, D]
        scores = torch.einsum("qhd,qkd->qhk", qf.float(), keys) * float(bmm1_scale)
        scores = scores.masked_fill(~active[:, None, :], float("-inf"))
        sink = (sinks.float() if sinks is not None else torch.full((h,), float("-inf"), device=dev))
        logits = torch.cat([sink[None, :, None].expand(sum_q, h, 1), scores], dim=2)
        p = torch.softmax(logits, dim=2)[:, :, 1:]
        self.calls += 1
        result = (torch.einsum("qhk,qkd->qhd", p, keys) * float(bmm2_scale)).to(torch.bfloat16).view(out_shape)
        if out is None:
            return result
        out.copy_(result)
        return out
