"""DeepSeek-V4's MoE router and the shared expert's clamped SwiGLU: the fused kernels (``FusedOps.v4_route`` /
``v4_swiglu``, backends/kernels/decoder) against the torch reference (``TorchOps``: runtime/model/dsv4/moe.py's
``route`` / ``swiglu``).

On the CPU the kernels run in Triton's interpreter on float32 (the SwiGLU also float16) at V4-Flash's 256 experts
with top-6 and at a small odd E; the ``gpu`` tests run them compiled in bfloat16 at V4-Flash widths (x [T, 4096],
gate [256, 4096], shared intermediate 2048), eagerly and replayed from a CUDA graph. Routings are compared per
expert id (each row sorted by id: the kernel's top-k order is descending, torch's unsorted order unspecified).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEV, capture_graph, needs_gpu, rel_err

from runtime.model.deepseek import routing
from runtime.model.deepseek.ops import FusedOps, TorchOps
from runtime.model.deepseek.routing import ScoringFunc
from runtime.model.dsv4.moe import v4_router

REF, FUSED = TorchOps(), FusedOps()
SCORES = [s.value for s in ScoringFunc]
VOCAB = 50


def _close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = rel_err(a, b)  # a NaN fails there
    assert err <= tol, f"relative error {err:.3e} > {tol}"


def _cfg(scoring, k, scale=1.5):
    """The config fields V4's router reads."""
    return SimpleNamespace(scoring_func=ScoringFunc(scoring), num_experts_per_tok=k, routed_scaling_factor=scale)


def _router_weights(e, d, k, mode, dtype, dev, seed):
    """gate [E, d] (+ bias [E] for mode "bias", tid2eid [VOCAB, k] for "hash": row 3 names an expert twice)."""
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(e, d, generator=g) * 2 / d**0.5).to(dtype).to(dev)
    bias = (torch.randn(e, generator=g) * 0.1).to(dtype).to(dev) if mode == "bias" else None
    tid2eid = None
    if mode == "hash":
        tid2eid = torch.randint(0, e, (VOCAB, k), generator=g)
        tid2eid[3, 1] = tid2eid[3, 0]
        tid2eid = tid2eid.to(dev)
    return SimpleNamespace(gate=gate, e_score_correction_bias=bias, tid2eid=tid2eid)


def _by_id(ids, w):
    order = ids.argsort(dim=1, stable=True)
    return ids.gather(1, order), w.gather(1, order)


def check_route(scoring, e, k, mode, t, d, dtype, dev, tol, seed=0):
    """FusedOps.v4_route against TorchOps.v4_route on the same inputs: the same expert ids per token, weights in
    x's dtype within ``tol``."""
    cfg, w = _cfg(scoring, k), _router_weights(e, d, k, mode, dtype, dev, seed)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(dev)
    input_ids = torch.tensor([3, 7, 0, 49, 3, 11, 20][:t], device=dev) if mode == "hash" else None
    ids_r, w_r = REF.v4_route(w, x, input_ids, cfg)
    ids_f, w_f = FUSED.v4_route(w, x, input_ids, cfg)
    assert ids_f.dtype == torch.int64 and w_f.dtype == w_r.dtype == dtype and ids_f.shape == (t, k)
    (a_ids, a_w), (b_ids, b_w) = _by_id(ids_f, w_f), _by_id(ids_r, w_r)
    assert torch.equal(a_ids, b_ids), "expert ids differ from the torch routing"
    _close(a_w, b_w, tol)


# ---------------------------------------------------------------------------------------- CPU (interpreter)
# every scoring with bias, without and hashed; each of them at V4-Flash's E = 256 / k = 6 and at an odd E, and at
# T = 1 and 7 (a covering set, not the full product: the interpreter takes ~45 ms a token)
SMALL = [("sqrtsoftplus", 256, 6, "bias", 7), ("sqrtsoftplus", 37, 3, "none", 1), ("sqrtsoftplus", 256, 6, "hash", 1),
         ("softmax", 37, 3, "bias", 1), ("softmax", 256, 6, "none", 7), ("softmax", 37, 3, "hash", 7),
         ("sigmoid", 256, 6, "bias", 1), ("sigmoid", 37, 3, "none", 7), ("sigmoid", 37, 3, "hash", 1)]


