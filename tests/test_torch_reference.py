"""The torch reference backend against an independent float64 computation, and its MHA path against
its absorbed path for the same layer weights."""

from __future__ import annotations

import pytest
import torch
from mla_harness import make_harness, oracle_absorbed, random_batch, random_q, rel_err, spec

from backends.torch_mla import TorchMLABackend
from runtime.core.batch import ForwardMode
from runtime.core.prefix_chunks import plan_prefix_chunks

CASES = [
    # (prefix lens, extend lens): decode, prefill, extend over a prefix, odd and page-boundary lengths
    ([0], [1]),
    ([0], [7]),
    ([0, 0, 0], [63, 64, 65]),
    ([6], [1]),
    ([62, 63, 64, 0], [1, 1, 1, 1]),
    ([0, 5, 64], [7, 3, 65]),
    ([100], [28]),
]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("prefix_lens,extend_lens", CASES)
@pytest.mark.parametrize("compute_dtype", ["float32", "float64"])
def test_absorbed_matches_float64_oracle(page_size, prefix_lens, extend_lens, compute_dtype):
    gen = torch.Generator().manual_seed(hash((page_size, tuple(prefix_lens), tuple(extend_lens))) % 2**31)
    dtype = torch.float64 if compute_dtype == "float64" else torch.float32
    h = make_harness(page_size, num_pages=4096 // page_size + 8, dtype=dtype)
    s = spec(heads=3)
    be = TorchMLABackend(h.req_to_token, h.kv, s, compute_dtype)
    batch, slots = random_batch(h, prefix_lens, extend_lens, gen)
    q_nope, q_pe = random_q(batch, 3, gen, h.device, dtype)
    be.init_forward_metadata(batch)
    fwd = be.forward_decode if batch.mode == ForwardMode.DECODE else be.forward_extend
    out = fwd(q_nope, q_pe, 0, batch)
    ref = oracle_absorbed(h, batch, slots, q_nope, q_pe, s.sm_scale)
    assert out.shape == ref.shape
    assert rel_err(out, ref) < (1e-5 if compute_dtype == "float32" else 1e-12)


def _mha_via_hook(be, h, batch, q, kv_rows_new, decompress, chunk_tokens):
    """Run the MHA chunked-prefix path the way runtime/model/mla_model.py does."""
    batch.prefix_chunks = plan_prefix_chunks(batch, h.req_to_token, chunk_tokens)
    be.init_mha_chunk_metadata(batch)
    k, v = decompress(kv_rows_new)
    out, lse = be.forward_mha_extend(q, k, v, 0, batch)
    for i, chunk in enumerate(batch.prefix_chunks):
        k_c, v_c = decompress(h.kv.gather(0, chunk.kv_slots))
        out, lse = be.merge_states(out, lse, *be.forward_mha_prefix_chunk(q, k_c, v_c, i, 0, batch))
    return out, len(batch.prefix_chunks)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("prefix_lens,extend_lens,chunk_tokens", [
    ([0], [9], 4),
    ([37], [5], 8),
    ([0, 20, 64, 3], [7, 1, 5, 12], 16),
    ([130, 1], [2, 65], 64),
])
def test_mha_chunked_prefill_equals_absorbed(page_size, prefix_lens, extend_lens, chunk_tokens):
    """Same layer weights (random W_UK / W_UV): decompressed MHA with prefix chunks == absorbed MLA."""
    gen = torch.Generator().manual_seed(7)
    heads, nope, vdim = 2, 128, 128
    h = make_harness(page_size, num_pages=2048 // page_size + 16, dtype=torch.float64)
    s = spec(heads=heads)
    be = TorchMLABackend(h.req_to_token, h.kv, s, "float64")
    batch, slots = random_batch(h, prefix_lens, extend_lens, gen, mode=ForwardMode.EXTEND)
    w_uk = torch.randn(heads, nope, 512, generator=gen, dtype=torch.float64) / 512**0.5
    w_uv = torch.randn(heads, 512, vdim, generator=gen, dtype=torch.float64) / 512**0.5
    q_nope = torch.randn(batch.num_tokens, heads, nope, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(batch.num_tokens, heads, 64, generator=gen, dtype=torch.float64)

    def decompress(rows):
        rows = rows.double()
        ckv, kpe = rows[:, :512], rows[:, 512:]
        k = torch.cat([torch.einsum("nc,hdc->nhd", ckv, w_uk), kpe[:, None].expand(-1, heads, -1)], -1)
        return k, torch.einsum("nc,hcd->nhd", ckv, w_uv)

    new_rows = torch.cat([h.kv.gather(0, sl[p:]) for sl, p in zip(slots, prefix_lens)])
    mha, n_chunks = _mha_via_hook(be, h, batch, torch.cat([q_nope, q_pe], -1), new_rows, decompress, chunk_tokens)
    assert n_chunks == (0 if max(prefix_lens) == 0 else -(-max(prefix_lens) // max(1, chunk_tokens // sum(p > 0 for p in prefix_lens))))

    be.init_forward_metadata(batch)
    lat = be.forward_extend(torch.einsum("thd,hdc->thc", q_nope, w_uk), q_pe, 0, batch)
    absorbed = torch.einsum("thc,hcd->thd", lat, w_uv)
    assert rel_err(mha, absorbed) < 1e-10
