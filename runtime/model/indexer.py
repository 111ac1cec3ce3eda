"""The DeepSeek-V3.2 indexer of a sparse layer: its weights, its projections, and its key cache.

Per query token the indexer scores every previous token ``j`` as ``sum_h w_h * relu(q_h . k_j)`` (the top-k
itself is a kernel: ``backends/kernels/indexer.py``). Here:

* :class:`IndexerWeights` / :func:`make_indexer_weights`: a q projection from the query latent (``wq_b``-like,
  Hi x Di), a key projection from the normed hidden state with an RMSNorm, and per-head weights w_h from the
  hidden state; RoPE on the first ``qk_rope_head_dim`` dims of q and k.
* :func:`indexer_projections`: hidden states -> (q [T, Hi, Di], k [T, Di], w [T, Hi] float32).
* :class:`IndexKeyPool`: the per-layer key cache [S, Di], one key per token slot (the device KV slot, or with
  HiSparse the host slot, so keys outlive the device pages a request prefilled in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.model.layers import apply_rope, rms_norm


@dataclass
class IndexerWeights:
    wq: torch.Tensor  # [q_in, Hi * Di]   (q_in = q_lora_rank or hidden)
    wk: torch.Tensor  # [hidden, Di]
    k_norm: torch.Tensor  # [Di]
    w_heads: torch.Tensor  # [hidden, Hi]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.wq, self.wk, self.k_norm, self.w_heads]


def make_indexer_weights(spec, w: Callable[..., torch.Tensor], ones: Callable[[int], torch.Tensor]) -> IndexerWeights:
    """Seeded weights of one sparse layer's indexer. ``w(*shape, fan_in=)`` and ``ones(n)`` are the model's
    initializers (same generator, so the weights are a function of ``model.weight_seed``)."""
    q_in, d = spec.q_lora_rank or spec.hidden_size, spec.hidden_size
    hi, di = spec.index_n_heads, spec.index_head_dim
    return IndexerWeights(wq=w(q_in, hi * di, fan_in=q_in), wk=w(d, di, fan_in=d), k_norm=ones(di),
                          w_heads=w(d, hi, fan_in=d))


def indexer_projections(
    iw: IndexerWeights, spec, xn: torch.Tensor, q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indexer queries, keys and head weights of a step's new tokens.

    Parameters
    ----------
    xn : [T, hidden] normed hidden states (model dtype); q_in : [T, q_lora or hidden] the query latent
    cos, sin : [T, qk_rope_head_dim / 2] float32 RoPE tables at the tokens' positions

    Returns
    -------
    q : [T, Hi, Di] model dtype; k : [T, Di] model dtype
    weights : [T, Hi] float32, scaled by Hi^-1/2 * Di^-1/2 (the score's softmax-style scale folded in)
    """
    t, hi, di, r = xn.shape[0], spec.index_n_heads, spec.index_head_dim, spec.qk_rope_head_dim
    q = (q_in @ iw.wq).view(t, hi, di)
    q = torch.cat([apply_rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)
    k = rms_norm(xn @ iw.wk, iw.k_norm, spec.rms_norm_eps)
    k = torch.cat([apply_rope(k[:, :r], cos, sin), k[:, r:]], dim=-1)
    weights = (xn @ iw.w_heads).float() * (hi**-0.5 * di**-0.5)
    return q.contiguous(), k.contiguous(), weights.contiguous()


class IndexKeyPool:
    """Indexer keys of every sparse layer, one row per token slot.

    Parameters
    ----------
    layer_ids : list of int
        The sparse layers.
    num_slots : int
        Rows per layer: the slot space the keys are addressed by (device KV slots; with HiSparse, host slots).
    head_dim : int
    dtype : torch.dtype
    device : torch.device

    Attributes
    ----------
    buffers : list of torch.Tensor
        Per sparse layer, [num_slots, head_dim] in ``dtype``; slot 0 (the padding page) is never a real token.
    """

    def __init__(self, layer_ids: list[int], num_slots: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self._index = {layer: i for i, layer in enumerate(layer_ids)}
        self.buffers = [torch.zeros(num_slots, head_dim, dtype=dtype, device=device) for _ in layer_ids]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def buffer(self, layer_id: int) -> torch.Tensor:
        """[num_slots, head_dim] keys of sparse layer ``layer_id``."""
        return self.buffers[self._index[layer_id]]

    def write(self, layer_id: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """slots [T] int64 (device); keys [T, head_dim]."""
        buf = self.buffer(layer_id)
        buf[slots] = keys.to(buf.dtype)
