"""KV memory: the request -> token table, the page allocator, and the paged MLA KV pool.

A token's *slot* is ``page * page_size + offset``. Page 0 is reserved as the padding page, and the request
table has one reserved padding row (``ReqToTokenPool.padding_row``, all slots 0): padded batch entries
(CUDA-graph replay) use that row, so they read and write only the padding page and per-row state nobody owns.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.core.device import packed_to_device
from runtime.core.errors import PoolExhausted

PADDING_PAGE = 0


class ReqToTokenPool:
    """Rows of token slots, one row per live request.

    Attributes
    ----------
    req_to_token : torch.Tensor
        [max_requests + 1, max_context] int32 on the device: slot of token t of the request in row r; the
        last row is the padding row, never handed out, all zeros (the padding page).
    last_token : torch.Tensor
        [max_requests + 1] int64 on the device: the newest token of each row, written by sampling and read as
        the next decode's input, so a decode step needs no host copy of the previous step's tokens.
    padding_row : int
        ``max_requests``: the row padded batch entries use (per-row state pools keep a row for it too).
    """

    def __init__(self, max_requests: int, max_context: int, device: torch.device):
        self.max_requests, self.max_context = max_requests, max_context
        self.padding_row = max_requests
        self.req_to_token = torch.zeros(max_requests + 1, max_context, dtype=torch.int32, device=device)
        self.last_token = torch.zeros(max_requests + 1, dtype=torch.int64, device=device)
        self._free = list(range(max_requests - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.req_to_token, self.last_token))

    def alloc(self) -> int:
        if not self._free:
            raise PoolExhausted("request table", 1, 0, "rows")
        return self._free.pop()

    def free(self, row: int) -> None:
        self._free.append(row)


class PageAllocator:
    """Hands out fixed-size pages of the KV pool; page 0 is never handed out."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, PADDING_PAGE, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted("KV page pool", n, len(self._free), "pages")
        out = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


#: ``kv.dtype`` name -> storage dtype (None: the model dtype).
KV_STORAGE = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}
FP8_E4M3_MAX = 448.0


