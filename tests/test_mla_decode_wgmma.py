"""The Gluon (wgmma) stage 1 of the MLA decode (Hopper): 64 heads per program, and 16 / 32 heads per program with
tokens as the matrix rows (fewer heads); over fp8 caches the scores are fp8 products of a split q and the tiles are
widened for ``P @ V`` by warps of their own (64 heads: or, with ``FP8_HEADS_KERNEL`` off, widened first and
multiplied in fp16; 32 heads from ``FP8_ROLES_MIN_BATCH`` requests: a scorer and an accumulator warpgroup).

CPU: the plan kernel it reads (interpreted) against a Python mirror of the plan, and the refusals with their
reasons. GPU (``gpu``-marked): 16, 32, 64 and 128 heads, bf16, fp16 and fp8 caches, odd lengths (1, 7, 63, 64,
65, empty, page boundaries) with NaN rows past every request's end, batches of one, split pieces, against a
float32 reference (reading the same fp8 values, times the cache scale) and against the Triton stage 1; CUDA-graph
replay with other lengths gives the eager bits.
"""

import importlib
import math

import pytest
import torch
import triton
from triton_env import DEV, INTERPRETED, capture_graph, needs_gpu, rel_err, replays_equal_eager  # noqa: F401  (skips the module without Triton)

from backends.kernels.mla_decode.mla_decode import decode_work_ints, decode_workspace_shapes, mla_decode
from backends.kernels.mla_decode.mla_decode_plan_kernels import (
    _mla_decode_merge_rows_kernel,
    _mla_decode_plan_kernel,
    plan_ints,
)
from backends.kernels.mla_decode.mla_decode_wgmma import (
    FP8_ROLES_MIN_BATCH,
    SEESAW_MIN_BATCH,
    TOKENS_MIN_BATCH,
    WGMMA_MIN_JOBS,
    fp8_roles,
    seesaw_by_default,
    wgmma_block_h,
    wgmma_by_default,
    wgmma_problems,
)

D_CKV, D_PE = 512, 64
WGMMA_MODULE = "backends.kernels.mla_decode.mla_decode_wgmma"


