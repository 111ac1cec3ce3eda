"""KV state of DeepSeek-V4 attention, in the pools' own terms.

Per request-table row (:class:`runtime.core.kv_pool.ReqToTokenPool`) and attention layer:

* :class:`SlidingWindowKV`: a ring of the latest ``sliding_window`` KV rows (position ``p`` lives in ring slot
  ``p % W``); every layer has one (V4 layers all attend to their window).
* :class:`CompressedKVPool`: compressed entries, paged like the latent pool (a page allocator, page 0 the padding
  page, and a row -> entry-slot table). One pool per compression rate (CSA, HCA), shared by every layer of that
  kind; a pool holds one or more named buffers per layer (CSA: ``kv`` [D] entries and the indexer's ``index``
  [Di] keys, same entry slots).
* :class:`CompressorStatePool`: a compressor's partial window: the projected rows of tokens that arrived since the
  last closed window (their count is ``tokens_seen % rate``), and for overlapping (CSA) compressors the closed
  window's first-half series that the next entry mixes in.

:class:`DSV4Pools` bundles them and is what the ``dsv4`` backend and the V4 model receive.

Padding: every per-row buffer has one extra row (``max_requests``), as the request table does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.core.dsv4_spec import DSV4AttentionSpec, DSV4LayerType
from runtime.core.errors import PoolExhausted
from runtime.core.kv_pool import PageAllocator

STATE_DTYPE = torch.float32


def _index(layer_ids: list[int]) -> dict[int, int]:
    return {int(layer): i for i, layer in enumerate(layer_ids)}


def _layer(index: dict[int, int], layer_id: int, what: str) -> int:
    i = index.get(int(layer_id))
    if i is None:
        raise KeyError(f"{what}: got layer_id={layer_id}; expected one of {sorted(index)}. Fix: route only the "
                       f"layers this pool was built for to it.")
    return i


class SlidingWindowKV:
    """The latest ``window`` KV rows of every request, per layer.

    Attributes
    ----------
    buffers : torch.Tensor
        [num_layers, max_requests + 1, window, head_dim] in the model dtype; token at position ``p`` of the
        request in row ``r`` is ``buffers[layer, r, p % window]`` while ``p`` is one of the latest ``window``.
    """

    def __init__(self, layer_ids: list[int], max_requests: int, window: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.window, self.head_dim, self.max_requests = int(window), int(head_dim), int(max_requests)
        self.dtype, self.device = dtype, torch.device(device)
        self._index = _index(layer_ids)
        self.buffers = torch.zeros(len(layer_ids), max_requests + 1, window, head_dim, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.buffers.numel() * self.buffers.element_size()

    def ring(self, layer_id: int) -> torch.Tensor:
        """[max_requests + 1, window, head_dim] of ``layer_id``."""
        return self.buffers[_layer(self._index, layer_id, "SlidingWindowKV")]

    def read(self, layer_id: int, row: int, start: int, end: int) -> torch.Tensor:
        """Rows of positions ``start .. end - 1`` of ``row`` -> [end - start, head_dim]; they must be among the
        latest ``window`` positions written."""
        if end - start > self.window or start < 0:
            raise IndexError(f"SlidingWindowKV.read: got positions [{start}, {end}); expected at most the latest "
                             f"{self.window}. Fix: read only the window.")
        pos = torch.arange(start, end, device=self.device) % self.window
        return self.ring(layer_id)[row, pos]

    def write(self, layer_id: int, row: int, start: int, kv: torch.Tensor) -> None:
        """Store ``kv`` [n, head_dim], the rows of positions ``start .. start + n - 1`` of ``row``; only the
        latest ``window`` of them are kept."""
        n = kv.shape[0]
        keep = min(n, self.window)
        pos = torch.arange(start + n - keep, start + n, device=self.device) % self.window
        self.ring(layer_id)[row, pos] = kv[n - keep:].to(self.dtype)


class CompressedKVPool:
    """Paged compressed entries of the layers of one compression rate.

    Parameters
    ----------
    rate : int
        Tokens per entry: a request of ``n`` tokens has ``n // rate`` entries.
    layer_ids : list of int
    dims : dict of str to int
        Named buffers per layer and their row width (CSA: ``{"kv": D, "index": Di}``; HCA: ``{"kv": D}``).
    num_pages, page_size : int
        Entry pages (page 0 is the padding page) and entries per page.
    max_requests, max_entries : int
        Request-table rows and the most entries one request can hold (``max_context // rate``).

    Attributes
    ----------
    table : torch.Tensor
        [max_requests + 1, max_entries] int32 on the device: slot (``page * page_size + offset``) of entry ``e``
        of the request in row ``r``; the padding row is all zeros.
    buffers : dict of str to torch.Tensor
        name -> [num_layers, num_pages, page_size, dim] in the model dtype.
    """

    def __init__(self, rate: int, layer_ids: list[int], dims: dict[str, int], num_pages: int, page_size: int,
                 max_requests: int, max_entries: int, dtype: torch.dtype, device: torch.device):
        self.rate, self.page_size, self.dims = int(rate), int(page_size), dict(dims)
        self.dtype, self.device = dtype, torch.device(device)
        self._index = _index(layer_ids)
        self.pages = PageAllocator(num_pages, page_size)
        self.max_entries = max(1, int(max_entries))  # entries per request (the table's width)
        self.table = torch.zeros(max_requests + 1, self.max_entries, dtype=torch.int32, device=device)
        self.buffers = {name: torch.zeros(len(layer_ids), num_pages, page_size, d, dtype=dtype, device=device)
                        for name, d in self.dims.items()}
        self._req_pages: dict[int, list[int]] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values()) + self.table.numel() * 4

    def entries_for(self, num_tokens: int) -> int:
        return int(num_tokens) // self.rate

    def open(self, row: int) -> None:
        self._req_pages[int(row)] = []

    def reserve(self, row: int, num_tokens: int) -> None:
        """Room for the entries of a request of ``num_tokens`` tokens; raises :class:`PoolExhausted` and changes
        nothing when the pool or the table row is too small."""
        row, n = int(row), self.entries_for(num_tokens)
        if n > self.max_entries:
            raise PoolExhausted(f"compressed-entry table (rate {self.rate})", n, self.max_entries, "entries per row")
        pages = self._req_pages[row]
        grow = -(-n // self.page_size) - len(pages)
        if grow <= 0:
            return
        old = len(pages) * self.page_size
        pages.extend(self.pages.alloc(grow))
        e = torch.arange(old, len(pages) * self.page_size)
        slots = torch.tensor(pages, dtype=torch.int64)[e // self.page_size] * self.page_size + e % self.page_size
        keep = e < self.max_entries
        self.table[row, e[keep].to(self.device)] = slots[keep].to(self.table.device, torch.int32)

    def release(self, row: int) -> None:
        self.pages.free(self._req_pages.pop(int(row)))
        self.table[int(row)] = 0

    def flat(self, layer_id: int, name: str) -> torch.Tensor:
        """[num_pages * page_size, dim] view of buffer ``name`` of ``layer_id``, indexed by slot."""
        buf = self.buffers[name][_layer(self._index, layer_id, f"CompressedKVPool(rate {self.rate})")]
        return buf.view(-1, buf.shape[-1])

    def slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """[end - start] int64 slots of entries ``start .. end - 1`` of ``row``."""
        return self.table[int(row), start:end].long()

    def write(self, layer_id: int, name: str, row: int, start: int, values: torch.Tensor) -> None:
        """Store entries ``start .. start + n - 1`` of ``row``: values [n, dim]."""
        if values.shape[0]:
            self.flat(layer_id, name)[self.slots(row, start, start + values.shape[0])] = values.to(self.dtype)

    def write_candidates(self, layer_id: int, name: str, rows: torch.Tensor, entry_ids: torch.Tensor,
                         values: torch.Tensor) -> None:
        """Decode: values [B, dim] into entry ``entry_ids[b]`` of ``rows[b]`` (device tensors, no host value).
        Where a window did not close, the value is a partial candidate: it lands in the slot of that still-open
        entry (read by nobody before the window closes and overwrites it), or, for an entry past the table or
        without a page yet, in the padding page."""
        e = entry_ids.long()
        width = self.max_entries
        slots = self.table[rows.long(), e.clamp(max=width - 1)].long()
        self.flat(layer_id, name)[torch.where(e < width, slots, 0)] = values.to(self.dtype)

    def gather(self, layer_id: int, name: str, row: int, count: int) -> torch.Tensor:
        """The first ``count`` entries of ``row`` -> [count, dim]."""
        return self.flat(layer_id, name)[self.slots(row, 0, count)]


class CompressorStatePool:
    """Partial-window state of one compressor stream (CSA kv, CSA indexer, or HCA kv) per layer and row.

    Attributes
    ----------
    pending_kv, pending_gate : torch.Tensor
        [num_layers, max_requests + 1, rate, width] float32 (float64 for a float64 model): projected kv and gate logits (without the position
        bias) of the tokens since the last closed window; the first ``tokens_seen % rate`` rows are live.
    prev_kv, prev_gate : torch.Tensor or None
        [num_layers, max_requests + 1, rate, overlap_dim] float32 (overlapping compressors only): the last closed
        window's first-half series and its gate logits (position bias added); the gate is -inf before any window
        closed, which gives those slots softmax weight 0.
    """

    def __init__(self, layer_ids: list[int], max_requests: int, rate: int, width: int, overlap_dim: int,
                 device: torch.device, dtype: torch.dtype = STATE_DTYPE):
        self.rate, self.width, self.overlap_dim = int(rate), int(width), int(overlap_dim)
        self.device = torch.device(device)
        self._index = _index(layer_ids)
        shape = (len(layer_ids), max_requests + 1, rate)
        self.pending_kv = torch.zeros(*shape, width, dtype=dtype, device=device)
        self.pending_gate = torch.zeros(*shape, width, dtype=dtype, device=device)
        self.prev_kv = self.prev_gate = None
        if overlap_dim:
            self.prev_kv = torch.zeros(*shape, overlap_dim, dtype=dtype, device=device)
            self.prev_gate = torch.full((*shape, overlap_dim), float("-inf"), dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        ts = [self.pending_kv, self.pending_gate, self.prev_kv, self.prev_gate]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def layer(self, layer_id: int) -> int:
        return _layer(self._index, layer_id, f"CompressorStatePool(rate {self.rate})")

    def reset(self, row: int) -> None:
        """Forget the partial window of ``row`` in every layer (admitting a request)."""
        self.pending_kv[:, row] = 0
        self.pending_gate[:, row] = 0
        if self.prev_kv is not None:
            self.prev_kv[:, row] = 0
            self.prev_gate[:, row] = float("-inf")


@dataclass(frozen=True)
class DSV4Pools:
    """Everything V4 attention keeps per request. The pools of a kind the model lacks are None."""

    spec: DSV4AttentionSpec
    window: SlidingWindowKV
    csa: CompressedKVPool | None
    hca: CompressedKVPool | None
    csa_state: CompressorStatePool | None
    csa_index_state: CompressorStatePool | None
    hca_state: CompressorStatePool | None

    @classmethod
    def build(cls, spec: DSV4AttentionSpec, max_requests: int, max_context: int, entry_pages: int,
              entry_page_size: int, dtype: torch.dtype, device: torch.device) -> DSV4Pools:
        """Pools for ``spec``; each compressed pool gets ``entry_pages`` pages of ``entry_page_size`` entries."""
        return cls._build(spec, max_requests, max_context, lambda rate: (entry_pages, entry_page_size), dtype, device)

    @classmethod
    def for_token_pages(cls, spec: DSV4AttentionSpec, max_requests: int, max_context: int, num_pages: int,
                        page_size: int, dtype: torch.dtype, device: torch.device,
                        offload_csa_kv: bool = False) -> DSV4Pools:
        """Pools sized by the engine's token pages (``kv.num_pages`` pages of ``kv.page_size`` tokens): each
        compressed pool gets ``num_pages`` pages of ``ceil(page_size / rate)`` entries. A request of ``n``
        tokens then needs at most ``ceil(n / page_size)`` pages of every pool, so whenever the token allocator
        admits a step, every compressed pool has room for it (:class:`runtime.core.dsv4_slots.DSV4TokenSlots`).

        ``offload_csa_kv`` (HiSparse on): the CSA pool keeps only the indexer keys and the entry table on the
        device; the CSA entries themselves live in the HiSparse coordinator's host pool."""
        return cls._build(spec, max_requests, max_context, lambda rate: (num_pages, -(-page_size // rate)), dtype,
                          device, offload_csa_kv)

    @classmethod
    def _build(cls, spec, max_requests, max_context, pages_of, dtype, device, offload_csa_kv=False) -> DSV4Pools:
        all_layers = list(range(spec.num_layers))
        csa, hca = spec.layers_of(DSV4LayerType.csa), spec.layers_of(DSV4LayerType.hca)
        d, di = spec.head_dim, spec.index_head_dim
        state_dtype = torch.float64 if dtype == torch.float64 else STATE_DTYPE

        def pool(rate, layers, dims):
            return CompressedKVPool(rate, layers, dims, *pages_of(rate), max_requests,
                                    max_context // rate, dtype, device) if layers else None

        def state(rate, layers, width, overlap):
            return CompressorStatePool(layers, max_requests, rate, width, overlap, device, state_dtype) if layers else None

        return cls(
            spec=spec,
            window=SlidingWindowKV(all_layers, max_requests, spec.sliding_window, d, dtype, device),
            csa=pool(spec.csa_rate, csa, {"index": di} if offload_csa_kv else {"kv": d, "index": di}),
            hca=pool(spec.hca_rate, hca, {"kv": d}),
            csa_state=state(spec.csa_rate, csa, 2 * d, d),
            csa_index_state=state(spec.csa_rate, csa, 2 * di, di),
            hca_state=state(spec.hca_rate, hca, d, 0),
        )

    def _compressed(self) -> list[CompressedKVPool]:
        return [p for p in (self.csa, self.hca) if p is not None]

    def _states(self) -> list[CompressorStatePool]:
        return [s for s in (self.csa_state, self.csa_index_state, self.hca_state) if s is not None]

    def admit(self, row: int) -> None:
        """A new request took request-table ``row``: empty entry lists and fresh compressor state."""
        for p in self._compressed():
            p.open(row)
        for s in self._states():
            s.reset(row)

    def reserve(self, row: int, num_tokens: int) -> None:
        """Entry room for ``num_tokens`` tokens of ``row`` (call before the step that brings it there)."""
        for p in self._compressed():
            p.reserve(row, num_tokens)

    def release(self, row: int) -> None:
        for p in self._compressed():
            p.release(row)

    @property
    def nbytes(self) -> int:
        return self.window.nbytes + sum(p.nbytes for p in self._compressed()) + sum(s.nbytes for s in self._states())

    def breakdown(self) -> dict[str, int]:
        """Bytes per pool, for the memory plan: the window ring, each compressed pool (entries, indexer keys
        and the entry table; with HiSparse the CSA entries are on the host and not counted here), the
        compressors' partial-window state."""
        out = {"dsv4_window_ring": self.window.nbytes}
        for name, p in (("dsv4_csa_entries", self.csa), ("dsv4_hca_entries", self.hca)):
            out[name] = p.nbytes if p is not None else 0
        out["dsv4_compressor_state"] = sum(s.nbytes for s in self._states())
        return out
