"""The DeepSeek-V3.2 lightning indexer of a sparse layer: its weights, its projections, and its key cache.

Per query token the indexer scores every previous token ``j`` as ``sum_h w_h * relu(q_h . k_j) / sqrt(Di)``
with ``w = weights_proj(x) / sqrt(Hi)`` (the top-k itself is a kernel: ``backends/kernels/sparse/indexer.py``), as the
reference (transformers' DeepseekV32Indexer) does:

* q: ``wq_b`` of the query latent (the normed q LoRA output) -> [Hi, Di];
* k: ``wk`` of the normed hidden state, then ``k_norm``, a LayerNorm with bias (eps 1e-6) -> [Di];
* RoPE, half-split (not interleaved, unlike the MLA rope dims), on the *first* ``qk_rope_head_dim`` dims of q
  and k; the rest passes through;
* ``weights_proj`` runs in float32.

(The reference's Hadamard rotation and fp8 scoring are precision devices: the rotation is orthogonal, so dot
products are unchanged.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.model.deepseek.rope import apply_rope_half
from runtime.model.quantized import Weight, linear, weight_tensors

K_NORM_EPS = 1e-6


@dataclass
class IndexerWeights:
    wq_b: Weight  # [Hi * Di, q_lora] (block-fp8 when stored)
    wk: Weight  # [Di, hidden] (block-fp8 when stored)
    k_norm_weight: torch.Tensor  # [Di]
    k_norm_bias: torch.Tensor  # [Di]
    weights_proj: torch.Tensor  # [Hi, hidden] float32

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [*weight_tensors(self.wq_b), *weight_tensors(self.wk), self.k_norm_weight, self.k_norm_bias,
                self.weights_proj]


def indexer_projections(
    iw: IndexerWeights, spec, xn: torch.Tensor, q_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    project=linear,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indexer queries, keys and head weights of a step's new tokens.

    Parameters
    ----------
    xn : [T, hidden] normed hidden states (model dtype); q_in : [T, q_lora] the normed query latent
    cos, sin : [T, qk_rope_head_dim / 2] float32 RoPE tables at the tokens' positions
    project : (x [T, K], weight) -> [T, N], the products with ``wq_b`` / ``wk`` (the decoder ops' ``linear``:
        block-fp8 kernels for stored weights; torch by default)

    Returns
    -------
    q : [T, Hi, Di] model dtype; k : [T, Di] model dtype
    weights : [T, Hi] float32, ``weights_proj(x) * Hi^-1/2 * Di^-1/2`` (the score's scale folded in:
        relu(s * x) = s * relu(x) for s > 0)
    """
    t, hi, di, r = xn.shape[0], spec.index_n_heads, spec.index_head_dim, spec.qk_rope_head_dim
    q = project(q_in, iw.wq_b).view(t, hi, di)
    q = torch.cat([apply_rope_half(q[..., :r], cos, sin), q[..., r:]], dim=-1)
    k = F.layer_norm(project(xn, iw.wk), (di,), iw.k_norm_weight, iw.k_norm_bias, K_NORM_EPS)
    k = torch.cat([apply_rope_half(k[:, :r], cos, sin), k[:, r:]], dim=-1)
    weights = F.linear(xn.to(iw.weights_proj.dtype), iw.weights_proj).float() * (hi**-0.5 * di**-0.5)
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