@pytest.mark.parametrize("scoring,e,k,mode,t", SMALL)
def test_v4_route_small(scoring, e, k, mode, t):
    check_route(scoring, e, k, mode, t, 24, torch.float32, DEV, 1e-5, seed=t)


def test_v4_route_ties_pick_the_lower_expert_id_and_torch_serves_the_rest():
    """Equal choices: the lowest ids, largest choice first. Float64 (no kernel) and a hash layer without token ids
    take the torch path: its bits, its error."""
    cfg = _cfg("sigmoid", 3, scale=2.0)
    bias = torch.zeros(37, device=DEV)
    bias[[5, 9, 30]] = 0.25
    w = SimpleNamespace(gate=torch.zeros(37, 8, device=DEV), e_score_correction_bias=bias, tid2eid=None)
    ids, wts = FUSED.v4_route(w, torch.randn(2, 8, device=DEV), None, cfg)
    assert ids.tolist() == [[5, 9, 30]] * 2
    assert torch.equal(wts, torch.full((2, 3), 2.0 / 3.0, device=DEV))
    w.e_score_correction_bias = None
    assert FUSED.v4_route(w, torch.randn(1, 8, device=DEV), None, cfg)[0].tolist() == [[0, 1, 2]]
    w64 = _router_weights(37, 8, 3, "bias", torch.float64, DEV, 0)
    x64 = torch.randn(4, 8, dtype=torch.float64, device=DEV)
    for got, want in zip(FUSED.v4_route(w64, x64, None, cfg), REF.v4_route(w64, x64, None, cfg)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="input_ids=None"):
        FUSED.v4_route(_router_weights(37, 8, 3, "hash", torch.float32, DEV, 0), x64.float(), None, cfg)


def check_swiglu(t, inter, dtype, dev, tol, limit=1.5):
    """Gate and up as the two halves of one strided buffer (and up as a tensor of its own), values past the
    clamps on both sides."""
    h = torch.randn(t, 2 * inter + 4, device=dev) * 3
    h[:, 0], h[:, inter], h[:, inter + 1] = 2 * limit, -2 * limit, 2 * limit
    h = h.to(dtype)
    gate, up = h[:, :inter], h[:, inter : 2 * inter]
    _close(FUSED.v4_swiglu(gate, up, limit), REF.v4_swiglu(gate, up, limit), tol)
    up = up.contiguous()
    _close(FUSED.v4_swiglu(gate, up, limit), REF.v4_swiglu(gate, up, limit), tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_v4_swiglu_small(dtype, tol):
    check_swiglu(3, 37, dtype, DEV, tol)
    check_swiglu(1, 5, dtype, DEV, tol)


# ---------------------------------------------------------------------------------------- GPU, real sizes
BF = torch.bfloat16


def _same_routing(ids_f, w_f, ids_r, w_r, choice, tol):
    """Rows whose chosen id sets agree: weights per id within ``tol``; rows that differ may only do so by equal
    choices at the k-th place (a bf16 tie, which torch's order leaves unspecified), and are few."""
    (a_ids, a_w), (b_ids, b_w) = _by_id(ids_f, w_f), _by_id(ids_r, w_r)
    same = (a_ids == b_ids).all(dim=1)
    cf, cr = choice.gather(1, ids_f).sort(dim=1).values, choice.gather(1, ids_r).sort(dim=1).values
    assert torch.equal(cf[~same], cr[~same]), "the chosen experts differ by more than a tie"
    assert same.numel() < 8 or same.float().mean() >= 0.5
    _close(a_w[same].float(), b_w[same].float(), tol)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64])
