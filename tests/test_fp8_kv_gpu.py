"""Every MLA kernel path x KV dtype (bf16, fp8 e4m3) x heads {16, 32, 64, 128} x odd lengths, on the GPU,
against a float32 torch reference reading the same (dequantized) cache: our Triton decode (its default
variant for the head count and the pointer path), extend and sparse decode, and FlashInfer's MLA decode."""

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from backends.kernels.mla_decode.mla_decode import decode_workspace_shapes, mla_decode  # noqa: E402
from backends.kernels.mla_extend.mla_extend import mla_extend  # noqa: E402
from backends.kernels.sparse.sparse_mla_decode import sparse_mla_decode  # noqa: E402

D_CKV, D_PE, PAGE = 512, 64, 64
FP8 = torch.float8_e4m3fn
LENS = [1, 63, 65, 1000, 4097]
SCALE = 0.03
TOL = 2e-2  # bf16 products


def _cache(lens, fp8, g):
    pages = [math.ceil(n / PAGE) for n in lens]
    total = sum(pages) + 2
    kv = torch.randn(total, PAGE, D_CKV + D_PE, generator=g) * 3 * SCALE
    kv = (kv / SCALE).to(FP8) if fp8 else kv.to(torch.bfloat16)
    kv[0] = float("nan")  # the padding page: never read
    perm = torch.randperm(total - 1, generator=g) + 1
    pt = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(pages):
        pt[b, :n] = perm[pos : pos + n].to(torch.int32)
        pos += n
    return kv.cuda(), pt.cuda()


def _rows(kv, pt, b, n, fp8):
    t = torch.arange(n, device="cuda")
    return kv[pt[b, t // PAGE].long(), t % PAGE].float() * (SCALE if fp8 else 1.0)


def _rel(out, ref):
    assert not torch.isnan(out).any()
    return ((out.float() - ref).norm() / ref.norm()).item()


def _decode_ref(qn, qp, kv, pt, lens, sm, fp8):
    out = torch.zeros(qn.shape, device="cuda")
    for b, n in enumerate(lens):
        r = _rows(kv, pt, b, n, fp8)
        s = (qn[b].float() @ r[:, :D_CKV].T + qp[b].float() @ r[:, D_CKV:].T) * sm
        out[b] = torch.softmax(s, -1) @ r[:, :D_CKV]
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize("path", ["default", "pointer", "flashinfer"])
def test_decode(path, heads, fp8):
    g = torch.Generator().manual_seed(heads + fp8)
    kv, pt = _cache(LENS, fp8, g)
    qn = torch.randn(len(LENS), heads, D_CKV, generator=g).to(torch.bfloat16).cuda()
    qp = torch.randn(len(LENS), heads, D_PE, generator=g).to(torch.bfloat16).cuda()
    sm = 1 / math.sqrt(192)
    ref = _decode_ref(qn, qp, kv, pt, LENS, sm, fp8)
    seq = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    out = torch.full_like(qn, float("nan"))
    if path == "flashinfer":
        fi = pytest.importorskip("flashinfer.mla")
        w = fi.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"), backend="fa3")
        pages = [math.ceil(n / PAGE) for n in LENS]
        indices = torch.cat([pt[b, :n] for b, n in enumerate(pages)])
        indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
        w.plan(torch.arange(len(LENS) + 1, dtype=torch.int32), indptr, indices, seq.cpu(), heads, D_CKV, D_PE,
               PAGE, False, sm, torch.bfloat16, kv.dtype)
        extra = dict(ckv_scale=SCALE, kpe_scale=SCALE) if fp8 else {}
        w.run(qn, qp, kv[..., :D_CKV], kv[..., D_CKV:], out=out, **extra)
    else:
        ws = decode_workspace_shapes(len(LENS), heads, 64)
        po = torch.full(ws.partial_out, float("nan"), device="cuda")
        pl = torch.full(ws.partial_lse, float("nan"), device="cuda")
        work = torch.empty(ws.work, dtype=torch.int32, device="cuda")
        # "default": the stage 1 the launcher picks (the wgmma kernels on Hopper where they measured faster);
        # "pointer": the Triton stage 1 with pointer loads
        kw = dict(use_tma=False, use_wgmma=False) if path == "pointer" else {}
        mla_decode(qn, qp, kv, pt, seq, sm, out, po, pl, work, max_splits=64, kv_scale=SCALE, **kw)
    assert _rel(out, ref) < TOL


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_extend(heads, fp8):
    g = torch.Generator().manual_seed(7 + heads)
    q_lens, kv_lens = [1, 7, 33], [65, 7, 1000]
    kv, pt = _cache(kv_lens, fp8, g)
    T = sum(q_lens)
    qn = torch.randn(T, heads, D_CKV, generator=g).to(torch.bfloat16).cuda()
    qp = torch.randn(T, heads, D_PE, generator=g).to(torch.bfloat16).cuda()
    sm = 1 / math.sqrt(192)
    ref = torch.zeros(T, heads, D_CKV, device="cuda")
    q0 = 0
    for b, (n, L) in enumerate(zip(q_lens, kv_lens)):
        r = _rows(kv, pt, b, L, fp8)
        s = (torch.einsum("nhc,lc->nhl", qn[q0:q0 + n].float(), r[:, :D_CKV])
             + torch.einsum("nhr,lr->nhl", qp[q0:q0 + n].float(), r[:, D_CKV:])) * sm
        pos = torch.arange(L - n, L, device="cuda")[:, None, None]
        s = s.masked_fill(torch.arange(L, device="cuda")[None, None, :] > pos, float("-inf"))
        ref[q0:q0 + n] = torch.einsum("nhl,lc->nhc", torch.softmax(s, -1), r[:, :D_CKV])
        q0 += n
    out = torch.full_like(qn, float("nan"))
    indptr = torch.tensor([0, 1, 8, 41], dtype=torch.int32, device="cuda")
    mla_extend(qn, qp, kv, pt, indptr, torch.tensor(kv_lens, dtype=torch.int32, device="cuda"), sm, out,
               max_q_len=33, kv_scale=SCALE)
    assert _rel(out, ref) < TOL


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
def test_sparse_decode(heads, fp8):
    g = torch.Generator().manual_seed(11 + heads)
    T, K, S = 5, 257, 3001
    rows = torch.randn(S, D_CKV + D_PE, generator=g) * 3 * SCALE
    rows = ((rows / SCALE).to(FP8) if fp8 else rows.to(torch.bfloat16)).cuda()
    locs = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    locs[2, 100:] = -1
    locs = locs.cuda()
    qn = torch.randn(T, heads, D_CKV, generator=g).to(torch.bfloat16).cuda()
    qp = torch.randn(T, heads, D_PE, generator=g).to(torch.bfloat16).cuda()
    sm = 1 / math.sqrt(192)
    r = rows.float() * (SCALE if fp8 else 1.0)
    ref = torch.zeros(T, heads, D_CKV, device="cuda")
    for t in range(T):
        sel = locs[t][locs[t] >= 0].long()
        s = (qn[t].float() @ r[sel, :D_CKV].T + qp[t].float() @ r[sel, D_CKV:].T) * sm
        ref[t] = torch.softmax(s, -1) @ r[sel, :D_CKV]
    out = sparse_mla_decode(qn, qp, rows, locs, sm, kv_scale=SCALE)
    assert _rel(out, ref) < TOL
