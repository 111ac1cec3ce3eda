"""DeepSeek-V4 decode attention over gathered rows: the Triton launcher (:func:`dsv4_decode`) and the torch
fallback with the same arguments (:func:`dsv4_decode_torch`, on
:func:`backends.kernels.dsv4.dsv4_reference.sink_attention`).

Arguments (B requests, one query token each, H heads, D = the shared KV row width):

* ``q`` [B, H, D] (RoPE applied), last dim contiguous;
* ``win_rows`` [Sw, D] and ``win_idx`` [B, Nw] int32: the window rows each query sees (the ring of one layer
  flattened, ``row * W + p % W``), ``-1`` = none;
* ``cmp_rows`` [Sc, D] and ``cmp_idx`` [B, Nc] int32: the compressed entries (CSA: the indexer's top-k slots; HCA:
  every closed entry's slot), ``-1`` = none; ``Nc`` may be 0 (sliding-only layers);
* ``sinks`` [H] (natural-log logits, not scaled), ``sm_scale``;
* ``cmp_len`` [B] int32 or None: request ``b`` reads only its first ``cmp_len[b]`` compressed indices (a list
  padded to a fixed width for CUDA graphs: the padding's tiles are not visited); None = all ``Nc``.

Returns [B, H, D] in q's dtype. Triton is imported lazily (the fallback works without it).

Split over the rows (flash-decoding): one program per 16-head block and request is a handful of programs at small
batches (batch 1, 64 heads: 4 on a 132-SM H100). ``num_splits`` > 1 cuts each request's concatenated list (window
indices, then compressed indices) into tile-aligned slices of ``split_len`` rows, one program per (head block,
split, request), whose partial softmax states a second kernel merges with the sink (counted once). The automatic
choice (:func:`decode_splits`) depends only on B, H, the list widths, the tiles and the SM count (read once per
device; a fixed :data:`CPU_SM_COUNT` on the CPU and in the interpreter), so it is the same on every replay of a
shape; no host sync. Partials live in a float32 workspace (:func:`decode_workspace_floats`): the caller's (a
ledger buffer, :func:`decode_workspace_bytes` bounds what the automatic choice needs for any batch), else
allocated per call. Checked against float64 and timed on an H100 (bench/dsv4_decode_bench.py): at batch 1 and 4
the automatic split is 1.1x (192 rows) to 2.5-4x (640-1152 rows) faster than the single pass; at batch 64 it does
not split (2 splits measured 0.7-0.9x).
"""

from __future__ import annotations

import torch

from backends.kernels.checks import interpreted, require
from backends.kernels.dsv4.dsv4_reference import sink_attention
from backends.kernels.sm_count import sm_count as gpu_sm_count


def _check(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks, cmp_len=None) -> None:
    require(q.dim() == 3, f"q [B, H, D]; got shape {tuple(q.shape)}")
    b, h, d = q.shape
    require(cmp_len is None or (cmp_len.shape == (b,) and cmp_len.dtype == torch.int32 and cmp_len.is_contiguous()),
            f"cmp_len None or contiguous int32 [B={b}]; got {None if cmp_len is None else (cmp_len.dtype, tuple(cmp_len.shape))}")
    for name, rows in (("win_rows", win_rows), ("cmp_rows", cmp_rows)):
        require(rows.dim() == 2 and rows.shape[1] == d and rows.is_contiguous(), f"{name} contiguous [S, {d}]")
        require(rows.dtype == q.dtype, f"{name} in q's dtype {q.dtype}; got {rows.dtype}")
    for name, idx in (("win_idx", win_idx), ("cmp_idx", cmp_idx)):
        require(idx.dim() == 2 and idx.shape[0] == b and idx.dtype == torch.int32 and idx.stride(-1) == 1,
                f"{name} int32 [B={b}, N] with a contiguous last dim; got {idx.dtype} {tuple(idx.shape)}")
    require(sinks.shape == (h,), f"sinks [H={h}]; got {tuple(sinks.shape)}")


def dsv4_decode_torch(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks, sm_scale: float,
                      compute_dtype: torch.dtype = torch.float64, cmp_len: torch.Tensor | None = None) -> torch.Tensor:
    """The fallback (and the kernel's oracle in float64): gather, then one joint softmax with the sinks."""
    _check(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks, cmp_len)
    if cmp_len is not None:
        cols = torch.arange(cmp_idx.shape[1], device=cmp_idx.device)
        cmp_idx = torch.where(cols[None, :] < cmp_len[:, None], cmp_idx, -1)
    parts = []
    for rows, idx in ((win_rows, win_idx), (cmp_rows, cmp_idx)):
        if idx.shape[1]:
            parts.append((rows[idx.long().clamp_min(0)].to(compute_dtype), idx >= 0))
    out = sink_attention(q.to(compute_dtype), parts, sinks.to(compute_dtype), sm_scale)
    return out.to(q.dtype)


