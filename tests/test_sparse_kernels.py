"""DeepSeek sparse-attention kernels (indexer top-k, sparse MLA decode, host row gather/scatter) against
independent float64 oracles and the torch references.

Without CUDA the Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1, set by conftest.py before any
kernel module is imported) on small sizes; with CUDA the same small cases run compiled on the GPU, and the
``gpu``-marked tests add real sizes, CUDA-graph capture and copies from real pinned host memory.
"""

import math

import pytest
import torch
from triton_env import DEV, INTERPRETED  # noqa: F401  (skips the module without Triton)
from triton_env import needs_gpu as _needs_gpu

from backends.kernels.sparse.host_gather import copy_rows, gather_rows_from_host, scatter_rows_to_host
from backends.kernels.sparse.indexer import (
    indexer_scratch_bytes,
    indexer_topk,
    indexer_topk_reference,
    scores_topk,
)
from backends.kernels.sparse.sparse_mla_decode import (
    sparse_decode_scratch_bytes,
    sparse_decode_splits,
    sparse_mla_decode,
    sparse_mla_decode_reference,
)

D_CKV, D_PE = 512, 64
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rel(out, ref):
    out = out.detach().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------ sparse MLA decode
def _sparse_problem(valid_counts, H, K, dtype, seed, ctx=80, extra_rows=37):
    """Each token t has its own context of ``ctx`` scattered rows of a shared pool; it selects
    ``valid_counts[t]`` distinct context positions, placed at random entries of its K locations (-1 elsewhere).
    Returns (q_nope, q_pe, kv_rows, locs, slots [T, ctx], chosen positions per token)."""
    g = _gen(seed)
    T = len(valid_counts)
    S = T * ctx + extra_rows
    kv = torch.randn(S, D_CKV + D_PE, generator=g).to(dtype)
    perm = torch.randperm(S, generator=g)
    slots = perm[: T * ctx].view(T, ctx)
    locs = torch.full((T, K), -1, dtype=torch.int32)
    chosen = []
    for t, n in enumerate(valid_counts):
        pos = torch.randperm(ctx, generator=g)[:n]
        where = torch.randperm(K, generator=g)[:n]
        locs[t, where] = slots[t, pos].to(torch.int32)
        chosen.append(pos)
    q_nope = torch.randn(T, H, D_CKV, generator=g).to(dtype)
    q_pe = torch.randn(T, H, D_PE, generator=g).to(dtype)
    return q_nope, q_pe, kv, locs, slots, chosen


def _dense_restricted_oracle(q_nope, q_pe, kv, slots, chosen, scale):
    """float64 dense attention over each token's whole context, with every position outside ``chosen`` masked."""
    T, H, _ = q_nope.shape
    out = torch.zeros(T, H, D_CKV, dtype=torch.float64)
    for t in range(T):
        if len(chosen[t]) == 0:
            continue
        rows = kv[slots[t]].double()  # [ctx, 576]
        s = (q_nope[t].double() @ rows[:, :D_CKV].T + q_pe[t].double() @ rows[:, D_CKV:].T) * scale
        keep = torch.zeros(rows.shape[0], dtype=torch.bool)
        keep[chosen[t]] = True
        s = s.masked_fill(~keep[None, :], float("-inf"))
        out[t] = torch.softmax(s, dim=-1)[:, keep] @ rows[keep, :D_CKV]  # (masked rows may hold NaN)
    return out


def _run_sparse(valid_counts, H, K, dtype, seed, **kw):
    q_nope, q_pe, kv, locs, slots, chosen = _sparse_problem(valid_counts, H, K, dtype, seed)
    scale = 1.0 / math.sqrt(D_CKV + D_PE)
    oracle = _dense_restricted_oracle(q_nope, q_pe, kv, slots, chosen, scale)
    out = sparse_mla_decode(q_nope.to(DEV), q_pe.to(DEV), kv.to(DEV), locs.to(DEV), scale, **kw)
    ref = sparse_mla_decode_reference(q_nope, q_pe, kv, locs, scale)
    return out, ref, oracle


