"""Triton MLA kernels (split-KV decode, causal extend) against an independent float64 reference.

On a machine without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest.py before
the kernels are imported) on small sizes. On a CUDA machine the same small cases run compiled on the GPU,
and the ``gpu``-marked tests add real sizes and CUDA-graph capture.
"""

import importlib
import math

import pytest
import torch
import triton
from triton_env import DEV, INTERPRETED, TOL  # noqa: F401  (skips the module without Triton)

from backends.kernels.mla_decode.mla_decode import decode_work_ints, decode_workspace_shapes, mla_decode
from backends.kernels.mla_extend.mla_extend import mla_extend

_dec_mod = importlib.import_module("backends.kernels.mla_decode.mla_decode")
D_CKV, D_PE = 512, 64


# ----------------------------------------------------------------------------------------------- helpers
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _work(B, H, partial_out):
    """The decode plan space mla_decode checks on every call, for B requests over ``partial_out``'s slots."""
    slots = partial_out.shape[0] * partial_out.shape[2]
    return torch.empty(decode_work_ints(B, H, slots), dtype=torch.int32, device=partial_out.device)


def _make_cache(lens, page_size, dtype, g, extra_pages=3, width_extra=1):
    """A shuffled page pool: request b's pages are random, non-contiguous pool entries; the page table has
    garbage (out-of-range ids) past each request's pages."""
    B = len(lens)
    pages_per = [math.ceil(L / page_size) for L in lens]
    total = sum(pages_per) + extra_pages
    width = max(max(pages_per), 1) + width_extra
    kv = torch.randn(total, page_size, D_CKV + D_PE, generator=g).to(dtype)
    perm = torch.randperm(total, generator=g)
    pt = torch.full((B, width), 10_000_000, dtype=torch.int32)  # garbage: would fault if read
    pos = 0
    for b, n in enumerate(pages_per):
        pt[b, :n] = perm[pos : pos + n].to(torch.int32)
        pos += n
    return kv, pt