def test_v4_route_kernel_matches_torch_gpu(t):
    """The kernel on the torch product's bf16 logits (V4-Flash: 256 experts, top-6) against the shared routing:
    each scoring, with bias, without, and hash routing."""
    needs_gpu()
    from backends.kernels.decoder import decoder_ops

    e, d, k = 256, 4096, 6
    torch.manual_seed(t)
    for scoring in SCORES:
        for mode in ("bias", "none", "hash"):
            w = _router_weights(e, d, k, mode, BF, "cuda", seed=t)
            x = torch.randn(t, d, device="cuda").to(BF)
            input_ids = torch.randint(0, VOCAB, (t,), device="cuda") if mode == "hash" else None
            logits = F.linear(x, w.gate)
            r = v4_router(_cfg(scoring, k))
            w_r, ids_r = routing.route(r, logits, w.e_score_correction_bias, w.tid2eid, input_ids)
            w_f, ids_f = decoder_ops.v4_route(logits, scoring, w.e_score_correction_bias, w.tid2eid, input_ids, k,
                                              r.norm_eps, r.routed_scaling_factor)
            assert w_f.dtype == BF
            if mode == "hash":
                assert torch.equal(ids_f, ids_r)
            scores = routing.router_scores(logits, r.scoring)
            choice = scores if w.e_score_correction_bias is None else scores + w.e_score_correction_bias
            _same_routing(ids_f, w_f, ids_r, w_r, choice, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64])
def test_v4_route_and_swiglu_ops_gpu(t):
    """FusedOps.v4_route (the few-row product at t <= 16, then the kernel) against the shared routing on the
    FusedOps product's logits, and the clamped SwiGLU at the shared expert's width (2048) and an odd one."""
    needs_gpu()
    e, d, k = 256, 4096, 6
    torch.manual_seed(100 + t)
    for mode in ("bias", "hash"):
        cfg, w = _cfg("sqrtsoftplus", k), _router_weights(e, d, k, mode, BF, "cuda", seed=t)
        x = torch.randn(t, d, device="cuda").to(BF)
        input_ids = torch.randint(0, VOCAB, (t,), device="cuda") if mode == "hash" else None
        ids_f, w_f = FUSED.v4_route(w, x, input_ids, cfg)
        logits = FUSED.linear(x, w.gate)
        w_r, ids_r = routing.route(v4_router(cfg), logits, w.e_score_correction_bias, w.tid2eid, input_ids)
        choice = routing.router_scores(logits, ScoringFunc.sqrtsoftplus)
        _same_routing(ids_f, w_f, ids_r, w_r, choice if mode == "hash" else choice + w.e_score_correction_bias,
                      1e-2)
    check_swiglu(t, 2048, BF, "cuda", 1e-2, limit=10.0 / 4)
    check_swiglu(t, 1001, BF, "cuda", 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bias", "hash"])
def test_v4_route_and_swiglu_in_a_cuda_graph(mode):
    """The router's product, the routing kernel and the clamped SwiGLU captured once (8 tokens) and replayed on new
    hidden states / token ids: the eager bits."""
    needs_gpu()
    e, d, k, t, inter = 256, 4096, 6, 8, 2048
    cfg, w = _cfg("sqrtsoftplus", k), _router_weights(e, d, k, mode, BF, "cuda", seed=5)
    x = torch.empty(t, d, device="cuda", dtype=BF)
    gate_up = torch.empty(t, 2 * inter, device="cuda", dtype=BF)
    input_ids = torch.zeros(t, dtype=torch.int64, device="cuda")

    def step():
        ids, wts = FUSED.v4_route(w, x, input_ids if mode == "hash" else None, cfg)
        return {"ids": ids, "w": wts, "h": FUSED.v4_swiglu(gate_up[:, :inter], gate_up[:, inter:], 10.0)}

    captured = {}
    graph = capture_graph(lambda: captured.update(step()))
    for seed in range(3):
        torch.manual_seed(seed)
        x.copy_(torch.randn(t, d, device="cuda"))
        gate_up.copy_(torch.randn(t, 2 * inter, device="cuda") * 8)
        input_ids.copy_(torch.randint(0, VOCAB, (t,), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for name, v in eager.items():
            assert torch.equal(captured[name], v), name