def tile_options(kernel, q: torch.Tensor, block_h: int, block_n: int, num_warps: int, num_stages: int) -> dict:
    """The V4 kernels' compile-time tile arguments and launch options for ``q`` [.., H, D], after checking them:
    D a power of two, tiles of at least 16 (tl.dot). The CPU interpreter takes no warps / stages and gets fp32
    operands for non-fp32 dots (it computes those wrong)."""
    import triton

    d = q.shape[-1]
    require(triton.next_power_of_2(d) == d, f"a power-of-two row width; got {d}")
    require(block_h >= 16 and block_n >= 16, f"tiles of at least 16 (tl.dot); got {block_h}, {block_n}")
    interp = interpreted(kernel)
    extra = {} if interp else dict(num_warps=num_warps, num_stages=num_stages)
    return dict(D=d, BLOCK_H=block_h, BLOCK_N=block_n, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST=interp and q.dtype != torch.float32, **extra)


#: Split programs aimed at per SM by the automatic choice (about 1-2 waves of the 16-head programs: q, the
#: float32 accumulator and two stages of 32-row bf16 tiles fit about twice on an H100 SM). Retune on the GPU with
#: bench/dsv4_decode_bench.py.
PROGRAMS_PER_SM = 2
#: The automatic choice gives every split at least this many BLOCK_N tiles (a split stores H x (D + 2) floats of
#: partials that the merge reads back). One 64-row tile per split was the fastest measured on an H100 at 192 rows
#: (3 splits: 10.0 us against 11.9 with two 32-row tiles and 13.1 unsplit; bench/dsv4_decode_bench.py).
MIN_TILES_PER_SPLIT = 1
#: SM count assumed on the CPU and under the Triton interpreter (fixed, so the choice is reproducible there).
CPU_SM_COUNT = 8


def sm_count(device: torch.device, interpreted: bool = False) -> int:
    """SMs the automatic split choice aims at: the GPU's (read once per device), else :data:`CPU_SM_COUNT`."""
    return CPU_SM_COUNT if interpreted else gpu_sm_count(device, CPU_SM_COUNT)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_len(n_rows: int, num_splits: int, block_n: int) -> int:
    """Rows per split: ``n_rows / num_splits`` rounded up to whole ``block_n`` tiles (trailing splits may be empty)."""
    return _cdiv(_cdiv(max(n_rows, 1), max(num_splits, 1)), block_n) * block_n


