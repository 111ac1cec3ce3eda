"""Attention dumps: the first MLA layer (layer 0 unless it is a linear layer) of the first batch of each forward mode, saved as ``attn_<mode>.pt``.

Absorbed-MLA modes (``decode``, ``extend``) keep ``q_nope`` [T,H,kv_lora], ``q_pe`` [T,H,rope], ``ckv``
[N,kv_lora], ``kpe`` [N,rope], ``qo_indptr`` [B+1], ``kv_indptr`` [B+1] (rows of ckv/kpe per request, in token
order), ``causal`` (bottom-right aligned), ``sm_scale`` and ``out`` [T,H,kv_lora]. The MHA mode
(``extend_mha``) keeps ``q`` [T,H,qk_head], ``k`` [N,H,qk_head], ``v`` [N,H,v_head], the same indptrs,
``causal``, ``sm_scale`` and ``out`` [T,H,v_head]. All tensors are on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from runtime.core.batch import ForwardBatch
from runtime.core.kv_pool import MLAKVPool, ReqToTokenPool


class AttentionDumper:
    """Saves one dump per forward mode into ``dump_dir``; does nothing when ``dump_dir`` is None."""

    def __init__(self, dump_dir: str | None, req_to_token_pool: ReqToTokenPool):
        self.dir = Path(dump_dir) if dump_dir else None
        self.req_to_token_pool = req_to_token_pool
        self.saved: dict[str, Path] = {}
        self._paused = False

    def wants(self, mode: str) -> bool:
        return self.dir is not None and not self._paused and mode not in self.saved

    @staticmethod
    @contextlib.contextmanager
    def paused_if(dumper: AttentionDumper | None) -> Iterator[None]:
        """No dump while inside (CUDA-graph capture and warm-up run on padding inputs); no-op for None."""
        if dumper is None:
            yield
            return
        dumper._paused = True
        try:
            yield
        finally:
            dumper._paused = False

    def _kv_rows(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots of every request's KV in token order -> ([N] int64, kv_indptr [B+1] int32), host indptr."""
        table = self.req_to_token_pool.req_to_token
        rows, lens = batch.req_pool_indices_cpu.tolist(), batch.seq_lens_cpu.tolist()
        slots = torch.cat([table[r, :n].long() for r, n in zip(rows, lens)])
        indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(batch.seq_lens_cpu, 0)
        return slots, indptr

    def _write(self, mode: str, tensors: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"attn_{mode}.pt"
        torch.save({k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in tensors.items()}, path)
        self.saved[mode] = path

    def save_absorbed(self, layer_id: int, batch, kv_pool: MLAKVPool, q_nope, q_pe, out, kv_lora_rank: int, sm_scale: float):
        slots, kv_indptr = self._kv_rows(batch)
        rows = kv_pool.gather(layer_id, slots)
        self._write(batch.mode.value, {
            "q_nope": q_nope, "q_pe": q_pe, "ckv": rows[:, :kv_lora_rank], "kpe": rows[:, kv_lora_rank:],
            "qo_indptr": batch.qo_indptr_cpu, "kv_indptr": kv_indptr, "causal": True, "sm_scale": sm_scale,
            "out": out,
        })

    def save_mha(self, layer_id: int, batch, kv_pool: MLAKVPool, q, out, decompress: Callable, sm_scale: float):
        slots, kv_indptr = self._kv_rows(batch)
        rows = kv_pool.gather(layer_id, slots)
        kv_lora = kv_pool.kv_lora_rank
        k, v = decompress(rows[:, :kv_lora], rows[:, kv_lora:])
        self._write("extend_mha", {
            "q": q, "k": k, "v": v, "qo_indptr": batch.qo_indptr_cpu, "kv_indptr": kv_indptr, "causal": True,
            "sm_scale": sm_scale, "out": out,
        })
