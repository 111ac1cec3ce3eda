"""Random paged-KV batches and an independent float64 attention oracle, for backend tests (CPU and GPU).

The oracle does not use the runtime's request table or backend code: it keeps each request's slots as
returned by the allocator and computes attention with explicit float64 math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from runtime.core.batch import ForwardBatch, ForwardMode, make_batch
from runtime.core.kv_pool import MLAKVPool, PageAllocator, ReqToTokenPool, TokenSlots

KV_LORA, ROPE = 512, 64


@dataclass
class Harness:
    pools: TokenSlots
    kv: MLAKVPool
    req_to_token: ReqToTokenPool
    device: torch.device
    dtype: torch.dtype


def make_harness(page_size: int, num_pages: int = 256, max_context: int = 2048, layers=(0,),
                 device="cpu", dtype=torch.float32, max_requests: int = 16) -> Harness:
    dev = torch.device(device)
    r2t = ReqToTokenPool(max_requests, max_context, dev)
    pages = PageAllocator(num_pages, page_size)
    kv = MLAKVPool(list(layers), num_pages, page_size, KV_LORA, ROPE, dtype, dev)
    return Harness(TokenSlots(r2t, pages), kv, r2t, dev, dtype)


def random_batch(h: Harness, prefix_lens: list[int], extend_lens: list[int], gen: torch.Generator,
                 mode: ForwardMode | None = None, layer: int = 0, scatter: bool = True):
    """Open one request per entry, write random KV for prefix + new tokens, return (batch, slots per request).

    With ``scatter`` a throwaway request grabs and frees pages in between, so pages are not contiguous.
    """
    mode = mode or (ForwardMode.DECODE if all(e == 1 for e in extend_lens) and any(prefix_lens) else ForwardMode.EXTEND)
    rows, all_slots, new_locs = [], [], []
    for p, e in zip(prefix_lens, extend_lens):
        if scatter:
            junk = h.pools.open()
            h.pools.reserve(junk, 0, int(torch.randint(1, 3 * h.pools.page_size + 1, (1,), generator=gen)))
        row = h.pools.open()
        slots = h.pools.reserve(row, 0, p + e)
        if scatter:
            h.pools.release(junk)
        rows.append(row)
        all_slots.append(slots)
        new_locs.append(slots[p:])
        rows_kv = torch.randn(p + e, KV_LORA + ROPE, generator=gen, dtype=torch.float32)
        h.kv.flat(layer)[slots.to(h.device)] = rows_kv.to(h.device, h.dtype)
    batch = make_batch(mode, rows, prefix_lens, extend_lens, torch.cat(new_locs).to(h.device), h.device)
    return batch, all_slots


def random_q(batch: ForwardBatch, heads: int, gen: torch.Generator, device, dtype):
    t = batch.num_tokens
    q_nope = torch.randn(t, heads, KV_LORA, generator=gen).to(device, dtype)
    q_pe = torch.randn(t, heads, ROPE, generator=gen).to(device, dtype)
    return q_nope, q_pe


def oracle_absorbed(h: Harness, batch: ForwardBatch, slots: list[torch.Tensor], q_nope, q_pe, sm_scale: float,
                    layer: int = 0) -> torch.Tensor:
    """float64 [T, H, 512], written out with explicit per-query masking and a max-subtracted softmax."""
    flat = h.kv.flat(layer).double().cpu()
    qn, qp = q_nope.double().cpu(), q_pe.double().cpu()
    out = torch.zeros(qn.shape[0], qn.shape[1], KV_LORA, dtype=torch.float64)
    qo = batch.qo_indptr_cpu.tolist()
    for b, s in enumerate(slots):
        rows = flat[s]  # [L, 576]
        length, n_new = rows.shape[0], qo[b + 1] - qo[b]
        for i in range(n_new):
            visible = length - n_new + i + 1
            k = rows[:visible]
            t = qo[b] + i
            scores = (qn[t] @ k[:, :KV_LORA].T + qp[t] @ k[:, KV_LORA:].T) * sm_scale  # [H, visible]
            w = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
            out[t] = (w / w.sum(dim=1, keepdim=True)) @ k[:, :KV_LORA]
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    if torch.isnan(a).any():
        return math.inf
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-300))


def spec(heads: int = 4, dtype: str = "float32", max_context: int = 2048):
    from runtime.core.model_spec import ModelSpec

    return ModelSpec.from_config({
        "name": "test", "num_layers": 1, "hidden_size": 64, "num_heads": heads, "q_lora_rank": None,
        "kv_lora_rank": KV_LORA, "qk_nope_head_dim": 128, "qk_rope_head_dim": ROPE, "v_head_dim": 128,
        "vocab_size": 32, "max_context": max_context, "dtype": dtype, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "layer_pattern": ["full"], "weight_seed": 0,
    })
