"""DeepSeek-V4 pieces against transformers' DeepseekV4 modules (float64, tiny random model, odd sizes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dsv4_harness import tiny_pair
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from backends.kernels.dsv4.dsv4_reference import indexer_topk, sink_attention
from runtime.core.dsv4_pools import CompressedKVPool, CompressorStatePool
from runtime.core.dsv4_spec import DSV4AttentionSpec, DSV4LayerType
from runtime.model.deepseek.ops import TorchOps
from runtime.model.deepseek.rope import apply_rope_tail, cos_sin, inv_freq
from runtime.model.dsv4.compressor import compress_decode, compress_step
from runtime.model.dsv4.hyper import hc_head, hc_pre
from runtime.model.dsv4.moe import moe_forward

S = 19  # crosses 9 CSA windows (rate 2) and 4 HCA windows (rate 4), with a partial window left over


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(seed=3)


def _close(got, want, rtol=1e-5):
    assert not torch.isnan(got).any()
    err = (got - want).abs().max() / want.abs().max().clamp_min(1e-12)
    assert err < rtol, f"relative error {err:.3g}"


def test_spec_from_hf_and_legacy_ratios(pair):
    _, cfg, _ = pair
    spec = cfg.attention
    assert spec.layer_types[:3] == (DSV4LayerType.hca, DSV4LayerType.csa, DSV4LayerType.sliding)
    assert (spec.csa_rate, spec.hca_rate, spec.rope_dim, spec.sliding_window) == (2, 4, 4, 5)
    legacy = DSV4AttentionSpec.from_hf_config(dict(
        num_attention_heads=4, head_dim=16, qk_rope_head_dim=4, sliding_window=5, num_hidden_layers=3,
        compress_ratios=[0, 4, 128], index_n_heads=2, index_head_dim=8, index_topk=3))
    assert legacy.layer_types == (DSV4LayerType.sliding, DSV4LayerType.csa, DSV4LayerType.hca)
    assert [legacy.rate_of(i) for i in range(3)] == [0, 4, 128]


def test_rope_default_and_yarn_frequencies(pair):
    ref, cfg, _ = pair
    rot = ref.model.rotary_emb
    rd = cfg.attention.rope_dim
    _close(inv_freq(cfg.rope_main, rd), rot.main_inv_freq.double(), 1e-6)
    yarn = inv_freq(cfg.rope_compress, rd)
    _close(yarn, rot.compress_inv_freq.double(), 1e-6)
    # the premise: YaRN really changed something (interpolated low frequencies)
    assert not torch.allclose(yarn, 1.0 / cfg.rope_compress.theta ** (torch.arange(0, rd, 2).double() / rd))
    pos = torch.tensor([0, 3, 17])
    x = torch.randn(3, 2, 16, dtype=torch.float64)
    cos, sin = cos_sin(cfg.rope_compress, rd, pos, x.dtype)
    hc, hs = rot(x, position_ids=pos[None], layer_type="compress")
    want = hf.apply_rotary_pos_emb(x[None].transpose(1, 2), hc, hs).transpose(1, 2)[0]
    _close(apply_rope_tail(x, cos, sin), want, 1e-6)
    _close(apply_rope_tail(apply_rope_tail(x, cos, sin), cos, -sin), x, 1e-6)


@pytest.mark.parametrize("layer_id,pieces", [(0, [19]), (0, [3, 1, 1, 6, 8]), (1, [1] * 19), (1, [5, 2, 12])])
def test_compressor_matches_reference(pair, layer_id, pieces):
    """HCA (layer 0) and CSA (layer 1, overlapping windows) entries, fed at once or in pieces."""
    ref, cfg, w = pair
    g = torch.Generator().manual_seed(layer_id)
    x = torch.randn(S, cfg.hidden_size, generator=g, dtype=torch.float64)
    q_res = torch.randn(S, cfg.q_lora_rank, generator=g, dtype=torch.float64)
    module = ref.model.layers[layer_id].self_attn.compressor
    with torch.no_grad():
        want = module(x[None], q_res[None], torch.arange(S)[None], None, layer_id)[0][0, 0]
    comp = w.layers[layer_id].attn.compressor
    rate = cfg.attention.rate_of(layer_id)
    width, d = comp.kv_proj.shape[0], comp.kv_norm.shape[0]
    state = CompressorStatePool([layer_id], 2, rate, width, d if width == 2 * d else 0, torch.device("cpu"),
                                torch.float64)
    got, start = [], 0
    for n in pieces:
        xs = x[start:start + n]
        first, ent = compress_step(F.linear(xs, comp.kv_proj), F.linear(xs, comp.gate_proj), comp.position_bias,
                                   comp.kv_norm, cfg.rms_norm_eps, state, layer_id, 1, start)
        assert first == len(got) and ent.shape[0] == (start + n) // rate - start // rate
        pos = (first + torch.arange(ent.shape[0])) * rate
        got += list(apply_rope_tail(ent, *cos_sin(cfg.rope_compress, cfg.attention.rope_dim, pos, ent.dtype)))
        start += n
    assert len(got) == S // rate == want.shape[0]
    _close(torch.stack(got), want)


@pytest.mark.parametrize("layer_id,dtype", [(0, torch.float64), (1, torch.float64), (1, torch.bfloat16)])
def test_batched_decode_compressor_equals_per_request(pair, layer_id, dtype):
    """compress_decode over a batch (requests at different positions, a prefill chunk first for some) gives, for
    every request whose window closed, exactly compress_step's entry, and leaves the same state behind."""
    _, cfg, w = pair
    comp = w.layers[layer_id].attn.compressor
    kv_proj, gate_proj, bias, norm = (t.to(dtype) for t in (comp.kv_proj, comp.gate_proj, comp.position_bias,
                                                            comp.kv_norm))
    rate = cfg.attention.rate_of(layer_id)
    width, d = kv_proj.shape[0], norm.shape[0]
    sdt = torch.float64 if dtype == torch.float64 else torch.float32

    def pool():
        return CompressorStatePool([layer_id], 5, rate, width, d if width == 2 * d else 0, torch.device("cpu"), sdt)

    one, many = pool(), pool()
    g = torch.Generator().manual_seed(7)
    prefill = {1: 0, 2: 5, 4: 1}  # row -> prompt tokens fed before decoding (0: decode from the first token)
    pos = {}
    for row, n in prefill.items():
        if n:
            x = torch.randn(n, cfg.hidden_size, generator=g, dtype=torch.float64).to(dtype)
            for st in (one, many):
                compress_step(F.linear(x, kv_proj), F.linear(x, gate_proj), bias, norm, cfg.rms_norm_eps, st,
                              layer_id, row, 0)
        pos[row] = n
    rows = list(prefill)
    closed = 0
    for _ in range(2 * rate + 3):
        x = torch.randn(len(rows), cfg.hidden_size, generator=g, dtype=torch.float64).to(dtype)
        kv, gate = F.linear(x, kv_proj), F.linear(x, gate_proj)
        got = compress_decode(kv, gate, bias, norm, cfg.rms_norm_eps, many, layer_id, torch.tensor(rows),
                              torch.tensor([pos[r] for r in rows]))
        for b, row in enumerate(rows):
            first, want = compress_step(kv[b:b + 1], gate[b:b + 1], bias, norm, cfg.rms_norm_eps, one, layer_id,
                                        row, pos[row])
            if want.shape[0]:
                assert first == pos[row] // rate and (pos[row] + 1) % rate == 0
                assert torch.equal(got[b], want[0])
                closed += 1
            pos[row] += 1
    assert closed >= 2 * len(rows)
    for name in ("prev_kv", "prev_gate"):
        if getattr(one, name) is not None:
            assert torch.equal(getattr(one, name)[:, rows], getattr(many, name)[:, rows])
    for row in rows:  # the live part of the partial window
        held = pos[row] % rate
        assert torch.equal(many.pending_kv[0, row, :held], one.pending_kv[0, row, :held])


