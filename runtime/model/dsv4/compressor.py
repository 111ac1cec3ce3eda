"""V4 KV compressors (CSA and HCA) and the indexer's queries.

A compressor projects every token to kv and gate rows (done by the caller: one GEMM each for the whole batch); a
closed window of ``rate`` tokens becomes one entry: ``entry = RMSNorm(sum_j softmax_j(gate_j + position_bias_j) *
kv_j)`` (softmax per channel over the window's slots), then RoPE (the ``compress`` rope) at the window's first
position ``e * rate``.

Overlapping compressors (CSA, and the CSA indexer's own compressor) project to ``2 * dim``: a token's first half
(series A) belongs to the NEXT entry, its second half (series B) to its own window's entry, so entry ``e`` mixes
``2 * rate`` slots: window ``e - 1``'s A and window ``e``'s B. Before any window closed, the A slots are empty
(gate -inf: weight 0).

Tokens arrive in pieces (extend in chunks, decode one by one); :func:`compress_step` (one request's chunk) keeps the
partial window and the previous window's A series in a :class:`runtime.core.dsv4_pools.CompressorStatePool` row.
:func:`compress_decode` does a decode step of the whole batch at once (no loop per request, no host value): every
request gets a *candidate* entry, complete where its window closed with this token; :func:`compress_decode_rope`
adds the entry's RoPE (what the decoder ops' ``compress_decode`` computes: ``TorchOps`` this function, ``FusedOps``
one Triton kernel, :mod:`backends.kernels.dsv4.compress_decode`).
"""

from __future__ import annotations

import torch

from runtime.core.dsv4_pools import CompressorStatePool
from runtime.model.deepseek.rope import RopeParams, apply_rope_tail, cos_sin
from runtime.model.dsv4.norms import rms_norm


def compress_windows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float, prev_kv: torch.Tensor | None = None, prev_gate: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Entries of ``nw`` closed windows (RMSNorm applied, no RoPE yet).

    Parameters
    ----------
    kv, gate : torch.Tensor
        [nw, rate, width] projections of the windows' tokens (gate without the position bias), nw >= 1.
    position_bias : torch.Tensor
        [rate, width].
    norm_weight : torch.Tensor
        [dim]; ``width == 2 * dim`` (overlapping) or ``dim``.
    prev_kv, prev_gate : torch.Tensor or None
        [rate, dim] the A series (gate with bias) of the window before the first one; overlapping only.

    Returns
    -------
    entries : [nw, dim] in kv's dtype
    last_kv, last_gate : [rate, dim] the last window's A series (gate with bias), for the next call; None when not
        overlapping.
    """
    dim = norm_weight.shape[0]
    gate = gate + position_bias.to(gate.dtype)
    if kv.shape[-1] != 2 * dim:
        return _mix(kv, gate, norm_weight, eps), None, None
    a_kv = torch.cat([prev_kv[None].to(kv.dtype), kv[:-1, :, :dim]])
    a_gate = torch.cat([prev_gate[None].to(gate.dtype), gate[:-1, :, :dim]])
    entries = _mix(torch.cat([a_kv, kv[:, :, dim:]], dim=1), torch.cat([a_gate, gate[:, :, dim:]], dim=1),
                   norm_weight, eps)
    return entries, kv[-1, :, :dim], gate[-1, :, :dim]


def _mix(kv: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[nw, slots, dim] kv and gate logits (bias added) -> [nw, dim]: softmax over the slots per channel, the
    weighted sum, RMSNorm."""
    cd = torch.float64 if kv.dtype == torch.float64 else torch.float32
    weights = torch.softmax(gate.to(cd), dim=1).to(kv.dtype)
    return rms_norm((kv * weights).sum(dim=1), norm_weight, eps)


