"""Recurrent state of linear-attention layers: one [H, Dk, Dv] float32 state per request and layer.

A request's state lives in the row of its request-table row (:class:`runtime.core.kv_pool.ReqToTokenPool`): the row
IS the slot, so there is no allocator here. The engine calls :meth:`LinearStatePool.reset` when it admits a
request into a row.

One extra row, :attr:`LinearStatePool.padding_row` (= ``max_requests``), mirrors the request table's
padding row: CUDA-graph replay pads a decode batch with entries on that row, so their state updates land
on a row no request owns.
"""

from __future__ import annotations

import torch

STATE_DTYPE = torch.float32


class LinearStatePool:
    """Per-request recurrent states of every linear-attention layer.

    Parameters
    ----------
    num_linear_layers_ids : list of int
        Model layer ids of the linear-attention layers (any order, unique).
    max_requests : int
        Rows of the request table (``ReqToTokenPool.max_requests``).
    num_heads, head_k_dim, head_v_dim : int
        H, Dk, Dv of the linear-attention layers.
    device : torch.device

    Attributes
    ----------
    states : torch.Tensor
        [num_layers, max_requests + 1, H, Dk, Dv] float32 on ``device``, zero-initialised; row ``r`` of layer
        index ``i`` is the state of the request in request-table row ``r``; the last row is the padding row.
    padding_row : int
        ``max_requests``: the row that padded batch entries read and write (never a live request).
    """

    def __init__(
        self,
        num_linear_layers_ids: list[int],
        max_requests: int,
        num_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        device: torch.device,
    ):
        layer_ids = [int(x) for x in num_linear_layers_ids]
        problems = []
        if len(set(layer_ids)) != len(layer_ids):
            problems.append(f"num_linear_layers_ids={layer_ids} has duplicates; expected unique layer ids")
        for name, value in (("max_requests", max_requests), ("num_heads", num_heads),
                            ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim)):
            if int(value) < 1:
                problems.append(f"{name}={value}; expected >= 1")
        if problems:
            raise ValueError(
                "LinearStatePool: " + "; ".join(problems) + ". Fix: pass the linear-attention layer ids of the "
                "model's layer_pattern and the request table's max_requests."
            )
        self.layer_ids = layer_ids
        self.max_requests = int(max_requests)
        self.num_heads, self.head_k_dim, self.head_v_dim = int(num_heads), int(head_k_dim), int(head_v_dim)
        self.device = torch.device(device)
        self.padding_row = self.max_requests
        self._index = {layer: i for i, layer in enumerate(layer_ids)}
        self.states = torch.zeros(
            len(layer_ids), self.max_requests + 1, self.num_heads, self.head_k_dim, self.head_v_dim,
            dtype=STATE_DTYPE, device=self.device,
        )

    @staticmethod
    def planned_bytes(num_layers: int, max_requests: int, num_heads: int, head_k_dim: int, head_v_dim: int) -> int:
        """Bytes the pool will allocate (the padding row included), before allocating anything."""
        return num_layers * (max_requests + 1) * num_heads * head_k_dim * head_v_dim * STATE_DTYPE.itemsize

    @property
    def nbytes(self) -> int:
        return self.states.numel() * self.states.element_size()

    def _layer(self, layer_id: int) -> int:
        i = self._index.get(layer_id)
        if i is None:
            raise KeyError(
                f"LinearStatePool: got layer_id={layer_id}; expected one of the linear-attention layers "
                f"{self.layer_ids}. Fix: route only linear layers to the linear-attention backend, or build the "
                "pool with this layer's id."
            )
        return i

    def buffer(self, layer_id: int) -> torch.Tensor:
        """[max_requests + 1, H, Dk, Dv] float32 view of ``layer_id``, the padding row last."""
        return self.states[self._layer(layer_id)]

    def state(self, layer_id: int) -> torch.Tensor:
        """[max_requests, H, Dk, Dv] float32 view of ``layer_id``'s live rows, indexed by request-table row."""
        return self.buffer(layer_id)[: self.max_requests]

    def reset(self, rows: list[int]) -> None:
        """Zero the states of ``rows`` (request-table rows) in every layer; call when admitting a request."""
        rows = [int(r) for r in rows]
        bad = [r for r in rows if not 0 <= r < self.max_requests]
        if bad:
            raise IndexError(
                f"LinearStatePool.reset: got rows {bad}; expected request-table rows in [0, {self.max_requests}). "
                "Fix: pass the rows that ReqToTokenPool.alloc handed out."
            )
        if rows:
            self.states[:, torch.tensor(rows, dtype=torch.int64, device=self.device)] = 0
