"""Linear-attention layers of hybrid models: gated linear attention with a fixed per-head decay.

The layer's memory is one recurrent state per request ([H, Dk, Dv] float32 in a :class:`LinearStatePool` row,
the request's request-table row), not a KV cache, so the backend never touches ``out_cache_loc`` or the page
table. DECODE is one recurrent step per request; EXTEND is a chunked prefill per request that starts from the
row's state (zero when the request has no prefix) and writes the final state back.

``impl`` picks the math: ``"torch"`` (:mod:`backends.linear_attn_ops`, CPU and CUDA) or ``"fla"`` (fla-core's
Triton kernels ``chunk_simple_gla`` / ``fused_recurrent_simple_gla``, CUDA only). Both follow fla's convention,
documented in :mod:`backends.linear_attn_ops`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from backends import linear_attn_ops as ops
from backends.base import BackendCapabilities, CudaGraphLevel, no_workspaces
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.state_pool import LinearStatePool

IMPLS = ("torch", "fla")


class LinearAttentionBackend:
    """Gated linear attention (simple-GLA / lightning form) over a per-request recurrent state pool.

    Parameters
    ----------
    state_pool : LinearStatePool
        The states this backend reads and writes, one row per request-table row (plus a padding row).
    num_heads, head_k_dim, head_v_dim : int
        H, Dk, Dv of the layer; must match the pool. The decays are ``linear_attn_ops.decay_rates(num_heads)``
        and the scale ``head_k_dim ** -0.5``.
    impl : str
        "torch" or "fla". fla is imported here, only for "fla", and needs the pool on a CUDA device.

    Notes
    -----
    DECODE is graph-safe (no host sync, no data-dependent shapes, no host metadata): rows are read and written
    through ``batch.req_pool_indices`` on the device. The graph runner pads with the request table's padding
    row, which is ``state_pool.padding_row`` (both are ``max_requests``), so padding never touches a live
    row. EXTEND loops over requests on the host (torch) or makes one variable-length fla call;
    it is never graphed.
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        forward_modes=frozenset({ForwardMode.EXTEND, ForwardMode.DECODE}),
        cuda_graph=((ForwardMode.DECODE, CudaGraphLevel.SINGLE_TOKEN_DECODE),),
        mha_chunked_prefill=False,
        sparse=False,
        builds_own_kv_indices=True,  # it needs none: the multi-step driver may skip the shared kv-indices pass
        page_sizes=None,
        min_compute_capability=None,  # impl=torch runs anywhere; impl=fla checks for CUDA in __init__
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
        devices=frozenset({"cpu", "cuda"}),
    )
    workspace_specs = classmethod(no_workspaces)

    def __init__(
        self, state_pool: LinearStatePool, num_heads: int, head_k_dim: int, head_v_dim: int, impl: str
    ):
        problems = []
        if impl not in IMPLS:
            problems.append(f"impl: got {impl!r}; expected one of {list(IMPLS)}. Fix: set impl=torch or impl=fla")
        got = (state_pool.num_heads, state_pool.head_k_dim, state_pool.head_v_dim)
        want = (int(num_heads), int(head_k_dim), int(head_v_dim))
        if got != want:
            problems.append(
                f"state pool (H, Dk, Dv): got {got}; expected {want}. "
                "Fix: build the LinearStatePool with the layer's num_heads, head_k_dim and head_v_dim"
            )
        if impl == "fla" and state_pool.device.type != "cuda":
            problems.append(
                f"impl=fla: state pool is on {state_pool.device}; expected a CUDA device (fla-core runs Triton "
                "kernels). Fix: run on a GPU or set impl=torch"
            )
        if problems:
            raise ValueError("LinearAttentionBackend: " + "; ".join(problems) + ".")
        if impl == "fla":
            ops._import_fla()  # fails now, with the install fix, rather than at the first forward
        self.state_pool, self.impl = state_pool, impl
        self.num_heads, self.head_k_dim, self.head_v_dim = want
        self.scale = self.head_k_dim**-0.5
        self.g = ops.decay_rates(self.num_heads).to(state_pool.device)  # [H] float32
        self._step = {"torch": ops.recurrent_step, "fla": ops.fla_recurrent_step}[impl]
        self._extend = {"torch": self._extend_torch, "fla": self._extend_fla}[impl]
        self._plan: _ExtendPlan | None = None

    # -------------------------------------------------------------------------------------------- planning
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Host-side planning, once per step. EXTEND: each request's rows of q, its state row and whether it
        starts fresh (no prefix), from the host mirrors. DECODE: nothing (the step reads device tensors)."""
        if batch.mode not in self.capabilities.forward_modes:
            raise ValueError(self._mode_message(batch.mode))
        self._plan = _ExtendPlan.of(batch, self.state_pool.device) if batch.mode == ForwardMode.EXTEND else None

    # GraphHooks hooks: decode reads only device tensors of the batch, so there is no static metadata to keep.
    def init_graph_state(self, batch: ForwardBatch) -> None:
        """Nothing to allocate: decode needs no metadata beyond the batch's own static buffers."""

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Nothing to point: decode reads ``batch.req_pool_indices`` / ``batch.seq_lens`` inside the graph."""

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Nothing to refresh: the graph runner has already copied the new rows into its static buffers."""

    # --------------------------------------------------------------------------------------------- forward
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """Linear attention of the batch's new tokens.

        Parameters
        ----------
        q, k : torch.Tensor
            [T, H, Dk], packed by ``batch.qo_indptr`` (T = B for DECODE).
        v : torch.Tensor
            [T, H, Dv].
        layer_id : int
            A layer of the state pool.
        batch : ForwardBatch
            DECODE or EXTEND, planned by :meth:`init_forward_metadata` (EXTEND).

        Returns
        -------
        torch.Tensor
            o [T, H, Dv] in q's dtype. The state rows of the batch's requests are advanced past the new tokens;
            no other row changes (padding entries write only the padding row).
        """
        self._check_inputs(q, k, v, batch)
        buf = self.state_pool.buffer(layer_id)
        if batch.mode == ForwardMode.DECODE:
            return self._decode(q, k, v, buf, batch)
        if batch.mode != ForwardMode.EXTEND:
            raise ValueError(self._mode_message(batch.mode))
        if self._plan is None or self._plan.num_tokens != q.shape[0]:
            raise RuntimeError(
                f"LinearAttentionBackend.forward: EXTEND batch of {q.shape[0]} tokens has no plan "
                f"(planned: {None if self._plan is None else self._plan.num_tokens} tokens). "
                "Fix: call init_forward_metadata(batch) once per step before the layers run."
            )
        return self._extend(q, k, v, buf, self._plan)

    def _decode(self, q, k, v, buf: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        rows = batch.req_pool_indices
        state = buf.index_select(0, rows)  # [B, H, Dk, Dv] float32, a copy
        o = self._step(q, k, v, self.g, state, self.scale)
        buf.index_copy_(0, rows, state)
        return o.to(q.dtype)

    def _extend_torch(self, q, k, v, buf: torch.Tensor, plan: _ExtendPlan) -> torch.Tensor:
        out = torch.empty(q.shape[0], self.num_heads, self.head_v_dim, dtype=q.dtype, device=q.device)
        for row, s, e, fresh in plan.requests:
            init = torch.zeros_like(buf[row]) if fresh else buf[row]
            o, final = ops.chunked_prefill(q[s:e], k[s:e], v[s:e], self.g, init, self.scale)
            out[s:e] = o
            buf[row] = final
        return out

    def _extend_fla(self, q, k, v, buf: torch.Tensor, plan: _ExtendPlan) -> torch.Tensor:
        init = torch.where(plan.carried, buf.index_select(0, plan.rows), 0.0)  # fresh requests start from zero
        o, final = ops.fla_chunk_prefill_varlen(
            q, k, v, self.g, init, plan.cu_seqlens, plan.cu_seqlens_cpu, self.scale
        )
        buf.index_copy_(0, plan.rows, final)
        return o.to(q.dtype)

    def _mode_message(self, mode: ForwardMode) -> str:
        return (
            f"LinearAttentionBackend: got forward mode {mode.value}; expected one of "
            f"{sorted(m.value for m in self.capabilities.forward_modes)}. Fix: route speculative modes to a "
            "backend that declares them (capabilities.forward_modes)."
        )

    def _check_inputs(self, q, k, v, batch: ForwardBatch) -> None:
        t = batch.batch_size if batch.mode == ForwardMode.DECODE else batch.num_tokens
        h, dk, dv = self.num_heads, self.head_k_dim, self.head_v_dim
        want = {"q": (t, h, dk), "k": (t, h, dk), "v": (t, h, dv)}
        bad = [f"{n} {tuple(x.shape)} (expected {want[n]})" for n, x in (("q", q), ("k", k), ("v", v))
               if tuple(x.shape) != want[n]]
        if bad:
            raise ValueError(
                f"LinearAttentionBackend.forward ({batch.mode.value}, {t} tokens): got " + ", ".join(bad) + ". "
                "Fix: pass q, k [T, H, Dk] and v [T, H, Dv] packed by batch.qo_indptr with the backend's heads "
                "and head dims."
            )
        if q.dtype not in self.capabilities.dtypes:
            raise ValueError(
                f"LinearAttentionBackend.forward: q is {q.dtype}; expected one of "
                f"{sorted(str(d) for d in self.capabilities.dtypes)}. Fix: cast the projections."
            )


class _ExtendPlan:
    """Host plan of one EXTEND step.

    Attributes
    ----------
    requests : list of (row, start, end, fresh)
        Request-table row, rows ``start:end`` of q, and whether it starts from a zero state (prefix length 0).
    rows : torch.Tensor
        [B] int64 on the device: the state rows (``batch.req_pool_indices``).
    carried : torch.Tensor
        [B, 1, 1, 1] bool on the device: False for a fresh request, True for a continuation.
    cu_seqlens : torch.Tensor
        [B+1] int64 on the device (``batch.qo_indptr``); cu_seqlens_cpu its host mirror.
    """

    def __init__(self, requests, rows, carried, cu_seqlens, cu_seqlens_cpu, num_tokens):
        self.requests, self.rows, self.carried = requests, rows, carried
        self.cu_seqlens, self.cu_seqlens_cpu, self.num_tokens = cu_seqlens, cu_seqlens_cpu, num_tokens

    @classmethod
    def of(cls, batch: ForwardBatch, device: torch.device) -> _ExtendPlan:
        qo = batch.qo_indptr_cpu.tolist()
        rows = batch.req_pool_indices_cpu.tolist()
        fresh = (batch.prefix_lens_cpu == 0).tolist()
        requests = [(rows[b], qo[b], qo[b + 1], fresh[b]) for b in range(batch.batch_size)]
        carried = (batch.prefix_lens_cpu > 0).view(-1, 1, 1, 1).to(device)
        return cls(
            requests,
            batch.req_pool_indices.to(device=device, dtype=torch.int64),
            carried,
            batch.qo_indptr.to(device=device, dtype=torch.int64),
            batch.qo_indptr_cpu.to(torch.int64),
            batch.num_tokens,
        )
