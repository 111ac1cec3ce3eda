"""Manifold-constrained hyper-connections (mHC): the residual is ``n = hc_mult`` streams [T, n, hidden].

Before a block, a one-layer perceptron over the normalized, flattened streams gives per token ``pre`` [n]
(collapse weights), ``post`` [n] (expansion weights) and ``comb`` [n, n], projected towards a doubly-stochastic
matrix by Sinkhorn-Knopp (softmax over rows, then alternately column / row normalisation). After the block:
``streams' = post * out + comb^T @ streams``.

The math after the mixing linear (:func:`runtime.model.mhc.hc_mix`, :func:`runtime.model.mhc.hc_post`) lives in
:mod:`runtime.model.mhc`, which the decoder ops share (their fused Triton kernels replace it on CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from runtime.model.dsv4.norms import compute_dtype, unweighted_rms_norm
from runtime.model.dsv4.weights import HyperConnectionWeights, HyperHeadWeights
from runtime.model.mhc import hc_mix


def _unweighted(x: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    return unweighted_rms_norm(x.to(out_dtype), eps)


def hc_mixed(w: HyperConnectionWeights, streams: torch.Tensor, norm_eps: float,
             norm: Callable[[torch.Tensor, float, torch.dtype], torch.Tensor] = _unweighted) -> torch.Tensor:
    """The mixing linear: streams [T, n, hidden] -> unweighted-RMS-normed, flattened, times ``w.fn``:
    [T, 2n + n * n] in at least float32 (the input of :func:`runtime.model.mhc.hc_mix` and ``ops.hc_mix``).
    ``norm(x, eps, dtype)``: the unweighted norm of ``x.to(dtype)`` (torch's, or the decoder ops' one launch)."""
    cd = compute_dtype(streams)
    flat = norm(streams.reshape(streams.shape[0], -1), norm_eps, cd)
    return F.linear(flat, w.fn.to(cd))


def hc_pre(w: HyperConnectionWeights, streams: torch.Tensor, iters: int, hc_eps: float, norm_eps: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, hidden] -> (post [T, n], comb [T, n, n] in at least float32, collapsed [T, hidden] in
    streams' dtype), all in torch (the decoder layer runs :func:`hc_mixed` then its ops' ``hc_mix``)."""
    return hc_mix(hc_mixed(w, streams, norm_eps), w.base, w.scale, streams, iters, hc_eps)


def hc_head(w: HyperHeadWeights, streams: torch.Tensor, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Final collapse of the streams [T, n, hidden] -> [T, hidden] (sigmoid weights, no Sinkhorn)."""
    cd = compute_dtype(streams)
    flat = unweighted_rms_norm(streams.flatten(1).to(cd), norm_eps)
    pre = torch.sigmoid(F.linear(flat, w.hc_fn.to(cd)) * w.hc_scale.to(cd) + w.hc_base.to(cd)) + hc_eps
    return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