def test_decode_candidates_never_overwrite_a_closed_entry():
    """write_candidates: a closed window's entry lands in its slot; a partial candidate goes to its open entry's
    slot or, past the table or a page, to the padding page: no closed entry of any request is touched."""
    pool = CompressedKVPool(4, [0], {"kv": 2}, num_pages=6, page_size=2, max_requests=3, max_entries=3,
                            dtype=torch.float32, device=torch.device("cpu"))
    for row, tokens in ((0, 12), (1, 5), (2, 0)):
        pool.open(row)
        pool.reserve(row, tokens)
        n = pool.entries_for(tokens)
        pool.write(0, "kv", row, 0, torch.full((n, 2), 10.0 * (row + 1)) + torch.arange(n)[:, None])
    before = {r: pool.gather(0, "kv", r, pool.entries_for(t)).clone() for r, t in ((0, 12), (1, 5))}
    # row 0 at position 12 (entry 3: past the 3-entry table), row 1 at 6 (entry 1: open, page held), row 2 at
    # 3 (closes entry 0, but it has no page: the table says slot 0, the padding page), padding row 3
    pool.write_candidates(0, "kv", torch.tensor([0, 1, 2, 3]), torch.tensor([3, 1, 0, 0]), torch.full((4, 2), -1.0))
    for r, want in before.items():
        assert torch.equal(pool.gather(0, "kv", r, want.shape[0]), want)
    pool.reserve(1, 8)  # entry 1 of row 1 closes: its candidate is real
    pool.write_candidates(0, "kv", torch.tensor([1]), torch.tensor([1]), torch.full((1, 2), 7.0))
    assert torch.equal(pool.gather(0, "kv", 1, 2), torch.tensor([[20.0, 20.0], [7.0, 7.0]]))


