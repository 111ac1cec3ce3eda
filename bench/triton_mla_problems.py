"""Problems for the Triton MLA kernel bench (bench/triton_mla_kernels_gpu.py): paged KV on shuffled pages, decode
and extend batches with the backend's workspace, their float32 references, and the kernels' split plan.

Every problem holds several copies of its KV inputs when one copy would fit in L2
(:func:`bench.harness.copies_for_l2`); its ``runner`` rotates through them, one copy per call.
"""

from __future__ import annotations

import math

import torch
import triton

from backends.kernels.mla_decode.mla_decode import (
    decode_programs,
    decode_work_ints,
    default_decode_config,
    mla_decode,
    programs_per_sm,
)
from backends.kernels.mla_extend.mla_extend import mla_extend
from bench.harness import copies_for_l2

D_CKV, D_PE, D = 512, 64, 576
DTYPE = torch.bfloat16
ELT = 2
PAGE = 64
SCALE = 1.0 / math.sqrt(192)


class Paged:
    """One copy of a paged problem: shuffled pages, page table, lengths.

    Attributes
    ----------
    kv : torch.Tensor
        [pages, page_size, 576] bf16, random normal.
    pt : torch.Tensor
        [B, max pages] int32 page table (unused entries 0).
    kv_page_indptr, kv_indices : torch.Tensor
        int32 CSR form of the page table (FlashInfer's layout).
    sl : torch.Tensor
        [B] int32 lengths.
    """

    def __init__(self, kv_lens, page_size, g, device):
        dev = self.device = torch.device(device)
        B = len(kv_lens)
        pages_per = [max(1, math.ceil(L / page_size)) for L in kv_lens]
        total = sum(pages_per)
        self.kv = torch.randn(total, page_size, D, device=dev, dtype=torch.float32, generator=g).to(DTYPE)
        perm = torch.randperm(total, device=dev, generator=g).to(torch.int32)
        width = max(pages_per)
        self.pt = torch.zeros(B, width, dtype=torch.int32, device=dev)
        indptr = [0]
        for b, n in enumerate(pages_per):
            self.pt[b, :n] = perm[indptr[-1] : indptr[-1] + n]
            indptr.append(indptr[-1] + n)
        self.kv_page_indptr = torch.tensor(indptr, dtype=torch.int32, device=dev)
        self.kv_indices = torch.cat([self.pt[b, :n] for b, n in enumerate(pages_per)])
        self.lens = list(kv_lens)
        self.sl = torch.tensor(kv_lens, dtype=torch.int32, device=dev)
        self.page_size = page_size

    def rows(self, b):
        """[L, 576] float32 KV rows of request ``b``, in token order."""
        dev = self.device
        L = self.lens[b]
        t = torch.arange(L, device=dev)
        return self.kv[self.pt[b, t // self.page_size].long(), t % self.page_size].float()


def plan_pieces(lens, programs, min_tokens, block_n, snap=True):
    """Split pieces of the kernels' token-balanced plan (mirror of mla_decode_kernels; see the tests)."""
    pad = [-(-L // block_n) * block_n for L in lens]
    total = sum(pad)
    chunk = max(triton.cdiv(triton.cdiv(total, programs), block_n) * block_n,
                triton.cdiv(min_tokens, block_n) * block_n, block_n)  # fmt: skip
    nonzero = {pd for pd in pad if pd > 0}
    if snap and len(nonzero) == 1:  # equal lengths: cut at request boundaries if it costs <= 1/8 more
        eq = nonzero.pop()
        r = triton.cdiv(chunk, eq) * eq
        if 8 * r <= 9 * chunk:
            chunk = r
    s, pieces = 0, 0
    for L, pd in zip(lens, pad):
        p0, p1 = s // chunk, max(s + pd - 1, 0) // chunk
        if L > 0 and p1 > p0:
            pieces += p1 - p0 + 1
        s += pd
    return chunk, pieces


class DecodeProblem:
    """A decode batch plus the backend's workspace: ``split_slots`` slots of [H, 513] float32, viewed as
    partial_out [B, H, S, 512] and partial_lse [B, H, S] with S = min(max_splits, split_slots // B)."""

    def __init__(self, kv_lens, heads, device, page_size=PAGE, seed=0, max_splits=64, split_slots=2048):
        dev = self.device = torch.device(device)
        g = torch.Generator(device=dev).manual_seed(seed)
        self.B, self.H = len(kv_lens), heads
        self.lens = list(kv_lens)
        self.kv_bytes = sum(kv_lens) * D * ELT
        self.copies = [Paged(kv_lens, page_size, g, dev) for _ in range(copies_for_l2(self.kv_bytes, dev))]
        self.q_nope = torch.randn(self.B, heads, D_CKV, device=dev, generator=g).to(DTYPE)
        self.q_pe = torch.randn(self.B, heads, D_PE, device=dev, generator=g).to(DTYPE)
        self.out = torch.empty(self.B, heads, D_CKV, device=dev, dtype=DTYPE)
        self.max_splits, self.split_slots = max_splits, split_slots
        self.ws = torch.empty(split_slots * heads * (D_CKV + 1), device=dev)
        self.work = torch.empty(decode_work_ints(split_slots, heads, split_slots), dtype=torch.int32, device=dev)
        self._ref = None
        self.flops = 2 * heads * sum(kv_lens) * (D + D_CKV)

    def workspace(self, max_splits):
        S = max(1, min(max_splits, self.split_slots // self.B))
        n = self.B * self.H * S * D_CKV
        po = self.ws[:n].view(self.B, self.H, S, D_CKV)
        pl = self.ws[n : n + self.B * self.H * S].view(self.B, self.H, S)
        return po, pl, S

    def plan(self, cfg, sms):
        """(programs, pieces, partial bytes written + read by the merge) for a config."""
        d = default_decode_config(self.H, DTYPE)
        bh, bn = cfg.get("block_h") or d["block_h"], cfg.get("block_n") or d["block_n"]
        S = self.workspace(cfg.get("ws", self.max_splits))[2]
        tp = cfg.get("target_programs")
        if tp is None:
            tma = cfg.get("use_tma", d.get("use_tma", False)) and PAGE % bn == 0
            tp = programs_per_sm(bh, tma) * sms
        hb = -(-self.H // bh)
        P = decode_programs(self.B, self.B * S, hb, tp)
        _, pieces = plan_pieces(self.lens, P, cfg.get("min_tokens_per_split", 256), bn, cfg.get("snap", True))
        return P, pieces, 2 * pieces * self.H * (D_CKV + 1) * 4

    def ref(self):
        """[B, H, 512] float32 reference output on copy 0."""
        if self._ref is None:
            p = self.copies[0]
            ref = torch.empty(self.B, self.H, D_CKV, device=self.device)
            for b in range(self.B):
                rows = p.rows(b)
                s = (self.q_nope[b].float() @ rows[:, :D_CKV].T + self.q_pe[b].float() @ rows[:, D_CKV:].T) * SCALE
                ref[b] = torch.softmax(s, dim=-1) @ rows[:, :D_CKV]
            self._ref = ref
        return self._ref

    def runner(self, **cfg):
        """A call of ``mla_decode`` with ``cfg`` that rotates over the input copies (``ws=`` sets max_splits). The
        Triton stage 1 unless ``cfg`` says ``use_wgmma``: the configs swept here are its tilings."""
        state = [0]
        cfg = dict(cfg)
        cfg.setdefault("use_wgmma", False)
        po, pl, S = self.workspace(cfg.pop("ws", self.max_splits))

        def run():
            p = self.copies[state[0] % len(self.copies)]
            state[0] += 1
            mla_decode(
                self.q_nope, self.q_pe, p.kv, p.pt, p.sl, SCALE, self.out, po, pl, self.work, max_splits=S, **cfg
            )  # fmt: skip

        return run


class ExtendProblem:
    """An extend batch: ``q_lens[b]`` new tokens at the end of ``kv_lens[b]`` (causal), on paged KV."""

    def __init__(self, q_lens, kv_lens, heads, device, page_size=PAGE, seed=0):
        dev = self.device = torch.device(device)
        g = torch.Generator(device=dev).manual_seed(seed)
        self.q_lens, self.kv_lens, self.H = list(q_lens), list(kv_lens), heads
        self.kv_bytes = sum(kv_lens) * D * ELT
        self.copies = [Paged(kv_lens, page_size, g, dev) for _ in range(copies_for_l2(self.kv_bytes, dev))]
        T = sum(q_lens)
        self.q_nope = torch.randn(T, heads, D_CKV, device=dev, generator=g).to(DTYPE)
        self.q_pe = torch.randn(T, heads, D_PE, device=dev, generator=g).to(DTYPE)
        self.out = torch.empty(T, heads, D_CKV, device=dev, dtype=DTYPE)
        self.indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        visible = sum(sum(L - n + i + 1 for i in range(n)) for n, L in zip(q_lens, kv_lens))
        self.flops = 2 * heads * visible * (D + D_CKV)
        self._ref = None

    def ref(self):
        """[T, H, 512] float32 reference output on copy 0."""
        if self._ref is None:
            dev = self.device
            p = self.copies[0]
            ref = torch.empty(self.out.shape, device=dev)
            q0 = 0
            for b, (n, L) in enumerate(zip(self.q_lens, self.kv_lens)):
                rows = p.rows(b)
                for h0 in range(0, self.H, 4):  # bounded memory for long requests
                    qn = self.q_nope[q0 : q0 + n, h0 : h0 + 4].float()
                    qp = self.q_pe[q0 : q0 + n, h0 : h0 + 4].float()
                    s = (
                        torch.einsum("nhc,lc->nhl", qn, rows[:, :D_CKV])
                        + torch.einsum("nhr,lr->nhl", qp, rows[:, D_CKV:])
                    ) * SCALE
                    pos = torch.arange(L - n, L, device=dev)[:, None, None]
                    s = s.masked_fill(torch.arange(L, device=dev)[None, None, :] > pos, float("-inf"))
                    ref[q0 : q0 + n, h0 : h0 + 4] = torch.einsum("nhl,lc->nhc", torch.softmax(s, -1), rows[:, :D_CKV])
                q0 += n
            self._ref = ref
        return self._ref

    def runner(self, **cfg):
        """A call of ``mla_extend`` with ``cfg`` that rotates over the input copies."""
        state = [0]
        max_q = max(self.q_lens)

        def run():
            p = self.copies[state[0] % len(self.copies)]
            state[0] += 1
            mla_extend(self.q_nope, self.q_pe, p.kv, p.pt, self.indptr, p.sl, SCALE, self.out, max_q_len=max_q, **cfg)

        return run
