"""fp8 (e4m3) latent KV cache: pool round trip and clip counting, the kernels reading an fp8 cache against a
float64 reference over the same dequantized values (TRITON_INTERPRET=1 on the CPU, tiny sizes), the torch
reference backend with an fp8 cache, and the config refusals."""

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math

import pytest

torch = pytest.importorskip("torch")

from runtime.core.kv_pool import FP8_E4M3_MAX, MLAKVPool  # noqa: E402

D_CKV, D_PE = 512, 64
FP8 = torch.float8_e4m3fn
DEV = "cuda" if _HAS_CUDA else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------- pool
def _pool(kv_dtype="fp8_e4m3", scale=1.0, dtype=torch.bfloat16, num_pages=4, page_size=4):
    return MLAKVPool([0, 1], num_pages, page_size, 8, 4, dtype, torch.device("cpu"), kv_dtype=kv_dtype, scale=scale)


def test_fp8_pool_halves_bytes_and_round_trips_within_e4m3_rounding():
    g = _gen(0)
    fp8, bf16 = _pool(scale=0.5), _pool("auto")
    assert fp8.nbytes * 2 == bf16.nbytes and fp8.bytes_per_token * 2 == bf16.bytes_per_token
    assert fp8.buffer(0).dtype == FP8 and bf16.buffer(0).dtype == torch.bfloat16
    slots = torch.tensor([5, 1, 14])
    ckv, kpe = torch.randn(3, 8, generator=g), torch.randn(3, 4, generator=g)
    fp8.write(1, slots, ckv, kpe)
    back = fp8.gather(1, slots, torch.float32)
    want = torch.cat([ckv, kpe], 1)
    rel = ((back - want).abs() / want.abs().clamp_min(1e-3)).max().item()
    assert 0 < rel <= 2**-4, rel  # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 relative
    # exactly the stored codes times the scale
    assert torch.equal(back, fp8.flat(1)[slots].float() * 0.5)
    assert fp8.gather(1, slots).dtype == torch.bfloat16
    assert fp8.quant_stats()["values_clipped"] == 0 and fp8.quant_stats()["values_written"] == 3 * 12


def test_fp8_pool_counts_and_saturates_clipped_values():
    pool = _pool(scale=2.0)
    ckv = torch.zeros(2, 8)
    ckv[0, :3] = torch.tensor([900.0, -1000.0, 895.0])  # / 2 -> 450, -500 clip; 447.5 does not
    kpe = torch.full((2, 4), 1e6)  # all 8 clip
    pool.write(0, torch.tensor([3, 4]), ckv, kpe)
    st = pool.quant_stats()
    assert st["values_clipped"] == 2 + 8 and st["values_written"] == 24
    rows = pool.gather(0, torch.tensor([3, 4]), torch.float32)
    assert not torch.isnan(rows).any()
    assert rows[0, 0].item() == FP8_E4M3_MAX * 2 and rows[0, 1].item() == -FP8_E4M3_MAX * 2
    assert (rows[:, 8:] == FP8_E4M3_MAX * 2).all()


def test_auto_pool_is_the_model_dtype_and_counts_nothing():
    pool = _pool("auto", scale=3.0, dtype=torch.float32)
    pool.write(0, torch.tensor([2]), torch.full((1, 8), 1e6), torch.ones(1, 4))
    assert pool.scale == 1.0 and pool.gather(0, torch.tensor([2]))[0, 0].item() == 1e6
    assert pool.quant_stats()["values_clipped"] == 0


# ----------------------------------------------------------------------------------------------- kernels
triton = pytest.importorskip("triton")

from backends.kernels.mla_decode.mla_decode import decode_work_ints, mla_decode  # noqa: E402
from backends.kernels.mla_extend.mla_extend import mla_extend  # noqa: E402
from backends.kernels.sparse.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference  # noqa: E402

_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
if not (_INTERP or _HAS_CUDA):
    pytest.skip("no CUDA and TRITON_INTERPRET was not set before triton was imported", allow_module_level=True)


