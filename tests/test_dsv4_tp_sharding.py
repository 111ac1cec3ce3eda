"""DeepSeek-V4 weights under tensor parallelism: every rank's slices put back together are the tp=1 tensors, for
the seeded weights (drawn whole, then cut), a checkpoint saved by transformers and DeepSeek's release format (fp8
block-scaled matrices whose cuts do not fall on the 128 x 128 blocks, fp4 experts cut inside a 32-input scale
group), with moe=tp and moe=ep; and the ranks' partial attention-output and MoE sums add up to the one-rank
outputs (what the all-reduces do)."""

from __future__ import annotations

import pytest
import torch
from dsv4_harness import randomize_, tiny_hf_config

from runtime.core.parallel import ONE_RANK, Sharding
from runtime.model.deepseek.checkpoint import TensorInfo, _Reader
from runtime.model.deepseek.ops import TorchOps
from runtime.model.deepseek.sharding import ALL
from runtime.model.dsv4.checkpoint import expected_tensors, load_dsv4_checkpoint, random_dsv4_weights
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.layer import grouped_output
from runtime.model.dsv4.moe import moe_forward
from runtime.model.dsv4.sharding import dsv4_tensor_cut, rank_config
from runtime.model.dsv4.stored import StoredFormat
from runtime.model.dsv4.weights import ModelWeights
from runtime.model.quantized import ScaledTensor, StoredKind, dequantize_fp4

pytest.importorskip("transformers")
from dsv4_release import fp4_rows, stored_scale, write_release  # noqa: E402
from transformers import DeepseekV4ForCausalLM  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
TP = {"n_routed_experts": 6, "vocab_size": 98}  # even expert and vocabulary counts (the harness has 5 and 97)


def config(**over) -> DSV4Config:
    return DSV4Config.from_hf_config(tiny_hf_config(**{**TP, **over}).to_dict())


def _cat(parts: list[torch.Tensor], full: torch.Tensor, dim: int = 0) -> bool:
    return torch.equal(torch.cat(parts, dim=dim), full)


def _same(parts: list, full) -> bool:
    """Replicated: every rank's tensor (or list of tensors) equals the whole one."""
    if isinstance(full, torch.Tensor):
        return all(torch.equal(p, full) for p in parts)
    return all(torch.equal(a, b) for p in parts for a, b in zip(p, full, strict=True))