SMALL = dict(block_n=16, block_h=16, min_entries_per_split=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sparse_decode_matches_dense_restricted_to_the_same_indices(dtype):
    # valid entries 1, 7, 63, all 70, 0; K = 70 is not a multiple of block_n 16; H = 3 is a ragged head block;
    # several splits (some of them without any valid entry) merged by LSE.
    counts = [1, 7, 63, 70, 0]
    out, ref, oracle = _run_sparse(counts, 3, 70, dtype, seed=1, **SMALL)
    assert _rel(out, oracle) < TOL[dtype]
    assert _rel(ref, oracle) < TOL[dtype]  # the torch reference against the same oracle
    assert (out[4].cpu() == 0).all(), "a token without valid entries outputs zeros"


def test_sparse_decode_one_split_batch_of_one_and_scratch_limits():
    # batch of one; the scratch size bounds the splits: no scratch bytes -> one split (no merge), a scratch of
    # two splits -> two; results agree; `out` is written in place.
    q_nope, q_pe, kv, locs, slots, chosen = _sparse_problem([50], 16, 64, torch.float32, seed=2)
    oracle = _dense_restricted_oracle(q_nope, q_pe, kv, slots, chosen, 0.1)
    args = (q_nope.to(DEV), q_pe.to(DEV), kv.to(DEV), locs.to(DEV), 0.1)
    for n_splits in (0, 2, 4):
        out = torch.full((1, 16, D_CKV), float("nan"), device=DEV)
        scratch = torch.full((sparse_decode_scratch_bytes(1, 16, D_CKV, n_splits),), 255, dtype=torch.uint8, device=DEV)
        res = sparse_mla_decode(*args, scratch=scratch, out=out, **SMALL)
        assert res is out
        assert _rel(out, oracle) < TOL[torch.float32]
    assert sparse_decode_splits(1, 1, 64, 16, 8, 0, 16) == (1, 64)
    assert sparse_decode_splits(1, 1, 64, 16, 8, 2, 16) == (2, 32)
    assert sparse_decode_splits(1, 1, 64, 16, 8, 4, 16) == (4, 16)


def test_sparse_decode_splits_cover_k_and_respect_limits():
    for tokens, hb, k, bn, target, cap in [(32, 1, 2048, 64, 264, None), (1, 1, 70, 16, 100, 3), (8, 2, 2048, 32, 0, 4)]:
        n, length = sparse_decode_splits(tokens, hb, k, bn, target, cap, 16)
        assert length % bn == 0 and n * length >= k and (n - 1) * length < k
        assert cap is None or n <= max(cap, 1)


def test_sparse_decode_garbage_rows_never_read():
    # Rows nobody selected hold NaN: only the valid locations may be read (-1 entries are masked loads).
    q_nope, q_pe, kv, locs, slots, chosen = _sparse_problem([5, 20], 4, 40, torch.float16, seed=3)
    used = torch.zeros(kv.shape[0], dtype=torch.bool)
    used[locs[locs >= 0].long()] = True
    kv[~used] = float("nan")
    oracle = _dense_restricted_oracle(q_nope, q_pe, kv, slots, chosen, 0.07)
    out = sparse_mla_decode(q_nope.to(DEV), q_pe.to(DEV), kv.to(DEV), locs.to(DEV), 0.07, **SMALL)
    assert _rel(out, oracle) < TOL[torch.float16]


# ----------------------------------------------------------------------------------------- indexer top-k
def _indexer_problem(q_lens, ctx_lens, Hi, Di, dtype, seed, width_extra=5):
    """Requests with ``q_lens[b]`` query tokens at the end of a ``ctx_lens[b]``-token context; rows of the
    request table are permuted and slots scattered; garbage (out-of-range slots) past each context."""
    g = _gen(seed)
    B = len(q_lens)
    S = sum(ctx_lens) + 11
    width = max(ctx_lens) + width_extra
    perm = torch.randperm(S, generator=g)
    rows = torch.randperm(B + 2, generator=g)[:B]
    r2t = torch.full((B + 2, width), 10_000_000, dtype=torch.int32)
    at = 0
    for b, L in enumerate(ctx_lens):
        r2t[rows[b], :L] = perm[at : at + L].to(torch.int32)
        at += L
    positions = torch.cat([torch.arange(L - n, L) for n, L in zip(q_lens, ctx_lens)]).long()
    T = positions.shape[0]
    indptr = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(T, Hi, Di, generator=g).to(dtype)
    w = torch.randn(T, Hi, generator=g) * 0.5 + 0.5  # some negative weights too
    k_cache = torch.randn(S, Di, generator=g).to(dtype)
    return q, w, k_cache, r2t, rows.long(), positions, indptr


def _oracle_scores(q, w, k_cache, r2t, rows, positions, indptr):
    """float64 score of every (token, visible position): a list of [positions[t] + 1] vectors."""
    out = []
    for b in range(rows.shape[0]):
        for t in range(int(indptr[b]), int(indptr[b + 1])):
            L = int(positions[t]) + 1
            keys = k_cache[r2t[rows[b], :L].long()].double()
            logits = (q[t].double() @ keys.T).clamp_min(0)  # [Hi, L]
            out.append(w[t].double() @ logits)
    return out


def _check_topk(pos, scores, oracle, top_k, tol):
    """Selected positions are visible and distinct, -1 exactly past the visible count, scores are the oracle's
    scores of those positions, and the selected multiset equals the oracle's top-k (within tol)."""
    pos, scores = pos.cpu(), scores.cpu()
    assert pos.dtype == torch.int32 and scores.dtype == torch.float32
    for t, s in enumerate(oracle):
        n = min(top_k, s.shape[0])
        sel = pos[t, :n].long()
        assert (pos[t, n:] == -1).all() and torch.isinf(scores[t, n:]).all() and (scores[t, n:] < 0).all()
        assert (sel >= 0).all() and (sel < s.shape[0]).all() and sel.unique().numel() == n
        assert torch.allclose(scores[t, :n].double(), s[sel], rtol=tol, atol=tol)
        assert (scores[t, :n][1:] <= scores[t, :n][:-1]).all(), "sorted by descending score"
        best = torch.sort(s, descending=True).values[:n]
        assert torch.allclose(torch.sort(s[sel], descending=True).values, best, rtol=tol, atol=tol)


@pytest.mark.parametrize("top_k", [4, 64, 100])
def test_indexer_reference_matches_oracle(top_k):
    # decode tokens at contexts 1, 7, 63, 64 and a 5-token extend over 65 (causal inside the chunk).
    prob = _indexer_problem([1, 1, 1, 1, 5], [1, 7, 63, 64, 65], 4, 32, torch.float32, seed=top_k)
    oracle = _oracle_scores(*prob)
    pos, scores = indexer_topk_reference(*prob, top_k)
    _check_topk(pos, scores, oracle, top_k, 1e-5)


@pytest.mark.parametrize("dtype,topk_impl", [(torch.float32, "triton"), (torch.bfloat16, "triton"), (torch.bfloat16, "torch")])
@pytest.mark.parametrize("top_k", [8, 70])
def test_indexer_triton_matches_oracle(dtype, topk_impl, top_k):
    # many exact ties (ReLU zeros) at the k-th score; fewer visible keys than top_k (padding)
    prob = _indexer_problem([1, 1, 3, 1, 1], [1, 7, 63, 64, 100], 4, 32, dtype, seed=5)
    oracle = _oracle_scores(*prob)
    dev_prob = [x.to(DEV) for x in prob]
    pos, scores = indexer_topk(*dev_prob, top_k, block_n=16, keys_per_program=32, topk_impl=topk_impl)
    _check_topk(pos, scores, oracle, top_k, 1e-4)


def test_indexer_triton_preallocated_outputs_max_len_and_one_token():
    # batch of one, one query token; max_len bounds the scored columns; outputs and scratch are the caller's.
    prob = _indexer_problem([1], [50], 16, 16, torch.float32, seed=6, width_extra=30)
    oracle = _oracle_scores(*prob)
    dev_prob = [x.to(DEV) for x in prob]
    out_pos = torch.full((1, 20), 7, dtype=torch.int32, device=DEV)
    out_scores = torch.full((1, 20), float("nan"), device=DEV)
    scratch = torch.empty(indexer_scratch_bytes(1, 50, 20), dtype=torch.uint8, device=DEV)
    res = indexer_topk(*dev_prob, 20, max_len=50, out_pos=out_pos, out_scores=out_scores, scratch=scratch,
                       block_n=16, keys_per_program=16)  # fmt: skip
    assert res[0] is out_pos and res[1] is out_scores
    _check_topk(out_pos, out_scores, oracle, 20, 1e-4)


@pytest.mark.parametrize("radix_bits", [4, 8])
def test_rows_topk_radix_select_negatives_ties_and_padding(radix_bits):
    # Rows with negative and positive scores, -0.0 / +0.0, heavy ties at the k-th value, -inf tails (fewer
    # finite scores than k), and a row that is all -inf: the k largest by value, sorted, positions distinct.
    g = _gen(radix_bits)
    T, L, k = 5, 300, 40
    x = torch.randn(T, L, generator=g) * 3
    x[1] = torch.randint(-3, 4, (L,), generator=g).float()  # ties everywhere
    x[1, ::7] = -0.0
    x[2, 25:] = float("-inf")  # 25 finite < k
    x[3] = float("-inf")
    x[4, :200] = 1e-30 * torch.randn(200, generator=g)  # tiny values and denormal-range neighbours
    out_pos = torch.full((T, k), 123, dtype=torch.int32, device=DEV)
    out_scores = torch.full((T, k), float("nan"), device=DEV)
    vals = torch.empty(T, k, device=DEV)
    idx = torch.empty(T, k, dtype=torch.int64, device=DEV)
    scores_topk(x.to(DEV), k, out_pos, out_scores, vals, idx, impl="triton", radix_bits=radix_bits, block=64)
    pos, sc = out_pos.cpu(), out_scores.cpu()
    for t in range(T):
        finite = int(torch.isfinite(x[t]).sum())
        n = min(k, finite)
        assert (pos[t, n:] == -1).all() and (sc[t, n:] == float("-inf")).all()
        sel = pos[t, :n].long()
        assert sel.unique().numel() == n and torch.equal(x[t, sel], sc[t, :n])
        assert torch.equal(sc[t, :n], torch.sort(x[t], descending=True).values[:n])


# ------------------------------------------------------------------------------------ host row copies
def _copy_problem(dtype, W, seed, n_host=60, n_dev=12):
    g = _gen(seed)
    host = (torch.randn(n_host, W, generator=g) * 20).to(dtype)
    dev_rows = torch.full((n_dev, W), 3, dtype=dtype)
    src = torch.tensor([5, -1, 59, 0, 17, -1, 33, 8])
    dst = torch.tensor([0, 1, 11, 4, 2, 3, 7, 9])
    return host, dev_rows, src, dst


def _expected_copy(host, dev_rows, src, dst, count):
    exp = dev_rows.clone()
    n = src.shape[0] if count is None else int(count)
    for i in range(n):
        if src[i] >= 0:
            exp[dst[i]] = host[src[i]]
    return exp


@pytest.mark.parametrize("dtype,W", [(torch.bfloat16, 576), (torch.float32, 7), (torch.float16, 3), (torch.uint8, 5)])
@pytest.mark.parametrize("count", [None, 5, "tensor"])
def test_copy_rows_kernel_and_torch_path_match_a_loop(dtype, W, count):
    # The Triton copy kernel (run on the CPU interpreter or the GPU) and the torch CPU path against a Python
    # loop: -1 entries skipped, only the first `count` entries copied, other rows untouched.
    host, dev_rows, src, dst = _copy_problem(dtype, W, seed=W)
    c = torch.tensor([4]) if count == "tensor" else count
    exp = _expected_copy(host, dev_rows, src, dst, c)
    cpu = dev_rows.clone()
    gather_rows_from_host(host, src, cpu, dst, c)  # CPU destination: the torch path
    assert torch.equal(cpu, exp)
    if INTERPRETED:
        out = dev_rows.clone()
        copy_rows(host, src, out, dst, c, block_seg=8, iters=2)
    else:
        out = dev_rows.to(DEV)
        copy_rows(host.to(DEV), src.to(DEV), out, dst.to(DEV), c.to(DEV) if isinstance(c, torch.Tensor) else c)
    assert torch.equal(out.cpu(), exp)


def test_scatter_rows_to_host_torch_path():
    host, dev_rows, src, dst = _copy_problem(torch.bfloat16, 576, seed=9)
    dev_rows = torch.randn(dev_rows.shape).to(torch.bfloat16)
    s, d = torch.tensor([3, -1, 11, 0]), torch.tensor([40, 41, 2, 59])
    exp = host.clone()
    for i in range(4):
        if s[i] >= 0:
            exp[d[i]] = dev_rows[s[i]]
    scatter_rows_to_host(dev_rows, s, host, d)
    assert torch.equal(host, exp)


# ------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("H,T", [(16, 32), (128, 4)])
def test_gpu_sparse_decode_real_sizes(H, T):
    # DeepSeek-V3 TP8 (16 heads) and TP1 (128 heads) shapes, K = 2048 over a 4096-row device buffer per token.
    _needs_gpu()
    g = torch.Generator(device="cuda").manual_seed(H)
    K, S = 2048, T * 4096
    kv = torch.randn(S, D_CKV + D_PE, device="cuda", dtype=torch.bfloat16, generator=g)
    locs = torch.stack([torch.randperm(4096, device="cuda", generator=g)[:K] + t * 4096 for t in range(T)]).int()
    locs[0, 1000:] = -1
    locs[-1, ::7] = -1
    q_nope = torch.randn(T, H, D_CKV, device="cuda", dtype=torch.bfloat16, generator=g)
    q_pe = torch.randn(T, H, D_PE, device="cuda", dtype=torch.bfloat16, generator=g)
    out = sparse_mla_decode(q_nope, q_pe, kv, locs, 0.0417)
    ref = sparse_mla_decode_reference(q_nope, q_pe, kv, locs, 0.0417)
    assert _rel(out, ref.float().cpu()) < 1e-2


@pytest.mark.gpu
def test_gpu_sparse_decode_cuda_graph_replay_matches_eager():
    _needs_gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, K, S = 8, 16, 2048, 8 * 4096
    kv = torch.randn(S, D_CKV + D_PE, device="cuda", dtype=torch.bfloat16, generator=g)
    q_nope = torch.randn(T, H, D_CKV, device="cuda", dtype=torch.bfloat16, generator=g)
    q_pe = torch.randn(T, H, D_PE, device="cuda", dtype=torch.bfloat16, generator=g)
    locs = torch.randint(0, S, (T, K), device="cuda", dtype=torch.int32, generator=g)
    scratch = torch.empty(sparse_decode_scratch_bytes(T, H, D_CKV, 64), dtype=torch.uint8, device="cuda")
    out = torch.empty(T, H, D_CKV, device="cuda", dtype=torch.bfloat16)
    sparse_mla_decode(q_nope, q_pe, kv, locs, 0.05, scratch, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_mla_decode(q_nope, q_pe, kv, locs, 0.05, scratch, out=out)
    for seed in (1, 2):
        locs.copy_(torch.randint(0, S, (T, K), device="cuda", dtype=torch.int32, generator=g))
        locs[seed, seed * 100 :] = -1
        graph.replay()
        eager = sparse_mla_decode(q_nope, q_pe, kv, locs, 0.05)
        assert torch.equal(out, eager)
        ref = sparse_mla_decode_reference(q_nope, q_pe, kv, locs, 0.05)
        assert _rel(out, ref.float().cpu()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("topk_impl", ["torch", "triton"])
def test_gpu_indexer_real_heads_matches_reference_and_replays_in_a_graph(topk_impl):
    # Hi = 64, Di = 128; contexts up to 3000 with a 4-token extend; top-k 2048; then graph capture + replay.
    _needs_gpu()
    prob = _indexer_problem([1, 1, 4, 1], [3000, 1, 2049, 700], 64, 128, torch.bfloat16, seed=7)
    dev_prob = [x.to("cuda") for x in prob]
    q, w, k_cache, r2t, rows, positions, indptr = dev_prob
    top_k, T = 2048, q.shape[0]
    ref_pos, ref_scores = indexer_topk_reference(*dev_prob, top_k)
    pos, scores = indexer_topk(*dev_prob, top_k, max_len=3000, topk_impl=topk_impl)
    assert torch.equal(pos == -1, ref_pos == -1)
    assert torch.allclose(scores, ref_scores, rtol=1e-4, atol=1e-3)  # sorted: same multiset position by position
    out_pos = torch.empty(T, top_k, dtype=torch.int32, device="cuda")
    out_scores = torch.empty(T, top_k, device="cuda")
    scratch = torch.empty(indexer_scratch_bytes(T, 3000, top_k), dtype=torch.uint8, device="cuda")
    kw = dict(max_len=3000, out_pos=out_pos, out_scores=out_scores, scratch=scratch, topk_impl=topk_impl)
    indexer_topk(*dev_prob, top_k, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        indexer_topk(*dev_prob, top_k, **kw)
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref_pos, ref_scores = indexer_topk_reference(*dev_prob, top_k)
    assert torch.allclose(out_scores, ref_scores, rtol=1e-4, atol=1e-3)
    assert torch.equal(out_pos == -1, ref_pos == -1)


@pytest.mark.gpu
def test_gpu_gather_from_pinned_host_and_scatter_back():
    # Real pinned memory read and written by the kernel; -1 padding and a device-side count; bit-exact.
    _needs_gpu()
    g = torch.Generator().manual_seed(3)
    N, W, D, M = 5000, 576, 3000, 2048
    host = torch.randn(N, W, generator=g).to(torch.bfloat16).pin_memory()
    src = torch.randperm(N, generator=g)[:M]
    src[::5] = -1
    dst = torch.randperm(D, generator=g)[:M]
    dev_rows = torch.zeros(D, W, dtype=torch.bfloat16, device="cuda")
    count = torch.tensor([1500], device="cuda")
    gather_rows_from_host(host, src.cuda(), dev_rows, dst.cuda(), count)
    exp = torch.zeros(D, W, dtype=torch.bfloat16)
    keep = (src >= 0) & (torch.arange(M) < 1500)
    exp[dst[keep]] = host[src[keep]]
    assert torch.equal(dev_rows.cpu(), exp)

    back = torch.zeros(N, W, dtype=torch.bfloat16).pin_memory()
    sent = torch.where(keep, dst, -1)  # device rows to send back (the gathered ones), -1 elsewhere
    scatter_rows_to_host(dev_rows, sent.cuda(), back, src.clamp_min(0).cuda())
    torch.cuda.synchronize()
    exp_back = torch.zeros(N, W, dtype=torch.bfloat16)
    exp_back[src[keep]] = host[src[keep]]
    assert torch.equal(back, exp_back)

    with pytest.raises(ValueError, match="pinned CPU tensor"):
        gather_rows_from_host(host.clone(), src.cuda(), dev_rows, dst.cuda())  # pageable: refused with the fix