def _fp8_cache(lens, page_size, g, scale):
    """A shuffled fp8 page pool (values up to ~3 x scale) and its page table; garbage past each request."""
    pages_per = [math.ceil(n / page_size) for n in lens]
    total = sum(pages_per) + 2
    kv = (torch.randn(total, page_size, D_CKV + D_PE, generator=g) * 3).to(FP8)
    perm = torch.randperm(total, generator=g)
    pt = torch.full((len(lens), max(max(pages_per), 1) + 1), 10_000_000, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(pages_per):
        pt[b, :n] = perm[pos : pos + n].to(torch.int32)
        pos += n
    return kv, pt


def _rows(kv, pt, b, n, scale):
    ps = kv.shape[1]
    t = torch.arange(n)
    return kv[pt[b, t // ps].long(), t % ps].double() * scale


def _work(partial_out):
    """The decode plan space mla_decode checks, for one request per row of ``partial_out``."""
    rows, heads, splits = partial_out.shape[:3]
    return torch.empty(decode_work_ints(rows, heads, rows * splits), dtype=torch.int32, device=partial_out.device)


def _rel(out, ref):
    out = out.detach().cpu().double()
    assert not torch.isnan(out).any()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("qdtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_decode_reads_fp8_cache(qdtype, tol):
    g, scale, H = _gen(1), 0.37, 3
    lens = [1, 7, 33]
    kv, pt = _fp8_cache(lens, 16, g, scale)
    qn = torch.randn(len(lens), H, D_CKV, generator=g).to(qdtype)
    qp = torch.randn(len(lens), H, D_PE, generator=g).to(qdtype)
    sm = 1 / math.sqrt(D_CKV + D_PE)
    ref = torch.zeros(len(lens), H, D_CKV, dtype=torch.float64)
    for b, n in enumerate(lens):
        r = _rows(kv, pt, b, n, scale)
        s = (qn[b].double() @ r[:, :D_CKV].T + qp[b].double() @ r[:, D_CKV:].T) * sm
        ref[b] = torch.softmax(s, -1) @ r[:, :D_CKV]
    out = torch.full((len(lens), H, D_CKV), float("nan"), dtype=qdtype, device=DEV)
    po = torch.full((len(lens), H, 4, D_CKV), float("nan"), device=DEV)
    pl = torch.full((len(lens), H, 4), float("nan"), device=DEV)
    mla_decode(qn.to(DEV), qp.to(DEV), kv.to(DEV), pt.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV),
               sm, out, po, pl, _work(po), max_splits=4, min_tokens_per_split=16, block_n=16, block_h=16,
               kv_scale=scale)
    assert _rel(out, ref) < tol


def test_decode_fp8_cache_clamps_a_bf16_query_to_fp16_range():
    """Over an fp8 cache a bf16 query runs in fp16: entries past 65504 are clamped, never inf / NaN."""
    g, scale, H = _gen(4), 0.5, 2
    lens = [5, 20]
    kv, pt = _fp8_cache(lens, 16, g, scale)
    qn = (torch.randn(len(lens), H, D_CKV, generator=g) * 4e4).to(torch.bfloat16)
    qp = torch.randn(len(lens), H, D_PE, generator=g).to(torch.bfloat16)
    assert qn.abs().max() > 65504
    sm = 1e-9  # keeps the clamped logits moderate, so the softmax is not one-hot
    ref = torch.zeros(len(lens), H, D_CKV, dtype=torch.float64)
    qc = qn.double().clamp(-65504, 65504)
    for b, n in enumerate(lens):
        r = _rows(kv, pt, b, n, scale)
        s = (qc[b] @ r[:, :D_CKV].T + qp[b].double() @ r[:, D_CKV:].T) * sm
        ref[b] = torch.softmax(s, -1) @ r[:, :D_CKV]
    out = torch.full((len(lens), H, D_CKV), float("nan"), dtype=torch.bfloat16, device=DEV)
    po = torch.full((len(lens), H, 4, D_CKV), float("nan"), device=DEV)
    pl = torch.full((len(lens), H, 4), float("nan"), device=DEV)
    mla_decode(qn.to(DEV), qp.to(DEV), kv.to(DEV), pt.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV),
               sm, out, po, pl, _work(po), max_splits=4, min_tokens_per_split=16, block_n=16, block_h=16,
               kv_scale=scale)
    assert _rel(out, ref) < 2e-2


def test_extend_reads_fp8_cache():
    g, scale, H = _gen(2), 1.5, 2
    q_lens, kv_lens = [3, 1], [19, 5]
    kv, pt = _fp8_cache(kv_lens, 8, g, scale)
    T = sum(q_lens)
    qn, qp = torch.randn(T, H, D_CKV, generator=g), torch.randn(T, H, D_PE, generator=g)
    sm = 1 / math.sqrt(D_CKV + D_PE)
    ref = torch.zeros(T, H, D_CKV, dtype=torch.float64)
    q0 = 0
    for b, (n, L) in enumerate(zip(q_lens, kv_lens)):
        r = _rows(kv, pt, b, L, scale)
        s = (torch.einsum("nhc,lc->nhl", qn[q0:q0 + n].double(), r[:, :D_CKV])
             + torch.einsum("nhr,lr->nhl", qp[q0:q0 + n].double(), r[:, D_CKV:])) * sm
        s = s.masked_fill(torch.arange(L)[None, None, :] > torch.arange(L - n, L)[:, None, None], float("-inf"))
        ref[q0:q0 + n] = torch.einsum("nhl,lc->nhc", torch.softmax(s, -1), r[:, :D_CKV])
        q0 += n
    out = torch.full((T, H, D_CKV), float("nan"), device=DEV)
    indptr = torch.tensor([0, 3, 4], dtype=torch.int32, device=DEV)
    mla_extend(qn.to(DEV), qp.to(DEV), kv.to(DEV), pt.to(DEV), indptr, torch.tensor(kv_lens, dtype=torch.int32,
               device=DEV), sm, out, max_q_len=3, block_m=16, block_h=16, block_n=16, kv_scale=scale)
    assert _rel(out, ref) < 1e-4


def test_sparse_decode_reads_fp8_cache():
    g, scale, H, T, K = _gen(3), 0.8, 3, 2, 40
    rows = (torch.randn(50, D_CKV + D_PE, generator=g) * 2).to(FP8)
    locs = torch.randint(0, 50, (T, K), generator=g, dtype=torch.int32)
    locs[1, 30:] = -1
    qn, qp = torch.randn(T, H, D_CKV, generator=g), torch.randn(T, H, D_PE, generator=g)
    sm = 1 / math.sqrt(D_CKV + D_PE)
    ref = sparse_mla_decode_reference(qn.double(), qp.double(), rows, locs, sm, kv_scale=scale).double()
    r64 = rows.double() * scale
    s0 = (qn[0].double() @ r64[locs[0].long(), :D_CKV].T + qp[0].double() @ r64[locs[0].long(), D_CKV:].T) * sm
    want0 = torch.softmax(s0, -1) @ r64[locs[0].long(), :D_CKV]
    assert _rel(ref[0], want0) < 1e-6  # the torch reference dequantizes like the kernels
    out = sparse_mla_decode(qn.to(DEV), qp.to(DEV), rows.to(DEV), locs.to(DEV), sm, block_h=16, block_n=16,
                            target_programs=2, min_entries_per_split=16, kv_scale=scale)
    assert _rel(out, ref) < 1e-4


# ------------------------------------------------------------------------------------ config and parity
import containers  # noqa: E402
from runtime.app.parity import compare, quantization_effect, reference_config, unquantized_config  # noqa: E402
from runtime.app.validation import validate  # noqa: E402
from runtime.core.device import DeviceInfo  # noqa: E402
from tests.conftest import compose_config  # noqa: E402

_CPU = DeviceInfo("cpu", "cpu", 0, False, None, "cpu")
_H100 = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "H100")
_A100 = DeviceInfo("cuda", "cuda", 0, True, (8, 0), "A100")


def _problems(device, *overrides):
    plain = containers.to_plain(compose_config(*overrides))
    return [str(p) for p in validate(plain, containers.BACKENDS, device, package_present=lambda n: True)]


def test_fp8_config_refusals_name_what_works():
    fi = "backend=flashinfer_mla"
    assert not [p for p in _problems(_H100, fi, "model.dtype=bfloat16", "kv.dtype=fp8_e4m3") if "kv." in p]
    (a100,) = [p for p in _problems(_A100, fi, "model.dtype=bfloat16", "kv.dtype=fp8_e4m3") if "kv.dtype" in p]
    assert "compute capability 9.x" in a100 and "triton_mla" in a100 and "torch_mla" in a100
    (fp16,) = [p for p in _problems(_H100, fi, "model.dtype=float16", "kv.dtype=fp8_e4m3") if "kv.dtype" in p]
    assert "bfloat16" in fp16 and "flashinfer_mla" not in fp16.split("Fix")[0].split("expected")[1]
    (scale,) = [p for p in _problems(_CPU, "kv.scale=0") if "kv.scale" in p]
    assert "positive" in scale
    hs = _problems(_CPU, "backend=dsa", "model=tiny_dsa", "hisparse=dsa_tiny", "kv.dtype=fp8_e4m3")
    assert any("hisparse" in p and "kv.dtype=fp8_e4m3" in p for p in hs)
    assert not [p for p in _problems(_CPU, "kv.dtype=fp8_e4m3") if "kv." in p]


def test_unknown_kv_dtype_fails_at_compose():
    with pytest.raises(Exception, match="fp4"):
        compose_config("kv.dtype=fp4")


def test_torch_reference_with_fp8_cache_parity_and_quantization_effect():
    plain = containers.to_plain(compose_config(
        "model.dtype=bfloat16", "kv.dtype=fp8_e4m3", "kv.scale=0.125", "workload.num_requests=2",
        "workload.prompt_len.max=24", "workload.output_len.max=4", "progress=false"))
    rt = containers.build(plain)
    res = rt.engine.run(record_hidden=True)
    stats = rt.container.kv_pool().quant_stats()
    assert stats["cache_dtype"] == "float8_e4m3fn" and stats["values_written"] > 0
    assert rt.container.kv_pool().nbytes * 2 == containers.build(unquantized_config(plain)).container.kv_pool().nbytes
    ref_cfg = reference_config(plain)
    assert ref_cfg["kv"]["dtype"] == "fp8_e4m3"  # the reference reads the same fp8 cache
    ref = containers.build(ref_cfg).engine.run(forced=res.outputs)
    par = compare(res, ref, "bfloat16")
    assert par.ok, par
    unq = containers.build(unquantized_config(plain)).engine.run(forced=res.outputs)
    m = rt.container.model()
    q = quantization_effect(res, unq, lambda h: m.logits(h.to(m.device, m.spec.dtype)))
    assert q["positions"] > 0 and 0.0 <= q["token_agreement"] <= 1.0
    assert 0.0 < q["logit_max_rel_err"] < 0.2  # fp8 changes the logits, but only a little