def _rows(kv, pt, b, L):
    page_size = kv.shape[1]
    t = torch.arange(L)
    return kv[pt[b, t // page_size].long(), t % page_size].double()


def _ref_decode(q_nope, q_pe, kv, pt, lens, scale):
    B, H, _ = q_nope.shape
    out = torch.zeros(B, H, D_CKV, dtype=torch.float64)
    for b, L in enumerate(lens):
        if L == 0:
            continue
        rows = _rows(kv, pt, b, L)
        s = (q_nope[b].double() @ rows[:, :D_CKV].T + q_pe[b].double() @ rows[:, D_CKV:].T) * scale
        out[b] = torch.softmax(s, dim=-1) @ rows[:, :D_CKV]
    return out


def _ref_extend(q_nope, q_pe, kv, pt, q_lens, kv_lens, scale):
    T, H, _ = q_nope.shape
    out = torch.zeros(T, H, D_CKV, dtype=torch.float64)
    q0 = 0
    for b, (n, L) in enumerate(zip(q_lens, kv_lens)):
        rows = _rows(kv, pt, b, L)
        qn, qp = q_nope[q0 : q0 + n].double(), q_pe[q0 : q0 + n].double()
        s = (
            torch.einsum("nhc,lc->nhl", qn, rows[:, :D_CKV]) + torch.einsum("nhr,lr->nhl", qp, rows[:, D_CKV:])
        ) * scale
        pos = torch.arange(L - n, L)[:, None, None]
        s = s.masked_fill(torch.arange(L)[None, None, :] > pos, float("-inf"))
        out[q0 : q0 + n] = torch.einsum("nhl,lc->nhc", torch.softmax(s, dim=-1), rows[:, :D_CKV])
        q0 += n
    return out


def _check(out, ref, dtype):
    out = out.detach().cpu()
    assert not torch.isnan(out).any(), "NaN in output (unwritten element or bad math)"
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"relative error {err:.3e} >= {TOL[dtype]:.0e}"
    return err


def _run_decode(lens, H, page_size, dtype, seed, *, max_splits=4, ws_rows=None, **kw):
    g = _gen(seed)
    B = len(lens)
    kv, pt = _make_cache(lens, page_size, dtype, g)
    q_nope = torch.randn(B, H, D_CKV, generator=g).to(dtype)
    q_pe = torch.randn(B, H, D_PE, generator=g).to(dtype)
    scale = 1.0 / math.sqrt(D_CKV + D_PE)
    ref = _ref_decode(q_nope, q_pe, kv, pt, lens, scale)
    rows = B if ws_rows is None else ws_rows
    partial_out = torch.full((rows, H, max_splits, D_CKV), float("nan"), device=DEV)
    partial_lse = torch.full((rows, H, max_splits), float("nan"), device=DEV)
    out = torch.full((B, H, D_CKV), float("nan"), dtype=dtype, device=DEV)
    mla_decode(
        q_nope.to(DEV),
        q_pe.to(DEV),
        kv.to(DEV),
        pt.to(DEV),
        torch.tensor(lens, dtype=torch.int32, device=DEV),
        scale,
        out,
        partial_out,
        partial_lse,
        _work(B, H, partial_out),
        max_splits=max_splits,
        **kw,
    )
    return out, ref, partial_lse


def _run_extend(q_lens, kv_lens, H, page_size, dtype, seed, **kw):
    g = _gen(seed)
    kv, pt = _make_cache(kv_lens, page_size, dtype, g)
    T = sum(q_lens)
    q_nope = torch.randn(T, H, D_CKV, generator=g).to(dtype)
    q_pe = torch.randn(T, H, D_PE, generator=g).to(dtype)
    scale = 1.0 / math.sqrt(D_CKV + D_PE)
    ref = _ref_extend(q_nope, q_pe, kv, pt, q_lens, kv_lens, scale)
    indptr = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    out = torch.full((T, H, D_CKV), float("nan"), dtype=dtype, device=DEV)
    mla_extend(
        q_nope.to(DEV),
        q_pe.to(DEV),
        kv.to(DEV),
        pt.to(DEV),
        indptr.to(DEV),
        torch.tensor(kv_lens, dtype=torch.int32, device=DEV),
        scale,
        out,
        **kw,
    )
    return out, ref


SMALL = dict(block_n=16, block_h=16)  # small tiles keep the interpreter quick


# ------------------------------------------------------------------------------------------------ decode
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_lengths_across_split_boundaries(page_size):
    # min_tokens_per_split=16 with block_n=16: 63/64/65 land on both sides of tile and split boundaries;
    # H=3 is not a multiple of BLOCK_H.
    lens = [1, 7, 63, 64, 65]
    out, ref, _ = _run_decode(lens, 3, page_size, torch.float32, seed=page_size, min_tokens_per_split=16, **SMALL)
    _check(out, ref, torch.float32)


def _plan(lens, programs, min_tokens, block_n, snap=True):
    """Python mirror of the kernels' work plan: (chunk, [(first slot, pieces) or None per request], slots used)."""
    pad = [-(-L // block_n) * block_n for L in lens]
    total = sum(pad)
    chunk = max(triton.cdiv(triton.cdiv(total, programs), block_n) * block_n,
                triton.cdiv(min_tokens, block_n) * block_n, block_n)  # fmt: skip
    nonzero = {pd for pd in pad if pd > 0}
    if snap and len(nonzero) == 1:  # equal lengths: cut at request boundaries if it costs <= 1/8 more
        eq = nonzero.pop()
        r = triton.cdiv(chunk, eq) * eq
        if 8 * r <= 9 * chunk:
            chunk = r
    s, slot, res = 0, 0, []
    for L, pd in zip(lens, pad):
        e = s + pd
        p0, p1 = s // chunk, max(e - 1, 0) // chunk
        if L > 0 and p1 > p0:
            res.append((slot, p1 - p0 + 1))
            slot += p1 - p0 + 1
        else:
            res.append(None)
        s = e
    return chunk, res, slot


def _slots_written(lse, max_splits):
    """Flat slot ids whose LSE was written (finite) for every head; the rest must still be NaN."""
    flat = lse.cpu().permute(0, 2, 1).reshape(-1, lse.shape[1])  # [rows * max_splits, H], slot-major
    written = torch.isfinite(flat).all(1)
    assert (written | torch.isnan(flat).all(1)).all(), "a slot was written for some heads only"
    return set(torch.nonzero(written).flatten().tolist())


def test_decode_one_long_request_among_short():
    # target_programs=4 over 16 + 208 + 16 = 240 padded tokens -> chunks of 64 (min_tokens 32 -> 32):
    # the long request is cut into 4 pieces (slots 0..3), the short ones are finished by their program.
    lens = [3, 200, 5]
    out, ref, lse = _run_decode(
        lens, 4, 16, torch.float32, seed=11, min_tokens_per_split=32, target_programs=4, **SMALL
    )
    _check(out, ref, torch.float32)
    chunk, plan, used = _plan(lens, 4, 32, 16)
    assert chunk == 64 and plan == [None, (0, 4), None]
    assert _slots_written(lse, 4) == set(range(used))


def test_decode_token_balanced_plan_spreads_long_requests():
    # Mixed lengths, 6 programs: every program covers the same number of tokens; a request twice as long
    # gets about twice the pieces, and pieces land in consecutive flat slots.
    lens = [150, 20, 300, 1, 90, 64]
    out, ref, lse = _run_decode(
        lens, 3, 16, torch.float32, seed=12, max_splits=4, min_tokens_per_split=16, target_programs=6, **SMALL
    )
    _check(out, ref, torch.float32)
    chunk, plan, used = _plan(lens, 6, 16, 16)
    assert chunk == 112 and plan[2][1] >= 3 and plan[1] is None and plan[3] is None
    assert used <= min(2 * (6 - 1), 6 - 1 + len(lens))
    assert _slots_written(lse, 4) == set(range(used))


@pytest.mark.parametrize("snap", [True, False])
def test_decode_equal_lengths_snap_to_request_boundaries(snap):
    # 8 x 512 tokens over 9 programs: chunks of 464 would cut every request; snapping rounds them up to 512
    # (<= 1/8 more per program) so each program takes one whole request and nothing is split.
    lens = [512] * 8
    out, ref, lse = _run_decode(
        lens, 2, 16, torch.float32, seed=14, max_splits=4, min_tokens_per_split=16, target_programs=9, snap=snap,
        **SMALL,
    )  # fmt: skip
    _check(out, ref, torch.float32)
    chunk, plan, used = _plan(lens, 9, 16, 16, snap=snap)
    assert (chunk, used == 0) == ((512, True) if snap else (464, False))
    assert _slots_written(lse, 4) == set(range(used))


def test_decode_page_size_64_scalar_page_path_block_n_32():
    # page_size % block_n == 0 takes the one-page-per-tile path; chunks of 32 tokens cut both requests.
    out, ref, _ = _run_decode([90, 33], 5, 64, torch.float32, seed=5, min_tokens_per_split=30, block_n=32, block_h=16)
    _check(out, ref, torch.float32)


def test_decode_batch_of_one_bf16():
    out, ref, _ = _run_decode([100], 16, 16, torch.bfloat16, seed=3, min_tokens_per_split=32, **SMALL)
    _check(out, ref, torch.bfloat16)


def test_decode_fp16_gather_tiles():
    # page 16 with block_n 32: every tile spans two pages (the per-token gather path).
    out, ref, _ = _run_decode([47, 20], 2, 16, torch.float16, seed=4, min_tokens_per_split=16, block_n=32, block_h=16)
    _check(out, ref, torch.float16)


def test_decode_flat_slots_fewer_rows_than_requests_and_chunked_merge():
    # One workspace row of 8 slots shared by 3 requests; merge_block_s=2 walks a request's pieces in chunks
    # (the running rescale across chunks), merge_block_h=2 with H=3 leaves a ragged head block.
    lens = [130, 40, 70]
    out, ref, lse = _run_decode(
        lens, 3, 16, torch.float32, seed=6, max_splits=8, ws_rows=1, min_tokens_per_split=16, target_programs=0,
        merge_block_s=2, merge_block_h=2, merge_block_dv=128, **SMALL,
    )  # fmt: skip
    _check(out, ref, torch.float32)
    programs = _dec_mod.decode_programs(3, 8, 1, 0)
    assert programs == 6  # max(8 // 2 + 1, 8 - 3 + 1)
    _, plan, used = _plan(lens, programs, 16, 16)
    assert used <= 8 and plan[0][1] >= 3
    assert _slots_written(lse, 8) == set(range(used))


@pytest.mark.parametrize("use_tma", [False, True])
def test_decode_garbage_rows_past_length_never_reach_the_output(use_tma):
    # NaN in the rows of each request's last page past its length (never-written pool memory): masked
    # loads (pointer path) or zeroed tiles (TMA path) keep them out of P @ V.
    g = _gen(13)
    lens, H, page_size, dtype = [37, 100, 5], 3, 16, torch.float16
    kv, pt = _make_cache(lens, page_size, dtype, g)
    for b, L in enumerate(lens):
        if L % page_size:
            kv[pt[b, L // page_size].long(), L % page_size :] = float("nan")
    q_nope = torch.randn(3, H, D_CKV, generator=g).to(dtype)
    q_pe = torch.randn(3, H, D_PE, generator=g).to(dtype)
    ref = _ref_decode(q_nope, q_pe, kv, pt, lens, 0.05)
    po = torch.full((3, H, 4, D_CKV), float("nan"), device=DEV)
    pl = torch.full((3, H, 4), float("nan"), device=DEV)
    out = torch.full((3, H, D_CKV), float("nan"), dtype=dtype, device=DEV)
    mla_decode(
        q_nope.to(DEV), q_pe.to(DEV), kv.to(DEV), pt.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV),
        0.05, out, po, pl, _work(3, H, po), max_splits=4, min_tokens_per_split=16, target_programs=5, use_tma=use_tma,
        **SMALL,
    )  # fmt: skip
    _check(out, ref, dtype)


def test_decode_single_split_and_zero_length_no_nan():
    out, ref, _ = _run_decode([0, 1, 30], 3, 16, torch.float32, seed=7, max_splits=1, **SMALL)
    _check(out, ref, torch.float32)
    assert (out[0].cpu() == 0).all()


def test_decode_zero_lengths_between_split_requests():
    out, ref, _ = _run_decode(
        [0, 50, 0, 0, 45, 0], 2, 16, torch.float32, seed=9, min_tokens_per_split=16, target_programs=5, **SMALL
    )
    _check(out, ref, torch.float32)
    assert (out[0].cpu() == 0).all() and (out[5].cpu() == 0).all()


def test_decode_strided_inputs_and_output():
    g = _gen(8)
    lens, H, page_size, dtype = [40, 9], 3, 16, torch.float32
    kv, pt = _make_cache(lens, page_size, dtype, g)
    q = torch.randn(2, H, D_CKV + D_PE, generator=g)  # q_nope / q_pe as views of one tensor
    scale = 0.07
    ref = _ref_decode(q[..., :D_CKV], q[..., D_CKV:], kv, pt, lens, scale)
    qd = q.to(DEV)
    big_out = torch.full((2, H, 2 * D_CKV), float("nan"), device=DEV)
    out = big_out[..., :D_CKV]
    po = torch.empty(2, H, 3, D_CKV, device=DEV)
    pl = torch.empty(2, H, 3, device=DEV)
    mla_decode(
        qd[..., :D_CKV],
        qd[..., D_CKV:],
        kv.to(DEV),
        pt.to(DEV),
        torch.tensor(lens, dtype=torch.int32, device=DEV),
        scale,
        out,
        po,
        pl,
        _work(2, H, po),
        max_splits=3,
        min_tokens_per_split=16,
        **SMALL,
    )
    _check(out, ref, dtype)
    assert torch.isnan(big_out[..., D_CKV:]).all()  # nothing written outside `out`


def test_decode_programs_never_overflow_the_slots():
    # Pure host arithmetic: for any lengths, the pieces of the plan fit in the workspace slots.
    g = torch.Generator().manual_seed(0)
    for _trial in range(300):
        B = int(torch.randint(1, 300, (1,), generator=g))
        slots = int(torch.randint(1, 600, (1,), generator=g))
        target = int(torch.randint(0, 1200, (1,), generator=g))
        lens = torch.randint(0, 5000, (B,), generator=g)
        lens[torch.rand(B, generator=g) < 0.2] = 0
        programs = _dec_mod.decode_programs(B, slots, 1, target)
        assert 1 <= programs
        _, _, used = _plan(lens.tolist(), programs, 1, 16)
        assert used <= slots, (B, slots, target, programs, used)


def test_merge_config_shapes():
    c = _dec_mod.merge_config(1, 16, 264, 132)
    assert c["merge_block_s"] == 128 and c["merge_block_h"] == 1 and c["merge_block_dv"] == 32
    c = _dec_mod.merge_config(128, 16, 264, 132)
    assert c["merge_block_s"] * c["merge_block_h"] * c["merge_block_dv"] <= 4096


def test_decode_workspace_helpers():
    ws = decode_workspace_shapes(256, 16, 8)
    assert ws.partial_out == (256, 16, 8, 512) and ws.partial_lse == (256, 16, 8)
    # the plan of the most programs the 2048 slots allow (8 int32 each) and 2 + 1 int32 per request (one head block)
    assert ws.work == (8 * 2048 + 3 * 256,) == (decode_work_ints(256, 16, 2048),)
    assert _dec_mod.decode_workspace_bytes(256, 16, 8) == 4 * (256 * 16 * 8 * 513 + 8 * 2048 + 3 * 256) == ws.nbytes
    assert _dec_mod.decode_workspace_bytes(256, 16, 8) <= 128 * 2**20
    ws1 = decode_workspace_shapes(1, 16, 8)
    assert ws1.partial_out[0] * ws1.partial_out[2] >= _dec_mod.MIN_WORKSPACE_SLOTS
    po, pl, work = ws1.allocate("cpu")
    assert (po.shape, pl.shape, work.shape) == (ws1.partial_out, ws1.partial_lse, ws1.work)
    assert (po.dtype, pl.dtype, work.dtype) == (torch.float32, torch.float32, torch.int32)


def test_decode_work_ints_bounds_every_plan():
    """decode_work_ints covers plan_ints at the most programs decode_programs gives and the most head blocks the
    wgmma stage 1 uses (16 heads each), for any batch up to the bound's and any target."""
    from backends.kernels.mla_decode.mla_decode_plan_kernels import plan_ints

    g = torch.Generator().manual_seed(1)
    for _trial in range(300):
        batch = int(torch.randint(1, 300, (1,), generator=g))
        B = int(torch.randint(1, batch + 1, (1,), generator=g))
        slots = int(torch.randint(1, 5000, (1,), generator=g))
        heads = 16 * int(torch.randint(1, 9, (1,), generator=g))
        target = int(torch.randint(0, 20000, (1,), generator=g))
        for block_h in (16, 32, 64):
            hb = triton.cdiv(heads, block_h)
            programs = _dec_mod.decode_programs(B, slots, hb, target)
            assert plan_ints(programs, B, hb) <= decode_work_ints(batch, heads, slots)


# ------------------------------------------------------------------------------------------------ extend
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_empty_prefix(page_size):
    out, ref = _run_extend(
        [13], [13], 3, page_size, torch.float32, seed=20 + page_size, block_m=16, block_h=2, block_n=16
    )
    _check(out, ref, torch.float32)


def test_extend_with_prefix():
    out, ref = _run_extend([6], [45], 2, 16, torch.float32, seed=22, block_m=16, block_h=2, block_n=16)
    _check(out, ref, torch.float32)


def test_extend_mixed_requests():
    # decode-like (1 new), no prefix, prefix with a tile-crossing run of new tokens, max_q_len from indptr.
    q_lens, kv_lens = [1, 7, 3, 17], [20, 7, 40, 50]
    out, ref = _run_extend(q_lens, kv_lens, 3, 16, torch.float32, seed=23, block_m=16, block_h=4, block_n=16)
    _check(out, ref, torch.float32)


def test_extend_mixed_page1_bf16_heads_only_rows():
    # block_h=16 > H: rows filled by heads with one token per tile.
    q_lens, kv_lens = [2, 5], [33, 5]
    out, ref = _run_extend(
        q_lens, kv_lens, 3, 1, torch.bfloat16, seed=24, block_m=16, block_h=16, block_n=16, max_q_len=5
    )
    _check(out, ref, torch.bfloat16)


def test_extend_block_n_32_page_64():
    out, ref = _run_extend([9, 4], [70, 4], 2, 64, torch.float32, seed=25, block_m=16, block_h=1, block_n=32)
    _check(out, ref, torch.float32)
