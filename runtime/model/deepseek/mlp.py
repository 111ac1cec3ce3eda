"""The dense SwiGLU MLP of DeepSeek's first layers (and of the MoE's shared experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.deepseek.weights import DenseMLPWeights
from runtime.model.quantized import linear


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """[N, 2 * I] (gate, then up) -> silu(gate) * up [N, I]."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def dense_mlp(w: DenseMLPWeights, x: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> down(silu(gate x) * up x) [T, D], in x's dtype (float or block-fp8 weights: torch ops)."""
    return linear(swiglu(linear(x, w.gate_up)), w.down)