def _plan_rows(lens, programs, min_chunk, block_n=64, snap=True):
    """Python mirror of the plan kernel: per program (first request, its global start, its first slot, end of the
    request range, chunk, chunk end)."""
    pad = [-(-L // block_n) * block_n for L in lens]
    total = sum(pad)
    chunk = max(triton.cdiv(triton.cdiv(total, programs), block_n) * block_n, min_chunk, block_n)
    nonzero = {p for p in pad if p > 0}
    if snap and len(nonzero) == 1:
        eq = next(iter(nonzero))
        r = triton.cdiv(chunk, eq) * eq
        chunk = r if 8 * r <= 9 * chunk else chunk
    rows = []
    for p in range(programs):
        lo, hi = p * chunk, min((p + 1) * chunk, total)
        s, slot, b0, s0, slot_b0 = 0, 0, 0, 0, 0
        for b, (L, pd) in enumerate(zip(lens, pad)):
            e = s + pd
            if e <= lo:  # ends at or before the chunk: before it
                b0, s0 = b + 1, e
                p0, p1 = s // chunk, max(e - 1, 0) // chunk
                slot += p1 - p0 + 1 if (L > 0 and p1 > p0) else 0
                slot_b0 = slot
            s = e
        b_end = sum(1 for b in range(len(lens)) if sum(pad[:b]) < hi) if lo < total else b0
        rows.append((b0, s0, slot_b0, b_end, chunk, hi))
    return rows


def _merge_plan(lens, programs, min_chunk):
    """(chunk, per request (first slot, pieces) of a split request or None, slots used): the shared Python mirror
    in test_triton_kernels."""
    from test_triton_kernels import _plan

    return _plan(lens, programs, min_chunk, 64)


@pytest.mark.parametrize(
    "lens,programs",
    [([1, 7, 63, 64, 65, 0, 129], 5), ([4097], 9), ([0, 0, 300, 0], 3), ([128, 128, 128], 4), ([5, 200, 3], 16)],
)
def test_plan_kernel_rows_match_the_python_plan(lens, programs):
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    hb = 2  # head blocks: a piece counter each per request
    work = torch.full((plan_ints(programs, len(lens), hb),), -7, dtype=torch.int32, device=DEV)
    kw = {} if INTERPRETED else dict(num_warps=4)
    _mla_decode_plan_kernel[(programs,)](sl, work, len(lens), programs, 64, 1, hb, BLOCK_N=64, BLOCK_B=256,
                                         MERGE_MAX=2, PDL=False, **kw)  # fmt: skip
    got = [tuple(r[:6]) for r in work[: 8 * programs].view(programs, 8).cpu().tolist()]
    assert got == _plan_rows(lens, programs, 64)
    # the merge's rows: (first slot, pieces) of every non-empty request, as the kernels' shared plan gives them
    chunk, plan, _ = _merge_plan(lens, programs, 64)
    req = work[8 * programs : 8 * programs + 2 * len(lens)].view(len(lens), 2).cpu().tolist()
    cnt = work[8 * programs + 2 * len(lens) :].view(len(lens), hb).cpu()
    for b, L in enumerate(lens):
        if L:
            # requests of at most MERGE_MAX pieces are merged by stage 1: no merge kernel work (1 piece)
            want = plan[b] if plan[b] and plan[b][1] > 2 else (plan[b][0] if plan[b] else req[b][0], 1)
            assert tuple(req[b]) == want, (b, req[b], plan[b])
            assert (cnt[b] == 0).all(), "every head block's piece counter starts at 0"


def test_wgmma_refusals_name_every_reason():
    q = torch.zeros(1, 24, D_CKV, dtype=torch.bfloat16)
    kv = torch.zeros(2, 16, D_CKV + D_PE, dtype=torch.float32)
    why = wgmma_problems(q, kv, 8, None)
    assert len(why) == 5 and "Hopper" in why[0] and "bf16 / fp16 / fp8" in why[1] and "multiple of 16 heads" in why[2]
    assert "page size 16" in why[3] and "work list" in why[4]
    q = torch.zeros(1, 128, D_CKV, dtype=torch.bfloat16)
    kv = torch.zeros(2, 64, D_CKV + D_PE, dtype=torch.bfloat16)
    assert wgmma_problems(q, kv, 9, torch.zeros(8, dtype=torch.int32)) == []
    why = wgmma_problems(q.float(), kv.to(torch.float8_e4m3fn), 9, torch.zeros(8, dtype=torch.int32))
    assert len(why) == 1 and "bf16 / fp16 query over an fp8 cache" in why[0]
    workspace = decode_workspace_shapes(1, 128, 4).allocate("cpu")
    with pytest.raises(ValueError, match=r"use_wgmma=True.*expected a Hopper GPU .*got no GPU.*Fix: pass use_wgmma=None"):
        mla_decode(q, q[..., :D_PE], kv, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 0.1,
                   torch.empty_like(q), *workspace, max_splits=4, use_wgmma=True)  # fmt: skip


def test_wgmma_heads_per_program():
    """64 heads per program for a multiple of 64 heads (any cache); the tokens kernels' 32 or 16 otherwise (bf16,
    fp16 and fp8); 0 where neither tiles the heads."""
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert [wgmma_block_h(h, bf16) for h in (16, 32, 48, 64, 128, 8, 24)] == [16, 32, 16, 64, 64, 0, 0]
    assert [wgmma_block_h(h, fp8) for h in (16, 32, 48, 64, 128, 8)] == [16, 32, 16, 64, 64, 0]
    # the default where it runs: measured faster than the Triton stage 1. 64-head blocks from WGMMA_MIN_JOBS
    # (request, head block) pairs, any cache (128 heads: two head blocks per request)
    for dt in (bf16, torch.float16, fp8):
        assert wgmma_by_default(64, dt, WGMMA_MIN_JOBS) and not wgmma_by_default(64, dt, WGMMA_MIN_JOBS - 1)
        half = WGMMA_MIN_JOBS // 2
        assert wgmma_by_default(128, dt, half) and not wgmma_by_default(128, dt, half - 1)
    # bf16 / fp16 at 16 / 32-head blocks (the tokens kernel): from TOKENS_MIN_BATCH[block] requests
    assert wgmma_by_default(16, bf16, 1) and TOKENS_MIN_BATCH[16] == 1
    assert wgmma_by_default(32, bf16, TOKENS_MIN_BATCH[32]) and not wgmma_by_default(32, bf16, TOKENS_MIN_BATCH[32] - 1)
    assert wgmma_by_default(48, torch.float16, 1)  # three 16-head blocks
    # fp8 up to FP8_MAX_HEADS heads (the 16 / 32-head fp8 kernels) at every batch; 32-head blocks from
    # FP8_ROLES_MIN_BATCH requests in the roles kernel
    assert [wgmma_by_default(h, fp8, 1) for h in (16, 32, 48)] == [True, True, False]
    assert fp8_roles(32, FP8_ROLES_MIN_BATCH) and not fp8_roles(32, FP8_ROLES_MIN_BATCH - 1)
    assert not fp8_roles(16, 4 * FP8_ROLES_MIN_BATCH)
    # the seesaw kernel: 128 heads and more from SEESAW_MIN_BATCH requests, bf16 / fp16 only
    assert seesaw_by_default(128, bf16, SEESAW_MIN_BATCH) and not seesaw_by_default(128, bf16, SEESAW_MIN_BATCH - 1)
    assert not seesaw_by_default(64, bf16, 256) and not seesaw_by_default(128, fp8, 256)
    assert not wgmma_by_default(24, bf16, 256)


@pytest.mark.parametrize("programs", [1, 3, 40])
def test_merge_rows_kernel_shares_the_jobs_out(programs):
    """The wgmma path's merge over a fixed grid: requests split into several pieces are merged by their LSEs, empty
    ones get zeros, the ones finished by the stage 1 are left as they are; requests in several BLOCK_B chunks, heads
    not a multiple of the head block, more or fewer programs than jobs."""
    g = torch.Generator().manual_seed(programs)
    H, D, slot_div = 5, 64, 4
    lens = [3, 0, 900, 40, 0, 77, 5, 600, 1, 0, 300]
    pieces = [1, 1, 3, 1, 1, 2, 1, 6, 1, 1, 2]
    req, slot = [], 0
    for L, n in zip(lens, pieces):
        req += [slot, n] if L else [-1, -1]  # empty requests have no row
        slot += n if n > 1 else 0
    rows = triton.cdiv(slot, slot_div)
    po = torch.randn(rows, H, slot_div, D, generator=g)
    pl = torch.randn(rows, H, slot_div, generator=g) * 3
    out = torch.full((len(lens), H, D), 7.0)
    sl, req_t, out_d = torch.tensor(lens, dtype=torch.int32), torch.tensor(req, dtype=torch.int32), out.to(DEV)
    _mla_decode_merge_rows_kernel[(programs,)](
        po.to(DEV), pl.to(DEV), sl.to(DEV), req_t.to(DEV), out_d, *po.stride()[:3], *pl.stride(),
        *out.stride()[:2], H, len(lens), slot_div, D_CKV=D, BLOCK_B=4, BLOCK_S=2, BLOCK_HM=4, BLOCK_DV=32, PDL=False,
    )  # fmt: skip
    out_d = out_d.cpu()
    for b, (L, n) in enumerate(zip(lens, pieces)):
        if L == 0:
            assert (out_d[b] == 0).all(), b
        elif n == 1:
            assert (out_d[b] == 7.0).all(), f"request {b} was finished by the stage 1: left as it was"
        else:
            s = torch.arange(req[2 * b], req[2 * b] + n)
            lse, o = pl[s // slot_div, :, s % slot_div], po[s // slot_div, :, s % slot_div]  # [n, H], [n, H, D]
            ref = (torch.softmax(lse, 0)[..., None] * o).sum(0)
            torch.testing.assert_close(out_d[b], ref, rtol=1e-5, atol=1e-5)


def test_a_plan_is_reused_only_where_it_is_the_same(monkeypatch):
    """mla_decode returns the wgmma plan it wrote; given back, the plan kernel is skipped, but only where every host
    choice and the work / lengths tensors are the same (another lengths tensor, batch or chunking plans again)."""
    md = importlib.import_module("backends.kernels.mla_decode.mla_decode")
    runs = []
    monkeypatch.setattr(md, "wgmma_problems", lambda *a: [])
    monkeypatch.setattr(md, "wgmma_block_h", lambda *a: 16)
    monkeypatch.setattr(md, "launch_wgmma_stage1", lambda *a, run_plan, **k: runs.append(run_plan))
    B, H = 3, 16
    q_nope, q_pe = torch.zeros(B, H, D_CKV), torch.zeros(B, H, D_PE)
    kv, pt = torch.zeros(8, 64, D_CKV + D_PE), torch.zeros(B, 8, dtype=torch.int32)
    po, pl, work = decode_workspace_shapes(B, H, 4).allocate("cpu")
    sl = torch.tensor([5, 300, 64], dtype=torch.int32)

    def call(plan, lens=sl, b=B, **kw):
        return md.mla_decode(q_nope[:b], q_pe[:b], kv, pt, lens, 0.1, torch.empty(b, H, D_CKV), po, pl,
                             max_splits=4, work=work, use_wgmma=True, target_programs=8, plan=plan, _skip_merge=True,
                             **kw)  # fmt: skip

    first = call(None)
    assert call(first) == first and call(first) == first
    call(first, lens=sl.clone())
    call(first, b=2, lens=sl[:2].clone())
    call(first, min_tokens_per_split=256)
    assert runs == [True, False, False, True, True, True]


def test_triton_backend_plans_once_per_forward_pass():
    """The triton_mla backend hands its decode kernel no plan on a pass's first layer and the returned plan on the
    others; every metadata hook and every pass that starts again at a lower layer (the graph runner's warm-ups and
    capture after one hook) plans anew."""
    from types import SimpleNamespace

    from conftest import compose_config

    import containers

    backend = containers.build(compose_config("device=cpu", "backend=triton_mla")).container.backend()
    given = []

    def decode(*a, plan, **k):
        given.append(plan)
        return f"plan{len(given)}"

    backend._decode_kernel = decode
    batch = SimpleNamespace(req_pool_indices=torch.zeros(2, dtype=torch.int64), max_seq_len=5, batch_size=2,
                            seq_lens=torch.tensor([5, 3], dtype=torch.int32))
    q_nope, q_pe = torch.zeros(2, backend.model.num_heads, D_CKV), torch.zeros(2, backend.model.num_heads, D_PE)
    layers = backend.model.kv_cache_layers
    backend.init_forward_metadata(batch)
    for _ in range(2):  # two passes after one hook
        for layer in layers:
            backend.forward_decode(q_nope, q_pe, layer, batch)
    backend.init_forward_metadata(batch)
    backend.forward_decode(q_nope, q_pe, layers[-1], batch)  # a new step starting high still plans
    n = len(layers)
    assert n >= 2
    first_pass = [None] + [f"plan{i}" for i in range(1, n)]
    second_pass = [None] + [f"plan{i}" for i in range(n + 1, 2 * n)]
    assert given == first_pass + second_pass + [None]


@pytest.mark.parametrize("value", [None, False, True])
def test_triton_backend_passes_fp8_scores_to_the_decode(value):
    """``backend.fp8_scores`` (64-head blocks over an fp8 cache: fp8 or fp16 score products) reaches every decode
    call; null leaves the kernels' default."""
    from types import SimpleNamespace

    from conftest import compose_config

    import containers

    overrides = ["device=cpu", "backend=triton_mla"] + ([] if value is None else [f"backend.fp8_scores={value}"])
    backend = containers.build(compose_config(*overrides)).container.backend()
    seen = []
    backend._decode_kernel = lambda *a, fp8_scores, **k: seen.append(fp8_scores)
    batch = SimpleNamespace(req_pool_indices=torch.zeros(1, dtype=torch.int64), max_seq_len=3, batch_size=1,
                            seq_lens=torch.tensor([3], dtype=torch.int32))
    backend.init_forward_metadata(batch)
    h = backend.model.num_heads
    backend.forward_decode(torch.zeros(1, h, D_CKV), torch.zeros(1, h, D_PE), backend.model.kv_cache_layers[0], batch)
    assert seen == [value]


# ------------------------------------------------------------------------------------------------- GPU
def _problem(lens, H, dtype, seed, page=64):
    """A shuffled paged cache whose rows past each request's end are NaN (never-written pool memory), q (bf16 over
    an fp8 cache)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = [max(1, math.ceil(L / page)) for L in lens]
    total = sum(pages) + 4
    kv = torch.randn(total, page, D_CKV + D_PE, device="cuda", generator=g)
    perm = torch.randperm(total, device="cuda", generator=g).to(torch.int32)
    pt = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
    pos = 0
    for b, n in enumerate(pages):
        pt[b, :n] = perm[pos : pos + n]
        pos += n
        L = lens[b]
        if L % page or L == 0:
            kv[pt[b, L // page].long(), L % page :] = float("nan")
    kv = kv.to(dtype)
    qdt = torch.bfloat16 if dtype == FP8 else dtype
    q_nope = torch.randn(len(lens), H, D_CKV, device="cuda", generator=g).to(qdt)
    q_pe = torch.randn(len(lens), H, D_PE, device="cuda", generator=g).to(qdt)
    return kv, pt, q_nope, q_pe


def _reference(q_nope, q_pe, kv, pt, lens, scale, kv_scale=1.0):
    page = kv.shape[1]
    out = torch.zeros(q_nope.shape, dtype=torch.float32, device="cuda")
    for b, L in enumerate(lens):
        if L:
            t = torch.arange(L, device="cuda")
            rows = kv[pt[b, t // page].long(), t % page].float() * kv_scale
            s = (q_nope[b].float() @ rows[:, :D_CKV].T + q_pe[b].float() @ rows[:, D_CKV:].T) * scale
            out[b] = torch.softmax(s, dim=-1) @ rows[:, :D_CKV]
    return out


def _decode(q_nope, q_pe, kv, pt, lens, scale, **kw):
    B, H = q_nope.shape[:2]
    ws = decode_workspace_shapes(B, H, 8)
    po = torch.full(ws.partial_out, float("nan"), device="cuda")
    pl = torch.full(ws.partial_lse, float("nan"), device="cuda")
    out = torch.full((B, H, D_CKV), float("nan"), dtype=q_nope.dtype, device="cuda")
    work = torch.full(ws.work, -1, dtype=torch.int32, device="cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    mla_decode(q_nope, q_pe, kv, pt, sl, scale, out, po, pl, max_splits=8, work=work, **kw)
    return out


ODD = [1, 7, 63, 64, 65, 0, 129, 4097, 2000, 8192, 513, 127, 128]
FP8 = torch.float8_e4m3fn


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, FP8], ids=["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("lens", [ODD, [1], [32768], [5, 3]], ids=["odd", "one-token", "one-long", "two-short"])
def test_gpu_wgmma_decode_matches_reference_and_triton(H, dtype, lens):
    needs_gpu()
    kv, pt, q_nope, q_pe = _problem(lens, H, dtype, seed=H + len(lens))
    scale, kv_scale = 1.0 / math.sqrt(192), (0.75 if dtype == FP8 else 1.0)
    ref = _reference(q_nope, q_pe, kv, pt, lens, scale, kv_scale)
    ours = _decode(q_nope, q_pe, kv, pt, lens, scale, use_wgmma=True, kv_scale=kv_scale)
    tri = _decode(q_nope, q_pe, kv, pt, lens, scale, use_wgmma=False, kv_scale=kv_scale)
    for b, L in enumerate(lens):
        if L == 0:
            assert (ours[b] == 0).all(), "a request with no keys gets zeros"
    err = rel_err(ours, ref)
    assert err < 1e-2, err
    assert rel_err(ours, tri.float()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32, 64])
def test_gpu_fp8_kernel_pages_of_128(H):
    """The fp8 kernel's loads find a tile's rows through the page table (two tiles per page of 128 tokens, the
    second at an offset of 64): odd lengths against the reference, NaN past each request's end."""
    needs_gpu()
    lens = [1, 63, 64, 65, 127, 128, 129, 1000, 0, 4097]
    kv, pt, q_nope, q_pe = _problem(lens, H, FP8, seed=H, page=128)
    ref = _reference(q_nope, q_pe, kv, pt, lens, 0.1, 0.5)
    out = _decode(q_nope, q_pe, kv, pt, lens, 0.1, use_wgmma=True, kv_scale=0.5)
    assert rel_err(out, ref) < 1e-2 and (out[8] == 0).all()


def _ranged_heads(H, gains, seed=5, **kw):
    """The per-head error of the wgmma stage 1 over an fp8 cache against the float32 reference when the first heads'
    q are scaled by ``gains`` (a zero row, tiny and large ranges, a peaked softmax); ``kw`` to ``mla_decode``."""
    lens = [4097, 1, 700, 64]
    kv, pt, q_nope, q_pe = _problem(lens, H, FP8, seed=seed)
    gain = torch.tensor(gains + [1.0] * (H - len(gains)), device="cuda").view(1, H, 1)
    q_nope, q_pe = (q_nope.float() * gain).to(torch.bfloat16), (q_pe.float() * gain).to(torch.bfloat16)
    ref = _reference(q_nope, q_pe, kv, pt, lens, 1.0 / math.sqrt(192), 0.75)
    out = _decode(q_nope, q_pe, kv, pt, lens, 1.0 / math.sqrt(192), use_wgmma=True, kv_scale=0.75, **kw)
    return [rel_err(out[:, h], ref[:, h]) for h in range(H)]


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32, 64])
def test_gpu_fp8_scores_keep_bf16_level_error(H):
    """The fp8 kernels' scores are fp8 products of q split into two e4m3 parts per head (a per-head power-of-two
    scale): heads of very different ranges (a zero row, rows times 1e-3 and 4, a peaked softmax) each stay within
    bf16-level error of the float32 reference over the same fp8 cache. Not claimed for scores in the thousands: the
    fp8 accumulation's error, up to 6e-4 of the largest score, then moves near-tied maxima (H100, a head with q x1000:
    16% on this problem at 64 heads, up to 1.6e-2 over 8 others at 16 heads; the next test's fp16 products)."""
    needs_gpu()
    per_head = _ranged_heads(H, [0.0, 1e-3, 4.0])
    assert max(per_head) < 5e-3, per_head


@pytest.mark.gpu
def test_gpu_fp16_products_keep_heads_of_extreme_range():
    """With ``fp8_scores=False`` 64-head blocks over an fp8 cache multiply in fp16 (the lock-step kernel, each tile
    widened first): a head with q x1000 (scores in the thousands, near-tied maxima) stays at bf16-level error too."""
    needs_gpu()
    per_head = _ranged_heads(64, [0.0, 1e3, 1e-3, 4.0], fp8_scores=False)
    assert max(per_head) < 5e-3, per_head


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_fp8_lockstep_kernel_matches_reference(H, monkeypatch):
    """The lock-step kernel over an fp8 cache (``fp8_scores=False``, or ``FP8_HEADS_KERNEL`` off; the default runs the
    fp8-scores kernel) over odd lengths with NaN past every request's end, pages of 64 and 128, against the float32
    reference over the same fp8 cache."""
    needs_gpu()
    monkeypatch.setattr(importlib.import_module(WGMMA_MODULE), "FP8_HEADS_KERNEL", False)
    for page, kw in ((64, {}), (128, dict(fp8_scores=False))):
        kv, pt, q_nope, q_pe = _problem(ODD, H, FP8, seed=H + page, page=page)
        ref = _reference(q_nope, q_pe, kv, pt, ODD, 0.1, 0.75)
        out = _decode(q_nope, q_pe, kv, pt, ODD, 0.1, use_wgmma=True, kv_scale=0.75, **kw)
        assert rel_err(out, ref) < 5e-3 and (out[5] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("page", [64, 128])
def test_gpu_fp8_roles_kernel_matches_reference(page, monkeypatch):
    """The 32-head roles kernel over an fp8 cache (a scorer and an accumulator warpgroup; the default from
    ``FP8_ROLES_MIN_BATCH`` requests, here from one): odd lengths with NaN past every request's end, one token, one
    long request, two short ones, pages of 64 and 128, each twice (its rings and barriers carry over between pieces
    and calls), against the float32 reference over the same fp8 cache; heads of very different ranges at bf16-level
    error; a batch of ``FP8_ROLES_MIN_BATCH`` or more takes it by default."""
    needs_gpu()
    wg = importlib.import_module(WGMMA_MODULE)
    monkeypatch.setattr(wg, "FP8_ROLES_MIN_BATCH", 1)
    for lens in (ODD, [1], [32768], [5, 3]):
        kv, pt, q_nope, q_pe = _problem(lens, 32, FP8, seed=len(lens) + page, page=page)
        ref = _reference(q_nope, q_pe, kv, pt, lens, 0.1, 0.75)
        for _ in range(2):
            out = _decode(q_nope, q_pe, kv, pt, lens, 0.1, use_wgmma=True, kv_scale=0.75)
            assert rel_err(out, ref) < 5e-3
            assert all((out[b] == 0).all() for b, L in enumerate(lens) if L == 0)
    if page == 64:
        per_head = _ranged_heads(32, [0.0, 1e-3, 4.0])
        assert max(per_head) < 5e-3, per_head
    monkeypatch.setattr(wg, "FP8_ROLES_MIN_BATCH", FP8_ROLES_MIN_BATCH)
    lens = ODD * (FP8_ROLES_MIN_BATCH // len(ODD) + 1)
    kv, pt, q_nope, q_pe = _problem(lens, 32, FP8, seed=3, page=page)
    out = _decode(q_nope, q_pe, kv, pt, lens, 0.1, use_wgmma=True, kv_scale=0.75)
    assert rel_err(out, _reference(q_nope, q_pe, kv, pt, lens, 0.1, 0.75)) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("merge_max", [0, 2, 1 << 20], ids=["merge-kernel", "few-in-stage1", "all-in-stage1"])
@pytest.mark.parametrize("H,dtype", [(16, torch.bfloat16), (64, torch.bfloat16), (64, FP8)],
                         ids=["16-bf16", "64-bf16", "64-fp8"])
def test_gpu_wgmma_stage1_merge_matches_reference(H, dtype, merge_max, monkeypatch):
    """Split requests merged by the merge kernel, by the stage 1 up to 2 pieces, or all by the stage 1 (the last
    program to finish a request's pieces): the same outputs, zeros for empty requests, twice (counters reset)."""
    needs_gpu()
    monkeypatch.setattr(importlib.import_module(WGMMA_MODULE), "MERGE_MAX_PIECES", merge_max)
    lens = [1, 7, 0, 4097, 2000, 64, 129, 30000, 0, 513]
    kv, pt, q_nope, q_pe = _problem(lens, H, dtype, seed=H + merge_max % 7)
    ref = _reference(q_nope, q_pe, kv, pt, lens, 0.1)
    for _ in range(2):
        out = _decode(q_nope, q_pe, kv, pt, lens, 0.1, use_wgmma=True)
        assert rel_err(out, ref) < 1e-2 and (out[2] == 0).all() and (out[8] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("H,dtype", [(128, torch.bfloat16), (16, torch.bfloat16), (16, FP8), (32, FP8), (128, FP8)],
                         ids=["128-bf16", "16-bf16", "16-fp8", "32-fp8", "128-fp8"])
def test_gpu_wgmma_decode_graph_replay_matches_eager(H, dtype):
    """Plan, Gluon stage 1 (merging its few-piece requests at bf16) and merge in a graph, with ``pdl=True``
    (programmatic dependent launch for the plan, the 16-head kernels and the merge; the 64-head kernel launches
    plainly): the eager launch's bits, replayed with other lengths (the counters re-zeroed by the plan)."""
    needs_gpu()
    lens_a, lens_b = [4096, 17, 1, 2048, 333, 8192], [5, 8192, 700, 1, 64, 3000]
    kv, pt, q_nope, q_pe = _problem([max(a, b) for a, b in zip(lens_a, lens_b)], H, dtype, seed=5)
    kv = kv.float().nan_to_num().to(kv.dtype)  # lengths change between replays: every row up to the longer one is real
    B = len(lens_a)
    po, pl, work = decode_workspace_shapes(B, H, 8).allocate("cuda")
    out = torch.empty(B, H, D_CKV, dtype=q_nope.dtype, device="cuda")
    sl = torch.tensor(lens_a, dtype=torch.int32, device="cuda")

    def step():
        mla_decode(q_nope, q_pe, kv, pt, sl, 0.1, out, po, pl, max_splits=8, work=work, use_wgmma=True, pdl=True)

    step()  # compile outside capture
    graph = capture_graph(step)
    for lens in replays_equal_eager(graph, step, out, sl, (lens_a, lens_b)):
        assert rel_err(out, _reference(q_nope, q_pe, kv, pt, lens, 0.1)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("H,dtype", [(16, torch.bfloat16), (64, torch.bfloat16), (16, FP8), (64, FP8)],
                         ids=["16-bf16", "64-bf16", "16-fp8", "64-fp8"])
def test_gpu_one_plan_serves_every_layer(H, dtype):
    """Three layers (other caches, queries and page tables; the same lengths) under one plan, as the triton_mla
    backend runs a step: written by the first call, reused by the others, eagerly and replayed in a graph (twice).
    Split requests of few pieces (merged by the stage 1) and of many (the merge kernel) and empty ones: each layer
    matches its reference, so the program that merges re-armed its counter (left at its count, the next layer's
    request would stay unmerged: NaN)."""
    needs_gpu()
    lens = [1, 7, 0, 4097, 2000, 64, 129, 30000, 0, 513]
    kv_scale = 0.75 if dtype == FP8 else 1.0
    layers = [_problem(lens, H, dtype, seed=seed) for seed in range(3)]
    refs = [_reference(qn, qp, kv, pt, lens, 0.1, kv_scale) for kv, pt, qn, qp in layers]
    B = len(lens)
    po, pl, work = decode_workspace_shapes(B, H, 8).allocate("cuda")
    work.fill_(-1)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    outs = [torch.empty(B, H, D_CKV, dtype=qn.dtype, device="cuda") for _, _, qn, _ in layers]
    plans = []

    def step():
        plan = None
        for (kv, pt, qn, qp), out in zip(layers, outs):
            plan = mla_decode(qn, qp, kv, pt, sl, 0.1, out, po, pl, max_splits=8, work=work, use_wgmma=True,
                              pdl=True, kv_scale=kv_scale, plan=plan)  # fmt: skip
            plans.append(plan)

    def check(run):
        for o in outs:
            o.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        for layer, (out, ref) in enumerate(zip(outs, refs)):
            assert rel_err(out, ref) < 1e-2, layer
            assert (out[2] == 0).all() and (out[8] == 0).all(), "requests with no keys get zeros"

    check(step)
    assert plans[0] is not None and plans[1] == plans[0] == plans[2]
    graph = capture_graph(step)
    for _ in range(2):
        check(graph.replay)


def test_wgmma_branch_merges_through_the_plan_rows(monkeypatch):
    """mla_decode's wgmma branch on the CPU, with the Triton stage 1 over the same plan standing in for the Gluon
    kernel: the plan kernel's per-request rows (not a recomputed plan) drive the merge of split requests."""
    from test_triton_kernels import _check, _make_cache, _ref_decode

    md = importlib.import_module("backends.kernels.mla_decode.mla_decode")
    lens, H, scale = [1, 7, 300, 0, 65, 129, 200], 4, 0.06
    g = torch.Generator().manual_seed(3)
    kv, pt = _make_cache(lens, 64, torch.float32, g)
    q_nope, q_pe = torch.randn(len(lens), H, D_CKV, generator=g), torch.randn(len(lens), H, D_PE, generator=g)
    seen = {}

    def stand_in(q_nope, q_pe, kv, pt, sl, work, po, pl, out, *, programs, min_chunk, snap, max_splits, merge_max,
                 **_):  # fmt: skip
        assert merge_max == 0, "the stand-in stage 1 does not merge"
        _mla_decode_plan_kernel[(programs,)](sl, work, len(lens), programs, min_chunk, int(snap), 1, BLOCK_N=64,
                                             BLOCK_B=256, MERGE_MAX=0, PDL=False)  # fmt: skip
        md.mla_decode(q_nope, q_pe, kv, pt, sl, scale, out, po, pl, work, max_splits=max_splits, block_n=64,
                      block_h=16, target_programs=programs, min_tokens_per_split=min_chunk, use_wgmma=False,
                      _skip_merge=True)  # fmt: skip
        seen.update(programs=programs, req=work[8 * programs : 8 * programs + 2 * len(lens)].clone())

    monkeypatch.setattr(md, "wgmma_problems", lambda *a: [])
    monkeypatch.setattr(md, "wgmma_block_h", lambda *a: 16)
    monkeypatch.setattr(md, "launch_wgmma_stage1", stand_in)
    # every split request through the merge kernel
    monkeypatch.setattr(importlib.import_module(WGMMA_MODULE), "MERGE_MAX_PIECES", 0)
    po = torch.full((len(lens), H, 4, D_CKV), float("nan"), device=DEV)
    pl = torch.full((len(lens), H, 4), float("nan"), device=DEV)
    out = torch.full((len(lens), H, D_CKV), float("nan"), device=DEV)
    work = torch.full((decode_work_ints(len(lens), H, len(lens) * 4),), -1, dtype=torch.int32, device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    md.mla_decode(q_nope.to(DEV), q_pe.to(DEV), kv.to(DEV), pt.to(DEV), sl, scale, out, po, pl, max_splits=4,
                  work=work, use_wgmma=True, target_programs=16)  # fmt: skip
    assert seen["req"].view(-1, 2)[:, 1].max() > 1, "no request was split: the merge rows went untested"
    _check(out, _ref_decode(q_nope, q_pe, kv, pt, lens, scale), torch.float32)