def decode_splits(batch: int, heads: int, n_rows: int, sms: int, block_h: int = 16, block_n: int = 64) -> int:
    """The automatic split count for ``batch`` requests of ``heads`` heads over lists of ``n_rows`` = Nw + Nc
    indices: 1 when the unsplit grid (``batch * cdiv(heads, block_h)`` programs) already has a program per SM;
    else enough splits for about ``PROGRAMS_PER_SM * sms`` programs, each split at least
    ``MIN_TILES_PER_SPLIT`` tiles of ``block_n`` rows, and no empty split. Shapes only (graph friendly)."""
    programs = batch * _cdiv(heads, block_h)
    if programs == 0 or programs >= sms:
        return 1
    want = min(_cdiv(PROGRAMS_PER_SM * sms, programs), n_rows // (MIN_TILES_PER_SPLIT * block_n))
    if want <= 1:
        return 1
    return _cdiv(n_rows, split_len(n_rows, want, block_n))


def decode_workspace_floats(batch: int, heads: int, d: int, num_splits: int) -> int:
    """float32 values of the split partials: acc [B, S, H, D], then m and l [B, S, 2, H] (0 for one split)."""
    return 0 if num_splits <= 1 else batch * num_splits * heads * (d + 2)


def decode_workspace_bytes(heads: int, d: int, sms: int, block_h: int = 16) -> int:
    """Bytes that hold the automatic choice's partials at any batch size on a GPU of ``sms`` SMs (it splits only
    while ``batch * cdiv(heads, block_h) < sms``, into at most ``cdiv(PROGRAMS_PER_SM * sms, that)`` splits)."""
    hb = _cdiv(heads, block_h)
    slots = max((b * _cdiv(PROGRAMS_PER_SM * sms, b * hb) for b in range(1, _cdiv(sms, hb) + 1) if b * hb < sms),
                default=0)
    return 4 * slots * heads * (d + 2)


def _workspace_floats(workspace: torch.Tensor) -> torch.Tensor:
    """The caller's workspace as flat float32 (a ledger buffer is uint8 [nbytes])."""
    require(workspace.is_contiguous(), "a contiguous workspace")
    if workspace.dtype == torch.uint8:
        return workspace[: workspace.numel() // 4 * 4].view(torch.float32)
    require(workspace.dtype == torch.float32, f"workspace float32 or uint8 (a ledger buffer); got {workspace.dtype}")
    return workspace.view(-1)


def dsv4_decode(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks, sm_scale: float, out: torch.Tensor | None = None,
                block_h: int = 16, block_n: int = 64, num_warps: int = 8, num_stages: int = 2,
                num_splits: int | None = None, workspace: torch.Tensor | None = None,
                cmp_len: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernels (:mod:`backends.kernels.dsv4.dsv4_decode_kernels`); see the module docstring. Tiles:
    ``block_h`` heads x ``block_n`` rows (both >= 16, tl.dot); D must be a power of two. The defaults (16 x 64, 8
    warps) were the fastest of bench/dsv4_decode_bench.py's tiles on an H100 at V4-Flash shapes in most rows.

    ``num_splits``: None = :func:`decode_splits` (capped by the workspace's room when one is given), 1 = the
    single-pass kernel, n > 1 = n splits of :func:`split_len` rows (some may be empty). ``workspace``: float32
    or uint8, at least :func:`decode_workspace_floats` values for the splits used (None: allocated here when
    splitting). No host sync; no allocation given ``out`` and ``workspace``."""
    import triton

    from backends.kernels.dsv4 import dsv4_decode_kernels as kern

    _check(q, win_rows, win_idx, cmp_rows, cmp_idx, sinks, cmp_len)
    b, h, d = q.shape
    require(q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"q bf16, fp16 or fp32; got {q.dtype}")
    require(q.stride(-1) == 1, "q with a contiguous last dim")
    require(num_splits is None or num_splits >= 1, f"num_splits None (automatic) or >= 1; got {num_splits}")
    tiles = tile_options(kern._dsv4_decode_kernel, q, block_h, block_n, num_warps, num_stages)
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    n_rows = win_idx.shape[1] + cmp_idx.shape[1]
    ws = None if workspace is None else _workspace_floats(workspace)
    interp = interpreted(kern._dsv4_split_kernel)
    if num_splits is None:
        num_splits = decode_splits(b, h, n_rows, sm_count(q.device, interp), block_h, block_n)
        if ws is not None:  # the caller's room caps it (its size is fixed: still a function of shapes only)
            num_splits = max(1, min(num_splits, ws.numel() // (b * h * (d + 2))))
    lens = cmp_idx if cmp_len is None else cmp_len  # (an unread placeholder pointer without HAS_LEN)
    if num_splits == 1:
        kern._dsv4_decode_kernel[(triton.cdiv(h, block_h), b)](
            q, win_rows, win_idx, cmp_rows, cmp_idx, lens, sinks, out, float(sm_scale) * kern.LOG2E,
            q.stride(0), q.stride(1), win_idx.stride(0), cmp_idx.stride(0), out.stride(0), out.stride(1),
            h, win_idx.shape[1], cmp_idx.shape[1], **tiles, HAS_LEN=cmp_len is not None,
        )  # fmt: skip
        return out
    need = decode_workspace_floats(b, h, d, num_splits)
    if ws is None:
        ws = torch.empty(need, dtype=torch.float32, device=q.device)
    require(ws.numel() >= need, f"a workspace of at least {need} float32 values ({4 * need} bytes) for B={b}, "
            f"H={h}, D={d}, num_splits={num_splits}; got {ws.numel()} values (fewer splits, or a larger workspace)")
    acc = ws[: b * num_splits * h * d].view(b, num_splits, h, d)
    ml = ws[b * num_splits * h * d : need].view(b, num_splits, 2, h)
    kern._dsv4_split_kernel[(triton.cdiv(h, block_h), num_splits, b)](
        q, win_rows, win_idx, cmp_rows, cmp_idx, lens, sinks, acc, ml, float(sm_scale) * kern.LOG2E,
        q.stride(0), q.stride(1), win_idx.stride(0), cmp_idx.stride(0), acc.stride(0), acc.stride(1),
        acc.stride(2), ml.stride(0), ml.stride(1), ml.stride(2), h, win_idx.shape[1], cmp_idx.shape[1],
        split_len(n_rows, num_splits, block_n), **tiles, HAS_LEN=cmp_len is not None,
    )  # fmt: skip
    block_hm = min(16, triton.next_power_of_2(h))
    block_dv = d if interp else min(d, 64)
    kern._dsv4_merge_kernel[(b, triton.cdiv(h, block_hm), d // block_dv)](
        acc, ml, sinks, out, acc.stride(0), acc.stride(1), acc.stride(2), ml.stride(0), ml.stride(1),
        ml.stride(2), out.stride(0), out.stride(1), h, num_splits, BLOCK_HM=block_hm, BLOCK_DV=block_dv,
        **({} if interp else dict(num_warps=4)),
    )  # fmt: skip
    return out