def assert_reassembles(full: ModelWeights, ranks: list[ModelWeights], cfg: DSV4Config, moe: str) -> None:
    """Rank slices, concatenated as the sharding cut them, equal the whole tensors; replicated ones are equal."""
    assert _cat([r.embed_tokens for r in ranks], full.embed_tokens) and _cat([r.lm_head for r in ranks], full.lm_head)
    assert [r.vocab_start for r in ranks] == [0, cfg.vocab_size // 2]
    assert _same([r.norm for r in ranks], full.norm) and _same([r.hc_head.tensors for r in ranks], full.hc_head.tensors)
    for i, lw in enumerate(full.layers):
        a, m = [r.layers[i].attn for r in ranks], [r.layers[i].mlp for r in ranks]
        assert _cat([x.q_b_proj for x in a], lw.attn.q_b_proj) and _cat([x.sinks for x in a], lw.attn.sinks)
        assert _cat([x.o_a_proj for x in a], lw.attn.o_a_proj) and _cat([x.o_b_proj for x in a], lw.attn.o_b_proj, 1)
        for f in ("q_a_proj", "q_a_norm", "kv_proj", "kv_norm"):  # the shared KV row: replicated
            assert _same([getattr(x, f) for x in a], getattr(lw.attn, f)), f
        for part in ("compressor", "indexer"):
            if getattr(lw.attn, part) is not None:
                assert _same([getattr(x, part).tensors for x in a], getattr(lw.attn, part).tensors), part
        routing = "tid2eid" if lw.mlp.tid2eid is not None else "e_score_correction_bias"
        assert _same([x.gate for x in m], lw.mlp.gate) and _same([getattr(x, routing) for x in m],
                                                                 getattr(lw.mlp, routing))
        assert _cat([x.shared_gate_proj for x in m], lw.mlp.shared_gate_proj)
        assert _cat([x.shared_up_proj for x in m], lw.mlp.shared_up_proj)
        assert _cat([x.shared_down_proj for x in m], lw.mlp.shared_down_proj, 1)
        if moe == "ep":
            assert _cat([x.gate_up_proj for x in m], lw.mlp.gate_up_proj)
            assert _cat([x.down_proj for x in m], lw.mlp.down_proj)
            assert [x.first_expert for x in m] == [0, cfg.n_routed_experts // 2]
        else:
            im = cfg.moe_intermediate_size // 2
            gate = torch.cat([x.gate_up_proj[:, :im] for x in m], dim=1)
            up = torch.cat([x.gate_up_proj[:, im:] for x in m], dim=1)
            assert _cat([gate, up], lw.mlp.gate_up_proj, 1) and _cat([x.down_proj for x in m], lw.mlp.down_proj, 2)
        for f in ("input_layernorm", "post_attention_layernorm"):
            assert _same([getattr(r.layers[i], f) for r in ranks], getattr(lw, f)), f


def test_cut_table():
    cfg = config()
    r1 = Sharding(1, 2, "tp")
    shapes = expected_tensors(cfg)

    def cut(name):
        return dsv4_tensor_cut(name, shapes[name], cfg, r1)

    a, hd, rank = "model.layers.1.self_attn.", cfg.attention.head_dim, cfg.o_lora_rank
    assert cut(a + "q_b_proj.weight").pieces == ((slice(2 * hd, 4 * hd),),)  # heads 2, 3 of 4
    assert cut(a + "sinks").pieces == ((slice(2, 4),),)
    assert cut(a + "o_a_proj.weight").pieces == ((slice(rank, 2 * rank), ALL),)  # group 1 of 2: heads 2, 3
    assert cut(a + "o_b_proj.weight").pieces == ((ALL, slice(rank, 2 * rank)),)
    for name in ("kv_proj.weight", "q_a_proj.weight", "compressor.gate_proj.weight", "compressor.kv_proj.weight",
                 "compressor.indexer.q_b_proj.weight", "compressor.indexer.gate_proj.weight"):
        assert cut(a + name).replicated, name  # the compressors' gate_proj is not an MLP's
    m = "model.layers.1.mlp."
    assert cut(m + "gate.weight").replicated and cut(m + "gate.e_score_correction_bias").replicated
    assert dsv4_tensor_cut("model.layers.0.mlp.gate.tid2eid", shapes["model.layers.0.mlp.gate.tid2eid"], cfg,
                           r1).replicated
    assert cut(m + "shared_experts.down_proj.weight").pieces == ((ALL, slice(8, 16)),)
    assert cut(m + "experts.gate_up_proj").pieces == ((ALL, slice(8, 16)), (ALL, slice(24, 32)))
    ep = Sharding(1, 2, "ep")
    assert dsv4_tensor_cut(m + "experts.2.up_proj.weight", (16, 32), cfg, ep) is None
    assert dsv4_tensor_cut(m + "experts.3.up_proj.weight", (16, 32), cfg, ep).replicated
    assert cut("model.embed_tokens.weight").pieces == ((slice(49, 98),),)
    local = rank_config(cfg, 2)
    assert (local.attention.num_heads, local.o_groups, local.attention.index_n_heads) == (2, 1, 8)
    one = config(o_groups=1)  # tp a multiple of o_groups: both ranks share the group, each its heads' columns
    w = 4 * hd
    assert dsv4_tensor_cut(a + "o_a_proj.weight", (rank, w), one, r1).pieces == ((slice(0, rank), slice(w // 2, w)),)
    assert dsv4_tensor_cut(a + "o_b_proj.weight", (32, rank), one, r1).pieces == ((ALL, slice(0, rank)),)
    assert rank_config(one, 2).o_groups == 1


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_seeded_weights_of_two_ranks_are_the_one_rank_weights(moe):
    cfg = config()
    full = random_dsv4_weights(cfg, 7, torch.float32, CPU)
    ranks = [random_dsv4_weights(cfg, 7, torch.float32, CPU, Sharding(r, 2, moe)) for r in range(2)]
    assert_reassembles(full, ranks, cfg, moe)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A transformers-saved folder (per-expert tensors, float32) and a release folder (fp8 / fp4)."""
    plain = tmp_path_factory.mktemp("v4_tp_plain")
    model = DeepseekV4ForCausalLM(tiny_hf_config(**TP)).eval()
    randomize_(model, 5)
    model.save_pretrained(plain)
    release = tmp_path_factory.mktemp("v4_tp_release")
    stored, ref = write_release(release, **TP)
    return {"plain": (plain, StoredFormat(), DSV4Config.from_hf_config(model.config.to_dict())),
            "release": (release, StoredFormat((128, 128), "fp4"), DSV4Config.from_hf_config(ref.config.to_dict()),
                        stored)}


@pytest.mark.parametrize("moe", ["tp", "ep"])
@pytest.mark.parametrize("kind", ["plain", "release"])
def test_checkpoint_slices_are_the_full_loads_slices(kind, moe, saved):
    folder, fmt, cfg = saved[kind][:3]
    full = load_dsv4_checkpoint(cfg, folder, fmt, torch.float32, CPU, ONE_RANK)
    ranks = [load_dsv4_checkpoint(cfg, folder, fmt, torch.float32, CPU, Sharding(r, 2, moe)) for r in range(2)]
    assert_reassembles(full, ranks, cfg, moe)
    if kind == "release":
        stored = saved[kind][3]
        # fp8 cuts inside one 128 x 128 block: o_a_proj [16, 128] rows 8.., o_b_proj [64, 16] columns 8..,
        # the shared expert's gate [32, 64] rows 16..; fp4 experts' down_proj [64, 32] columns 16.. (moe=tp)
        w, s = stored["layers.2.attn.wo_a.weight"]
        assert w.dtype == torch.float8_e4m3fn and tuple(w.shape) == (16, 128) and tuple(s.shape) == (1, 1)
        assert ranks[1].layers[2].attn.o_a_proj.shape == (8, 128)
        assert stored["layers.1.ffn.experts.1.w2.weight"][0].dtype == torch.float4_e2m1fn_x2  # the F4 one
        assert ranks[0].stored_dtypes.get("F8_E4M3", 0) > 0
        if moe == "ep":  # the other rank's experts are never read
            assert ranks[0].stored_dtypes["I8"] + ranks[0].stored_dtypes.get("F4", 0) < \
                full.stored_dtypes["I8"] + full.stored_dtypes["F4"]


@pytest.mark.parametrize("dtype", ["I8", "F4"])
def test_fp4_pieces_at_odd_columns_inside_a_scale_group(dtype, tmp_path):
    """The reader takes the bytes that hold the piece (a piece may start or end inside a byte) and the per-32
    scales that cover it; F4 tensors (which safetensors cannot slice) are read whole and cut."""
    from safetensors.torch import save_file

    packed, e = fp4_rows(torch.randn(5, 96, generator=torch.Generator().manual_seed(1)))
    scale = stored_scale(e, "e8m0")
    path = tmp_path / "w.safetensors"
    stored = packed.clone().view(torch.float4_e2m1fn_x2) if dtype == "F4" else packed
    save_file({"w": stored, "w.scale": scale}, str(path))
    shape = (5, 96) if dtype == "F4" else (5, 48)
    index = {"w": TensorInfo(path, dtype, shape), "w.scale": TensorInfo(path, "F8_E8M0", (5, 3))}
    reader = _Reader(index, CPU, torch.float32, {"w": ScaledTensor(StoredKind.fp4, "w.scale", (1, 32))})
    full = dequantize_fp4(packed, scale, torch.float32)
    from runtime.model.deepseek.sharding import Cut

    for rows, cols in [(slice(None), slice(7, 61)), (slice(1, 4), slice(48, 96)), (slice(2, 3), slice(33, 34))]:
        assert torch.equal(reader.get("w", cut=Cut(((rows, cols),))), full[rows, cols]), (rows, cols)
    reader.close()


@pytest.mark.parametrize("moe,groups", [("tp", 2), ("ep", 2), ("tp", 1)])
def test_partial_outputs_of_two_ranks_sum_to_one_ranks(moe, groups):
    """What the two all-reduces of a layer add: the grouped output projection of each rank's heads (its o_a_proj
    groups and o_b_proj columns; with one group, its heads' o_a_proj columns of the shared group), and each rank's
    MoE (its experts or expert width, its shared-expert slice)."""
    cfg = config(mlp_layer_types=["hash_moe", "moe", "moe", "moe"], o_groups=groups)
    full = random_dsv4_weights(cfg, 3, torch.float64, CPU)
    ranks = [random_dsv4_weights(cfg, 3, torch.float64, CPU, Sharding(r, 2, moe)) for r in range(2)]
    g = torch.Generator().manual_seed(4)
    t, h, d = 9, cfg.attention.num_heads, cfg.attention.head_dim
    o = torch.randn(t, h, d, generator=g, dtype=torch.float64)
    w = full.layers[1].attn
    want = grouped_output(o, w.o_a_proj, w.o_b_proj, cfg.o_groups, TorchOps())
    local = rank_config(cfg, 2).o_groups
    got = sum(grouped_output(o[:, r * h // 2:(r + 1) * h // 2], x.layers[1].attn.o_a_proj, x.layers[1].attn.o_b_proj,
                             local, TorchOps()) for r, x in enumerate(ranks))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    x = torch.randn(t, cfg.hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    for layer in (0, 1):  # hash routing, then bias-corrected top-k
        want = moe_forward(full.layers[layer].mlp, x, ids, cfg, TorchOps())
        got = sum(moe_forward(r.layers[layer].mlp, x, ids, cfg, TorchOps()) for r in ranks)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
