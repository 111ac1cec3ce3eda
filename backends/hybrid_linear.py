"""The hybrid wrapper: routes full-attention layers to one backend and linear-attention layers to another.

Everything it forwards it received in its constructor, as typed objects: the full backend, the linear
backend, the full-attention layer ids, and each hook implementation (``MHAChunkPrefill``, ``GraphHooks``)
or None. No ``hasattr``/``getattr``/``isinstance`` decides anything: a hook object that does not match its
Protocol is refused here, at construction, naming the backend and the hook; every hook takes the batch.
"""

from __future__ import annotations

import torch

from backends.base import AttentionBackend, GraphHooks, MHAChunkPrefill, hook_signature_problems
from runtime.core.batch import ForwardBatch
from runtime.core.errors import HookMismatch


def _checked(hook, protocol: type, owner: str):
    if hook is None:
        return None
    problems = hook_signature_problems(type(hook), protocol)
    if problems:
        raise HookMismatch(
            f"hybrid_linear: the {protocol.__name__} hook of full backend '{owner}' does not match its Protocol: "
            + "; ".join(problems)
            + f". Fix: implement {protocol.__name__} as backends/base.py declares it (one argument, the batch, "
            "for planning hooks), or drop the capability from the backend's capabilities."
        )
    return hook


class HybridLinearBackend:
    """One attention object for a model whose layers are full MLA or linear attention.

    Parameters
    ----------
    full : AttentionBackend
        Serves ``forward_decode`` / ``forward_extend`` of the full (MLA) layers.
    linear : object with ``init_forward_metadata(batch)`` and ``forward(q, k, v, layer_id, batch)``
        The linear-attention backend (backends/linear_attention.py).
    full_layer_ids : list of int
    mha_prefill : MHAChunkPrefill or None
        The full backend's MHA chunked-prefill hook (None: prefill takes the absorbed path).
    decode_graph : GraphHooks or None
        The full backend's decode-graph hooks (None: decode is not graphed).
    full_name : str
        For error messages.
    """

    def __init__(self, full: AttentionBackend, linear, full_layer_ids: list[int],
                 mha_prefill: MHAChunkPrefill | None, decode_graph: GraphHooks | None, full_name: str):
        self.full, self.linear = full, linear
        self.full_layer_ids = frozenset(full_layer_ids)
        self.mha = _checked(mha_prefill, MHAChunkPrefill, full_name)
        self.graph = _checked(decode_graph, GraphHooks, full_name)

    # --------------------------------------------------------------------- AttentionBackend
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.full.init_forward_metadata(batch)
        self.linear.init_forward_metadata(batch)

    def forward_decode(self, q_nope, q_pe, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        return self.full.forward_decode(q_nope, q_pe, layer_id, batch)

    def forward_extend(self, q_nope, q_pe, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        return self.full.forward_extend(q_nope, q_pe, layer_id, batch)

    def forward_linear(self, q, k, v, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        return self.linear.forward(q, k, v, layer_id, batch)

    # ------------------------------------------------------------------------ MHAChunkPrefill
    def init_mha_chunk_metadata(self, batch: ForwardBatch) -> None:
        self.mha.init_mha_chunk_metadata(batch)

    def forward_mha_extend(self, q, k, v, layer_id, batch):
        return self.mha.forward_mha_extend(q, k, v, layer_id, batch)

    def forward_mha_prefix_chunk(self, q, k, v, chunk, layer_id, batch):
        return self.mha.forward_mha_prefix_chunk(q, k, v, chunk, layer_id, batch)

    def merge_states(self, out_a, lse_a, out_b, lse_b):
        return self.mha.merge_states(out_a, lse_a, out_b, lse_b)

    # ---------------------------------------------------------------------------- GraphHooks
    def init_graph_state(self, batch: ForwardBatch) -> None:
        self.graph.init_graph_state(batch)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.graph.init_forward_metadata_capture(batch)
        self.linear.init_forward_metadata(batch)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.graph.init_forward_metadata_replay(batch)
        self.linear.init_forward_metadata(batch)