class MLAKVPool:
    """Paged latent KV, one buffer per attention layer that has a KV cache.

    With ``kv_dtype="fp8_e4m3"`` the buffers hold float8 e4m3 values ``clamp(x / scale, -448, 448)``: writes
    quantize, readers dequantize (``stored * scale``): :meth:`gather` here, the kernels inside their tile loads.
    Values that hit the clamp are counted on the device (no host sync on the write path); :meth:`quant_stats`
    reads the counters once, at the end of a run.

    Attributes
    ----------
    buffers : list of torch.Tensor
        Per cached layer, [num_pages, page_size, kv_lora_rank + qk_rope_head_dim] in ``cache_dtype``: the
        first ``kv_lora_rank`` values of a row are the normalized latent (ckv, also the value), the rest the
        rotated rope key (kpe).
    dtype : torch.dtype
        The model dtype: what writes bring and what :meth:`gather` returns.
    cache_dtype : torch.dtype
        What the buffers store: ``dtype``, or ``torch.float8_e4m3fn``.
    scale : float
        Dequantization scale of an fp8 cache (1.0 and unused otherwise).
    """

    def __init__(
        self,
        layer_ids: list[int],
        num_pages: int,
        page_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: str = "auto",
        scale: float = 1.0,
    ):
        self.page_size, self.kv_lora_rank, self.rope_dim = page_size, kv_lora_rank, qk_rope_head_dim
        self.row_dim = kv_lora_rank + qk_rope_head_dim
        self.dtype, self.device = dtype, device
        self.kv_dtype = str(kv_dtype)
        self.cache_dtype = KV_STORAGE[self.kv_dtype] or dtype
        self.quantized = self.cache_dtype != dtype
        self.scale = float(scale) if self.quantized else 1.0
        self._index = {layer: i for i, layer in enumerate(layer_ids)}
        self.buffers = [
            torch.zeros(num_pages, page_size, self.row_dim, dtype=self.cache_dtype, device=device) for _ in layer_ids
        ]
        self._counts = torch.zeros(2, dtype=torch.int64, device=device)  # values clipped, values written

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over every cached layer."""
        return self.row_dim * self.cache_dtype.itemsize * len(self.buffers)

    def buffer(self, layer_id: int) -> torch.Tensor:
        """[num_pages, page_size, row_dim] of ``layer_id`` in ``cache_dtype`` (kernels dequantize with ``scale``)."""
        return self.buffers[self._index[layer_id]]

    def flat(self, layer_id: int) -> torch.Tensor:
        """[num_pages * page_size, row_dim] view of ``layer_id`` indexed by slot, in ``cache_dtype``."""
        return self.buffer(layer_id).view(-1, self.row_dim)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """Values in any float dtype -> ``cache_dtype``; an fp8 cache counts the values that clip (on the
        device; graph-safe: in-place adds to a persistent counter)."""
        if not self.quantized:
            return x.to(self.cache_dtype)
        v = x.float() / self.scale
        self._counts[0] += (v.abs() > FP8_E4M3_MAX).sum()
        self._counts[1] += v.numel()
        return v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(self.cache_dtype)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored rows -> ``dtype`` (default: the model dtype); an fp8 cache multiplies by ``scale`` in float32."""
        dtype = dtype or self.dtype
        if not self.quantized:
            return rows.to(dtype)
        return (rows.float() * self.scale).to(dtype)

    def write(self, layer_id: int, slots: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor) -> None:
        """Store new tokens. slots [T] int64; ckv [T, kv_lora_rank]; kpe [T, qk_rope_head_dim] (any float
        dtype; quantized to ``cache_dtype``)."""
        flat = self.flat(layer_id)
        flat[slots, : self.kv_lora_rank] = self.quantize(ckv)
        flat[slots, self.kv_lora_rank :] = self.quantize(kpe)

    def gather(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows of ``slots`` ([N] int64) -> [N, row_dim], dequantized to ``dtype`` (default: the model dtype)."""
        return self.dequantize(self.flat(layer_id)[slots], dtype)

    def quant_stats(self) -> dict:
        """kv dtype, scale, and how many values were written and clipped so far (one host sync: call it at
        the end of a run)."""
        clipped, written = (int(v) for v in self._counts.tolist())
        return {"kv_dtype": self.kv_dtype, "cache_dtype": str(self.cache_dtype).removeprefix("torch."),
                "scale": self.scale, "values_written": written, "values_clipped": clipped,
                "clipped_fraction": clipped / written if written else 0.0}


class TokenSlots:
    """Per-request page lists on top of the page allocator and the request table.

    ``reserve`` gives a request room for more tokens and fills its request-table row; ``release`` returns
    every page and the row. Exhaustion raises :class:`PoolExhausted` and changes nothing.
    """

    def __init__(self, req_to_token_pool: ReqToTokenPool, page_allocator: PageAllocator):
        self.req_to_token_pool, self.pages = req_to_token_pool, page_allocator
        self.page_size = page_allocator.page_size
        self._req_pages: dict[int, list[int]] = {}

    def open(self) -> int:
        row = self.req_to_token_pool.alloc()
        self._req_pages[row] = []
        return row

    def pages_needed(self, row: int, new_len: int) -> int:
        have = len(self._req_pages[row])
        return max(0, -(-new_len // self.page_size) - have)

    def reserve(self, row: int, old_len: int, new_len: int) -> torch.Tensor:
        """Slots for tokens ``old_len:new_len`` of the request in ``row`` -> [new_len - old_len] int64 (host)."""
        return torch.tensor(self.reserve_many([(row, old_len, new_len)]), dtype=torch.int64)

    def reserve_many(self, spans: list[tuple[int, int, int]]) -> list[int]:
        """``reserve`` for several (row, old_len, new_len) spans -> every new slot, span after span (host
        ints), with one write to the device table. Plain ints for short spans (decode: no per-request tensor
        ops on the host), numpy for long ones. Checks every span first: exhaustion takes no page."""
        limit = self.req_to_token_pool.max_context
        too_long = [n for _, _, n in spans if n > limit]
        if too_long:
            raise PoolExhausted("request table", max(too_long), limit, "tokens per row")
        grows = [-(-new // self.page_size) - len(self._req_pages[row]) for row, _, new in spans]
        need = sum(g for g in grows if g > 0)
        if need > self.pages.available:
            raise PoolExhausted("KV page pool", need, self.pages.available, "pages")
        ps, width = self.page_size, self.req_to_token_pool.req_to_token.shape[1]
        slots: list[int] = []
        index: list[int] = []
        for (row, old, new), grow in zip(spans, grows):
            pages = self._req_pages[row]
            if grow > 0:
                pages.extend(self.pages.alloc(grow))
            if new - old == 1:  # decode
                slots.append(pages[old // ps] * ps + old % ps)
            elif new - old <= 32:
                slots.extend(self.slots_of(row, old, new))
            else:
                pos = np.arange(old, new)
                slots.extend((np.asarray(pages)[pos // ps] * ps + pos % ps).tolist())
            if new - old == 1:
                index.append(row * width + old)
            else:
                index.extend(range(row * width + old, row * width + new))
        if slots:  # one copy: int64 table indices and int32 slots
            table = self.req_to_token_pool.req_to_token
            _, (idx, val) = packed_to_device([index], [slots], table.device)
            table.view(-1)[idx] = val
        return slots

    def slots_of(self, row: int, start: int, end: int) -> list[int]:
        """Slots of the already reserved tokens ``start:end`` of ``row`` (host ints; nothing changes)."""
        pages, ps = self._req_pages[row], self.page_size
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    def truncate(self, row: int, new_len: int) -> None:
        """Keep room for the first ``new_len`` tokens of ``row``; pages past them return to the allocator
        (speculative decoding reserves for every draft token and gives back what was rejected). Table
        entries past ``new_len`` go stale; nothing reads a row past its sequence length."""
        pages = self._req_pages[row]
        keep = -(-new_len // self.page_size)
        if keep < len(pages):
            self.pages.free(pages[keep:])
            del pages[keep:]

    def release(self, row: int) -> None:
        self.pages.free(self._req_pages.pop(row))
        self.req_to_token_pool.free(row)

    def release_pages(self, row: int) -> None:
        """Return the pages of ``row`` but keep the row (HiSparse: its KV now lives in host memory; the row's
        request-table entries are stale from here on)."""
        self.pages.free(self._req_pages[row])
        self._req_pages[row] = []
