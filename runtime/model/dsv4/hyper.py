"""Manifold-constrained hyper-connections (mHC): the residual is ``n = hc_mult`` streams [T, n, hidden].

Before a block, a one-layer perceptron over the normalized, flattened streams gives per token ``pre`` [n]
(collapse weights), ``post`` [n] (expansion weights) and ``comb`` [n, n], projected towards a doubly-stochastic
matrix by Sinkhorn-Knopp (softmax over rows, then alternately column / row normalisation). After the block:
``streams' = post * out + comb^T @ streams``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.dsv4.norms import compute_dtype, unweighted_rms_norm
from runtime.model.dsv4.weights import HyperConnectionWeights, HyperHeadWeights


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] positive -> approximately doubly stochastic: a column normalisation, then ``iters - 1`` rounds
    of row then column normalisation (each divides by ``sum + eps``)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre(w: HyperConnectionWeights, streams: torch.Tensor, iters: int, hc_eps: float, norm_eps: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, hidden] -> (post [T, n], comb [T, n, n] in at least float32, collapsed [T, hidden] in
    streams' dtype)."""
    t, n, _ = streams.shape
    cd = compute_dtype(streams)
    flat = unweighted_rms_norm(streams.reshape(t, -1).to(cd), norm_eps)
    mixed = F.linear(flat, w.fn.to(cd))
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    base, scale = w.base.to(cd), w.scale.to(cd)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = sinkhorn(comb, iters, hc_eps)
    collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_post(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``post * block_out + comb^T @ streams``: post [T, n], comb [T, n, n], block_out [T, hidden], streams
    [T, n, hidden] -> [T, n, hidden] in streams' dtype."""
    dt = streams.dtype
    return post.to(dt)[..., None] * block_out[:, None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


def hc_head(w: HyperHeadWeights, streams: torch.Tensor, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams [T, n, hidden] -> [T, hidden] (sigmoid weights, no Sinkhorn)."""
    cd = compute_dtype(streams)
    flat = unweighted_rms_norm(streams.flatten(1).to(cd), norm_eps)
    pre = torch.sigmoid(F.linear(flat, w.hc_fn.to(cd)) * w.hc_scale.to(cd) + w.hc_base.to(cd)) + hc_eps
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
