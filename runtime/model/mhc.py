"""The torch math of manifold-constrained hyper-connections (mHC) after the mixing linear: the reference of the
fused kernels in :mod:`backends.kernels.dsv4.hc_mix`, shared by the decoder ops (:mod:`runtime.model.deepseek.ops`)
and the V4 model (:mod:`runtime.model.dsv4.hyper`, which computes ``mixed``). Only torch: both can import it.
"""

from __future__ import annotations

import torch


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] positive -> approximately doubly stochastic: a column normalisation, then ``iters - 1`` rounds
    of row then column normalisation (each divides by ``sum + eps``)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mix(mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor, iters: int,
           hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC's weights from the mixing linear's output, and the collapse of the streams.

    Parameters
    ----------
    mixed : [T, 2n + n * n] float32 (float64 for float64 streams): (pre, post, comb) logits per token.
    base : [2n + n * n], scale : [3]: the layer's biases and the three scales (cast to ``mixed``'s dtype).
    streams : [T, n, hidden].
    iters, hc_eps : Sinkhorn rounds (:func:`sinkhorn`) and the epsilon added to pre, comb and every divisor.

    Returns
    -------
    post [T, n] and comb [T, n, n] in ``mixed``'s dtype; collapsed [T, hidden] = ``sum_j pre_j * streams_j``
    computed in ``mixed``'s dtype, then cast to the streams' dtype.
    """
    t, n, _ = streams.shape
    pre_w, post_w, comb_w = mixed.split([n, n, n * n], dim=-1)
    base, scale = base.to(mixed.dtype), scale.to(mixed.dtype)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = sinkhorn(comb, iters, hc_eps)
    collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_post(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``post * block_out + comb^T @ streams``: post [T, n], comb [T, n, n], block_out [T, hidden], streams
    [T, n, hidden] -> [T, n, hidden] in streams' dtype (post and comb cast to it first, the matmul in it)."""
    dt = streams.dtype
    return post.to(dt)[..., None] * block_out[:, None, :] + torch.matmul(comb.to(dt).transpose(-1, -2), streams)