def compress_decode(kv_new: torch.Tensor, gate_new: torch.Tensor, position_bias: torch.Tensor,
                    norm_weight: torch.Tensor, eps: float, state: CompressorStatePool, layer_id: int,
                    rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A decode step of every request at once: kv_new / gate_new [B, width] the new tokens' projections (gate
    without the position bias), rows [B] int64 their state rows, positions [B] int64 their positions (all on one
    device).

    Each token goes to slot ``position % rate`` of its row's partial window. Returns [B, dim] *candidate*
    entries (no RoPE) for entry ``position // rate``: the entry itself where that token closed its window
    (``position % rate == rate - 1``; the same values :func:`compress_step` gives), otherwise a mix of the
    partial window and stale slots that the caller must not use as an entry. The overlap series moves on only
    for closed rows. Fixed shapes and no host value: the same work every step, whatever closes.
    """
    rate, li = state.rate, state.layer(layer_id)
    slot = positions % rate
    sdt = state.pending_kv.dtype
    dt = kv_new.dtype
    state.pending_kv[li, rows, slot] = kv_new.to(sdt)
    state.pending_gate[li, rows, slot] = gate_new.to(sdt)
    kv = state.pending_kv[li, rows].to(dt)  # [B, rate, width]: exact (the state dtype is at least as wide)
    gate = state.pending_gate[li, rows].to(dt) + position_bias.to(dt)
    dim = norm_weight.shape[0]
    if kv.shape[-1] != 2 * dim:
        return _mix(kv, gate, norm_weight, eps)
    a_kv, a_gate = state.prev_kv[li, rows], state.prev_gate[li, rows]
    entries = _mix(torch.cat([a_kv.to(dt), kv[:, :, dim:]], dim=1),
                   torch.cat([a_gate.to(dt), gate[:, :, dim:]], dim=1), norm_weight, eps)
    closed = (slot == rate - 1)[:, None, None]
    state.prev_kv[li, rows] = torch.where(closed, kv[:, :, :dim].to(sdt), a_kv)
    state.prev_gate[li, rows] = torch.where(closed, gate[:, :, :dim].to(sdt), a_gate)
    return entries


def compress_decode_rope(kv_new: torch.Tensor, gate_new: torch.Tensor, position_bias: torch.Tensor,
                         norm_weight: torch.Tensor, eps: float, state: CompressorStatePool, layer_id: int,
                         rows: torch.Tensor, positions: torch.Tensor, rope: RopeParams,
                         rope_dim: int) -> torch.Tensor:
    """:func:`compress_decode` (rows [B] int32 or int64), then RoPE (``rope``, the last ``rope_dim`` channels) of
    each candidate at its entry's first position ``positions // rate * rate``: [B, dim] in kv_new's dtype."""
    ent = compress_decode(kv_new, gate_new, position_bias, norm_weight, eps, state, layer_id, rows.long(), positions)
    cos, sin = cos_sin(rope, rope_dim, positions // state.rate * state.rate, ent.dtype)
    return apply_rope_tail(ent, cos, sin)


def compress_step(kv_new: torch.Tensor, gate_new: torch.Tensor, position_bias: torch.Tensor,
                  norm_weight: torch.Tensor, eps: float, state: CompressorStatePool, layer_id: int, row: int,
                  start: int) -> tuple[int, torch.Tensor]:
    """Feed tokens ``start .. start + n - 1`` of one request to its compressor: kv_new / gate_new [n, width] their
    projections (gate without the position bias).

    Returns (first entry id, entries [nw, dim]) of the windows that closed (nw may be 0); the partial window and
    the overlap series are kept in ``state`` row ``row``. RoPE is not applied here.
    """
    rate = state.rate
    li = state.layer(layer_id)
    held = start % rate
    kv = torch.cat([state.pending_kv[li, row, :held].to(kv_new.dtype), kv_new])
    gate = torch.cat([state.pending_gate[li, row, :held].to(gate_new.dtype), gate_new])
    nw = kv.shape[0] // rate
    first = (start - held) // rate
    entries = kv.new_zeros(0, norm_weight.shape[0])
    if nw:
        used = nw * rate
        overlap = state.prev_kv is not None
        entries, last_kv, last_gate = compress_windows(
            kv[:used].view(nw, rate, -1), gate[:used].view(nw, rate, -1), position_bias, norm_weight, eps,
            state.prev_kv[li, row] if overlap else None, state.prev_gate[li, row] if overlap else None)
        if overlap:
            state.prev_kv[li, row] = last_kv.to(state.prev_kv.dtype)
            state.prev_gate[li, row] = last_gate.to(state.prev_gate.dtype)
        kv, gate = kv[used:], gate[used:]
    state.pending_kv[li, row, : kv.shape[0]] = kv.to(state.pending_kv.dtype)
    state.pending_gate[li, row, : gate.shape[0]] = gate.to(state.pending_gate.dtype)
    return first, entries
