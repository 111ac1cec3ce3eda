"""One forward step, as data: the batch every backend and hook receives (their one argument)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from runtime.core.device import packed_to_device


class ForwardMode(str, enum.Enum):
    EXTEND = "extend"  # prefill / chunked prefill: n new tokens per request over a cached prefix
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # speculative: verify draft tokens (uniform n per request)
    DRAFT_EXTEND = "draft_extend"  # speculative: extend the draft model with accepted tokens


@dataclass(frozen=True)
class PrefixChunk:
    """A slice of every request's cached prefix, for the MHA chunked-prefix prefill.

    Attributes
    ----------
    kv_slots : torch.Tensor
        [N] int64 on the device: KV-pool slots of the chunk's tokens, request by request, in token order.
    kv_indptr : torch.Tensor
        [B+1] int32 on the device: rows of request b are ``kv_indptr[b]:kv_indptr[b+1]`` (may be empty).
    kv_indptr_cpu : torch.Tensor
        [B+1] int32 host mirror of ``kv_indptr``.
    """

    kv_slots: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indptr_cpu: torch.Tensor


@dataclass
class ForwardBatch:
    """What one forward step runs. Device tensors have a host mirror so no step needs a device-to-host copy.

    Attributes
    ----------
    mode : ForwardMode
    req_pool_indices : torch.Tensor
        [B] int64 device: rows of the request -> token table.
    req_pool_indices_cpu : torch.Tensor
        [B] int64 host mirror.
    seq_lens : torch.Tensor
        [B] int32 device: KV length of each request after this step's new tokens are written.
    seq_lens_cpu : torch.Tensor
        [B] int32 host mirror of ``seq_lens``.
    extend_lens_cpu : torch.Tensor
        [B] int32 host: new tokens per request (1 for DECODE).
    qo_indptr : torch.Tensor
        [B+1] int32 device: new tokens of request b are rows ``qo_indptr[b]:qo_indptr[b+1]`` of q.
    qo_indptr_cpu : torch.Tensor
        [B+1] int32 host mirror.
    out_cache_loc : torch.Tensor
        [T] int64 device: KV-pool slot of every new token (slot = page * page_size + offset).
    positions : torch.Tensor
        [T] int64 device: absolute position of every new token (for RoPE).
    prefix_chunks : list of PrefixChunk
        Filled by the runtime for an EXTEND batch that takes the MHA chunked-prefix path; empty otherwise.
    kv_page_table : torch.Tensor or None
        [B, W] int32 device page ids (``req_to_token[req, k * page_size] // page_size``), filled by the
        shared kv-indices pass of a multi-step draft for backends whose capabilities say they do not build
        their own kv indices; None otherwise.
    """

    mode: ForwardMode
    req_pool_indices: torch.Tensor
    req_pool_indices_cpu: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_lens_cpu: torch.Tensor
    qo_indptr: torch.Tensor
    qo_indptr_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    prefix_chunks: list[PrefixChunk] = field(default_factory=list)
    kv_page_table: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr_cpu[-1])

    @property
    def prefix_lens_cpu(self) -> torch.Tensor:
        """[B] int32 host: tokens already cached before this step."""
        return self.seq_lens_cpu - self.extend_lens_cpu

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens_cpu.max()) if self.batch_size else 0

    @property
    def max_extend_len(self) -> int:
        return int(self.extend_lens_cpu.max()) if self.batch_size else 0


def make_batch(
    mode: ForwardMode,
    req_pool_indices: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    out_cache_loc: list[int] | torch.Tensor,
    device: torch.device,
) -> ForwardBatch:
    """Build a batch from host lists with ONE host-to-device copy, no device-to-host copy and no kernel (every
    field, int64 and int32, is a view of one packed buffer: :func:`~runtime.core.device.packed_to_device`).
    ``out_cache_loc``: the new tokens' slots, [T]."""
    b = len(req_pool_indices)
    if all(e == 1 for e in extend_lens):  # decode: one token per request
        positions = prefix_lens
        seq = [p + 1 for p in prefix_lens]
        qo: range | list[int] = range(b + 1)
    else:
        positions = list(itertools.chain.from_iterable(range(p, p + e) for p, e in zip(prefix_lens, extend_lens)))
        seq = [p + e for p, e in zip(prefix_lens, extend_lens)]
        qo = [0, *itertools.accumulate(extend_lens)]
    locs = out_cache_loc.cpu().numpy() if isinstance(out_cache_loc, torch.Tensor) else out_cache_loc
    (req_cpu, _, _, seq_h, qo_h, ext_h), (req, pos, loc, seq_d, qo_d, _) = packed_to_device(
        [req_pool_indices, positions, locs], [seq, qo, extend_lens], device)
    return ForwardBatch(mode=mode, req_pool_indices=req, req_pool_indices_cpu=req_cpu, seq_lens=seq_d,
                        seq_lens_cpu=seq_h, extend_lens_cpu=ext_h, qo_indptr=qo_d, qo_indptr_cpu=qo_h,
                        out_cache_loc=loc, positions=pos)