def test_indexer_topk_matches_reference(pair):
    ref, cfg, w = pair
    spec = cfg.attention
    g = torch.Generator().manual_seed(7)
    x = torch.randn(S, cfg.hidden_size, generator=g, dtype=torch.float64)
    q_res = torch.randn(S, cfg.q_lora_rank, generator=g, dtype=torch.float64)
    pos = torch.arange(S)
    module = ref.model.layers[1].self_attn.compressor.indexer
    with torch.no_grad():
        want = module(x[None], q_res[None], pos[None], None, 1)[0]
    idx = w.layers[1].attn.indexer
    state = CompressorStatePool([1], 1, spec.csa_rate, 2 * spec.index_head_dim, spec.index_head_dim,
                                torch.device("cpu"), torch.float64)
    first, keys = compress_step(F.linear(x, idx.kv_proj), F.linear(x, idx.gate_proj), idx.position_bias, idx.kv_norm,
                                cfg.rms_norm_eps, state, 1, 0, 0)
    cos, sin = cos_sin(cfg.rope_compress, spec.rope_dim, torch.arange(keys.shape[0]) * spec.csa_rate, keys.dtype)
    keys = apply_rope_tail(keys, cos, sin)
    hi, di = spec.index_n_heads, spec.index_head_dim
    qc, qs = cos_sin(cfg.rope_compress, spec.rope_dim, pos, x.dtype)
    iq = apply_rope_tail(F.linear(q_res, idx.q_b_proj).view(S, hi, di), qc, qs)
    iw = torch.nn.functional.linear(x, idx.weights_proj) * (hi**-0.5 * di**-0.5)
    got = indexer_topk(iq, iw, keys, pos, spec.csa_rate, spec.index_topk)
    # the premise: no near-tie at any query's top-k boundary (else either pick would be right)
    scores = (torch.relu(torch.einsum("nhd,ed->nhe", iq, keys)) * iw[:, :, None]).sum(1)
    for t in range(S):
        vis = scores[t, : (t + 1) // spec.csa_rate].sort(descending=True).values
        if vis.numel() > spec.index_topk:
            assert vis[spec.index_topk - 1] - vis[spec.index_topk] > 1e-9
    assert (want >= 0).sum() > S  # the test sees real selections
    for t in range(S):
        assert sorted(got[t].tolist()) == sorted(want[t].tolist()), t


def test_sink_attention_matches_eager():
    g = torch.Generator().manual_seed(5)
    h, n, length, d = 3, 7, 11, 16
    q = torch.randn(1, h, n, d, generator=g, dtype=torch.float64)
    kv = torch.randn(1, 1, length, d, generator=g, dtype=torch.float64)
    visible = torch.rand(n, length, generator=g) > 0.4
    visible[2] = False  # a query that sees nothing: all mass on the sink, output 0
    sinks = torch.randn(h, generator=g, dtype=torch.float64)
    stub = torch.nn.Module()
    stub.num_key_value_groups, stub.sinks = h, sinks
    mask = torch.zeros(n, length, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    want = hf.eager_attention_forward(stub, q, kv, kv, mask[None, None], scaling=d**-0.5)[0][0]
    split = 4  # two parts (like window + compressed) must equal one joint softmax
    parts = [(kv[0, 0, :split], visible[:, :split]), (kv[0, 0, split:][None].expand(n, -1, -1), visible[:, split:])]
    got = sink_attention(q[0].transpose(0, 1), parts, sinks, d**-0.5)
    _close(got, want)
    assert got[2].abs().max() == 0


def test_mhc_and_head_match_reference(pair):
    ref, cfg, w = pair
    g = torch.Generator().manual_seed(11)
    streams = torch.randn(7, cfg.hc_mult, cfg.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        post_r, comb_r, coll_r = ref.model.layers[2].attn_hc(streams[None])
        head_r = ref.model.hc_head(streams[None])[0]
    post, comb, coll = hc_pre(w.layers[2].attn_hc, streams, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    _close(post, post_r[0].double())
    _close(comb, comb_r[0].double())
    _close(coll, coll_r[0])
    assert (comb.sum(-2) - 1).abs().max() < 1e-5  # Sinkhorn ends on a column normalisation
    _close(hc_head(w.hc_head, streams, cfg.hc_eps, cfg.rms_norm_eps), head_r)


@pytest.mark.parametrize("layer_id", [0, 1])  # hash MoE, routed (sqrtsoftplus + correction bias)
def test_moe_matches_reference(pair, layer_id):
    ref, cfg, w = pair
    g = torch.Generator().manual_seed(13 + layer_id)
    x = 3 * torch.randn(9, cfg.hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=g)
    with torch.no_grad():
        want = ref.model.layers[layer_id].mlp(x[None], input_ids=ids[None])[0]
    mw = w.layers[layer_id].mlp
    gate = torch.nn.functional.linear(x, mw.gate_up_proj[0]).chunk(2, -1)[0]
    assert (gate > cfg.swiglu_limit).any()  # the premise: swiglu_limit clamps something
    _close(moe_forward(mw, x, ids, cfg, TorchOps()), want)
