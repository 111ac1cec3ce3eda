"""Triton MLA kernels at real sizes on the GPU (``gpu``-marked; the CPU-interpretable cases are in
test_triton_kernels.py): variable lengths, the backend's workspace, CUDA-graph replay, extend.

On a machine without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest.py before
the kernels are imported) on small sizes. On a CUDA machine the same small cases run compiled on the GPU,
and the ``gpu``-marked tests add real sizes and CUDA-graph capture.
"""

import math

import pytest
import torch
from triton_env import DEV, INTERPRETED, TOL, capture_graph, replays_equal_eager  # noqa: F401  (skips the module without Triton)
from triton_env import needs_gpu as _needs_gpu

from backends.kernels.mla_decode.mla_decode import decode_work_ints, decode_workspace_shapes, mla_decode
from backends.kernels.mla_extend.mla_extend import mla_extend

D_CKV, D_PE = 512, 64


# ---------------------------------------------------------------------------------------- real sizes (GPU)
def _gpu_problem(lens, H, page_size, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    B = len(lens)
    pages_per = [math.ceil(L / page_size) for L in lens]
    total = sum(pages_per) + 8
    kv = torch.randn(total, page_size, D_CKV + D_PE, device="cuda", generator=g).to(dtype)
    perm = torch.randperm(total, device="cuda", generator=g).to(torch.int32)
    pt = torch.zeros(B, max(pages_per), dtype=torch.int32, device="cuda")
    pos = 0
    for b, n in enumerate(pages_per):
        pt[b, :n] = perm[pos : pos + n]
        pos += n
    return kv, pt


def _gpu_ref_decode(q_nope, q_pe, kv, pt, lens, scale):
    page_size = kv.shape[1]
    out = torch.empty(q_nope.shape, dtype=torch.float32, device="cuda")
    for b, L in enumerate(lens):
        t = torch.arange(L, device="cuda")
        rows = kv[pt[b, t // page_size].long(), t % page_size].float()
        s = (q_nope[b].float() @ rows[:, :D_CKV].T + q_pe[b].float() @ rows[:, D_CKV:].T) * scale
        out[b] = torch.softmax(s, dim=-1) @ rows[:, :D_CKV]
    return out


def _gpu_rel(out, ref):
    assert not torch.isnan(out).any()
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("H,use_tma", [(16, False), (128, False), (128, True)])
def test_gpu_decode_real_sizes(H, use_tma):
    _needs_gpu()
    lens = [8192, 1, 4097, 64, 2000, 7000, 513, 8000]
    dtype = torch.bfloat16
    kv, pt = _gpu_problem(lens, H, 64, dtype, seed=H)
    g = torch.Generator(device="cuda").manual_seed(1)
    B = len(lens)
    q_nope = torch.randn(B, H, D_CKV, device="cuda", generator=g).to(dtype)
    q_pe = torch.randn(B, H, D_PE, device="cuda", generator=g).to(dtype)
    scale = 1.0 / math.sqrt(192)
    po, pl, work = decode_workspace_shapes(B, H, 8).allocate("cuda")
    out = torch.full((B, H, D_CKV), float("nan"), dtype=dtype, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    mla_decode(q_nope, q_pe, kv, pt, sl, scale, out, po, pl, work, max_splits=8, use_tma=use_tma, use_wgmma=False)
    assert _gpu_rel(out, _gpu_ref_decode(q_nope, q_pe, kv, pt, lens, scale)) < 2e-2


def _backend_workspace(B, H, max_splits=64, split_slots=2048):
    """The backend's view of its workspace: [B, H, S, 512] / [B, H, S] with S = min(max_splits, slots // B), and the
    decode plan space at its end."""
    S = max(1, min(max_splits, split_slots // B))
    n_work = decode_work_ints(split_slots, H, split_slots)
    ws = torch.full((split_slots * H * (D_CKV + 1) + n_work,), float("nan"), device="cuda")
    n = B * H * S * D_CKV
    work = ws.view(torch.int32)[-n_work:]
    return ws[:n].view(B, H, S, D_CKV), ws[n : n + B * H * S].view(B, H, S), work, S


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(use_tma=True, use_wgmma=False),
        dict(max_regs=128, target_programs=1000, use_wgmma=False),
        dict(block_n=32, num_warps=8, num_stages=3, max_regs=128),
    ],
)
def test_gpu_decode_variable_lengths_backend_workspace(kw):
    # 128 requests ~ N(2048, 1024) (some empty, some tiny) with the backend's exact workspace view; the last
    # page of every request has NaN rows past its length (never written in a real pool).
    _needs_gpu()
    H, dtype, B, page = 16, torch.bfloat16, 128, 64
    g = torch.Generator().manual_seed(21)
    lens = torch.normal(2048.0, 1024.0, (B,), generator=g).round().clamp(1, 4096).int().tolist()
    lens[3], lens[50], lens[51] = 0, 1, 4096
    kv, pt = _gpu_problem(lens, H, page, dtype, seed=21)
    for b, L in enumerate(lens):
        if L % page:
            kv[pt[b, L // page].long(), L % page :] = float("nan")
    gq = torch.Generator(device="cuda").manual_seed(22)
    q_nope = torch.randn(B, H, D_CKV, device="cuda", generator=gq).to(dtype)
    q_pe = torch.randn(B, H, D_PE, device="cuda", generator=gq).to(dtype)
    scale = 1.0 / math.sqrt(192)
    po, pl, work, S = _backend_workspace(B, H)
    out = torch.full((B, H, D_CKV), float("nan"), dtype=dtype, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    mla_decode(q_nope, q_pe, kv, pt, sl, scale, out, po, pl, work, max_splits=S, min_tokens_per_split=256, **kw)
    assert (out[3] == 0).all()
    assert _gpu_rel(out, _gpu_ref_decode(q_nope, q_pe, kv, pt, lens, scale)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("max_splits", [64, 2048])
def test_gpu_decode_batch_of_one_long(max_splits):
    _needs_gpu()
    H, dtype, lens = 16, torch.bfloat16, [32768]
    kv, pt = _gpu_problem(lens, H, 64, dtype, seed=31)
    gq = torch.Generator(device="cuda").manual_seed(32)
    q_nope = torch.randn(1, H, D_CKV, device="cuda", generator=gq).to(dtype)
    q_pe = torch.randn(1, H, D_PE, device="cuda", generator=gq).to(dtype)
    po, pl, work, S = _backend_workspace(1, H, max_splits=max_splits)
    out = torch.full((1, H, D_CKV), float("nan"), dtype=dtype, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    mla_decode(q_nope, q_pe, kv, pt, sl, 0.07, out, po, pl, work, max_splits=S, min_tokens_per_split=64)
    assert _gpu_rel(out, _gpu_ref_decode(q_nope, q_pe, kv, pt, lens, 0.07)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_decode_cuda_graph_replay_matches_eager(pdl):
    """The graph (with programmatic dependent launch where asked: both stages) gives the plain eager launch's
    bits, also when replayed with other lengths."""
    _needs_gpu()
    H, dtype, B = 16, torch.bfloat16, 6
    lens_a = [4096, 17, 1, 2048, 333, 8192]
    lens_b = [5, 8192, 700, 1, 64, 3000]  # replayed with other lengths: splits re-planned on the device
    kv, pt = _gpu_problem([max(a, b) for a, b in zip(lens_a, lens_b)], H, 64, dtype, seed=3)
    g = torch.Generator(device="cuda").manual_seed(2)
    q_nope = torch.randn(B, H, D_CKV, device="cuda", generator=g).to(dtype)
    q_pe = torch.randn(B, H, D_PE, device="cuda", generator=g).to(dtype)
    scale = 0.1
    po, pl, work = decode_workspace_shapes(B, H, 8).allocate("cuda")
    out = torch.empty(B, H, D_CKV, dtype=dtype, device="cuda")
    sl = torch.tensor(lens_a, dtype=torch.int32, device="cuda")

    def step(pdl=False):  # the Triton stage 1 (the wgmma one has its own graph test)
        mla_decode(q_nope, q_pe, kv, pt, sl, scale, out, po, pl, work, max_splits=8, pdl=pdl, use_wgmma=False)

    step(pdl)  # compile outside capture
    graph = capture_graph(lambda: step(pdl))
    for lens in replays_equal_eager(graph, step, out, sl, (lens_a, lens_b)):
        assert _gpu_rel(out, _gpu_ref_decode(q_nope, q_pe, kv, pt, lens, scale)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 128])
def test_gpu_extend_real_sizes(H):
    _needs_gpu()
    dtype = torch.bfloat16
    q_lens, kv_lens = [1024, 1, 300, 77], [3072, 4000, 300, 8192]
    kv, pt = _gpu_problem(kv_lens, H, 64, dtype, seed=5)
    g = torch.Generator(device="cuda").manual_seed(6)
    T = sum(q_lens)
    q_nope = torch.randn(T, H, D_CKV, device="cuda", generator=g).to(dtype)
    q_pe = torch.randn(T, H, D_PE, device="cuda", generator=g).to(dtype)
    scale = 1.0 / math.sqrt(192)
    indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out = torch.full((T, H, D_CKV), float("nan"), dtype=dtype, device="cuda")
    mla_extend(
        q_nope,
        q_pe,
        kv,
        pt,
        indptr,
        torch.tensor(kv_lens, dtype=torch.int32, device="cuda"),
        scale,
        out,
        max_q_len=max(q_lens),
    )
    ref = torch.empty(T, H, D_CKV, device="cuda")
    q0 = 0
    for b, (n, L) in enumerate(zip(q_lens, kv_lens)):
        t = torch.arange(L, device="cuda")
        rows = kv[pt[b, t // 64].long(), t % 64].float()
        s = (
            torch.einsum("nhc,lc->nhl", q_nope[q0 : q0 + n].float(), rows[:, :D_CKV])
            + torch.einsum("nhr,lr->nhl", q_pe[q0 : q0 + n].float(), rows[:, D_CKV:])
        ) * scale
        pos = torch.arange(L - n, L, device="cuda")[:, None, None]
        s = s.masked_fill(torch.arange(L, device="cuda")[None, None, :] > pos, float("-inf"))
        ref[q0 : q0 + n] = torch.einsum("nhl,lc->nhc", torch.softmax(s, dim=-1), rows[:, :D_CKV])
        q0 += n
    assert _gpu_rel(out, ref) < 2e-2
