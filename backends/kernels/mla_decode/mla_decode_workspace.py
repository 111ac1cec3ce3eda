"""The caller-owned workspace of the absorbed-MLA decode (:func:`backends.kernels.mla_decode.mla_decode.mla_decode`):
its shapes and bytes, in plain host arithmetic (no Triton import, so a backend's workspace spec can be sized on a
machine without Triton).

Three tensors, all handed to every call whichever stage 1 runs:

* ``partial_out`` float32 ``[R, H, max_splits, D_CKV]`` and ``partial_lse`` float32 ``[R, H, max_splits]``: the
  split pieces' partial outputs and log-sum-exps, one flat space of ``R * max_splits`` slots;
* ``work`` int32 ``[decode_work_ints(...)]``: the decode plan that the Gluon (wgmma) stage 1 on Hopper reads and
  its plan kernel writes (:mod:`backends.kernels.mla_decode.mla_decode_plan_kernels`). The Triton stage 1 plans
  inside its kernels and leaves it alone, but the launcher checks its size on every call, so a workspace that works
  on the CPU also takes the fast kernels on Hopper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "DEFAULT_MAX_SPLITS",
    "MAX_GRID_PROGRAMS",
    "MIN_WORKSPACE_SLOTS",
    "DecodeWorkspace",
    "DecodeWorkspaceShapes",
    "decode_work_ints",
    "decode_workspace_bytes",
    "decode_workspace_shapes",
]

#: Default split slots per request row of the workspace (batch 256 x 16 heads -> 64 MiB of partials). The
#: kernels use the workspace as one flat space of ``rows * max_splits`` slots, so only the product matters.
DEFAULT_MAX_SPLITS = 8
#: decode_workspace_shapes gives the workspace at least this many split slots in all (for small batches).
MIN_WORKSPACE_SLOTS = 512
#: Upper bound on the stage-1 grid's program dimension (CUDA limits grid.y to 65535).
MAX_GRID_PROGRAMS = 65535
#: The smallest head block of the wgmma stage 1 (its head blocks are 16, 32 or 64 heads).
_MIN_BLOCK_H = 16


def decode_work_ints(batch: int, heads: int, slots: int) -> int:
    """int32 elements of the decode plan (``work``) for any call of up to ``batch`` requests of ``heads`` heads over
    ``slots`` split slots (``partial_out.shape[0] * max_splits``).

    The plan (``plan_ints`` in :mod:`backends.kernels.mla_decode.mla_decode_plan_kernels`) holds 8 int32 per stage-1
    program and ``2 + head_blocks`` per request. A call never runs more programs than its split slots (nor
    :data:`MAX_GRID_PROGRAMS`; see ``decode_programs``), and the wgmma head blocks are at least 16 heads, so this
    bounds every call's plan whatever the device's SM count."""
    return 8 * min(max(int(slots), 1), MAX_GRID_PROGRAMS) + (2 + max(1, int(heads) // _MIN_BLOCK_H)) * int(batch)


class DecodeWorkspace(NamedTuple):
    """The three workspace tensors, in :func:`mla_decode`'s argument order (``mla_decode(..., out, *workspace)``)."""

    partial_out: torch.Tensor
    partial_lse: torch.Tensor
    work: torch.Tensor


@dataclass(frozen=True)
class DecodeWorkspaceShapes:
    """Shapes of the decode workspace: ``partial_out`` and ``partial_lse`` float32, ``work`` int32."""

    partial_out: tuple[int, int, int, int]
    partial_lse: tuple[int, int, int]
    work: tuple[int]

    @property
    def nbytes(self) -> int:
        """Bytes of the three tensors (4 bytes an element each)."""
        return 4 * sum(_numel(s) for s in (self.partial_out, self.partial_lse, self.work))

    def allocate(self, device: torch.device | str) -> DecodeWorkspace:
        """Uninitialized tensors of these shapes on ``device`` (the kernels write before they read)."""
        return DecodeWorkspace(
            torch.empty(self.partial_out, dtype=torch.float32, device=device),
            torch.empty(self.partial_lse, dtype=torch.float32, device=device),
            torch.empty(self.work, dtype=torch.int32, device=device),
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def decode_workspace_shapes(
    batch: int, heads: int, max_splits: int = DEFAULT_MAX_SPLITS, kv_lora_rank: int = 512
) -> DecodeWorkspaceShapes:
    """The workspace of :func:`mla_decode` for calls of up to ``batch`` requests (the rows' count, at least) of
    ``heads`` heads.

    The first dimension of the partials is ``rows = max(batch, cdiv(MIN_WORKSPACE_SLOTS, max_splits))`` so that small
    batches (batch 1 with one very long request) still get enough split slots to fill the GPU; ``work`` holds the
    plan of any call of up to ``rows`` requests over those slots (:func:`decode_work_ints`)."""
    rows = max(int(batch), -(-MIN_WORKSPACE_SLOTS // int(max_splits)))
    h, s, d = int(heads), int(max_splits), int(kv_lora_rank)
    return DecodeWorkspaceShapes((rows, h, s, d), (rows, h, s), (decode_work_ints(rows, h, rows * s),))


def decode_workspace_bytes(
    batch: int, heads: int, max_splits: int = DEFAULT_MAX_SPLITS, kv_lora_rank: int = 512
) -> int:
    """Bytes of the workspace (partial_out + partial_lse + work) that :func:`decode_workspace_shapes` describes."""
    return decode_workspace_shapes(batch, heads, max_splits, kv_lora_rank).nbytes
