"""``model.shared_expert_fusion``: the shared expert stacked after the routed experts (one storage, views), so the
fused ops' block-fp8 grouped GEMMs take it as one more group at 33-128 tokens instead of products of its own.

On the CPU the kernels run in Triton's interpreter at tiny sizes: the dispatch's extra group, the fused MoE over
the stack against the same weights unstacked (block-fp8 W8A8; 16-bit experts, their grouped GEMM emulated, keep
the shared expert's products), which row counts take it, and the layout of the presets and of a loaded checkpoint
(same values as unstacked, bytes counted once).
"""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from test_decoder_ops import REF, _close, _grouped_mm_emulated, _spec
from test_stored_weights import ALIGNED, CPU, spec_of
from triton_env import DEV

from containers import to_plain
from runtime.app.make_checkpoint import main as make_checkpoint
from runtime.app.memory_estimate import weight_bytes
from runtime.core.model_spec import ModelSpec
from runtime.core.parallel import Sharding
from runtime.model.deepseek.checkpoint import load_checkpoint
from runtime.model.deepseek.ops import FusedOps
from runtime.model.deepseek.weights import DenseMLPWeights, MoEWeights, moe_weights, random_weights
from runtime.model.quantized import BlockFP8


@pytest.mark.parametrize("sort_from", [None, 1], ids=["counting-kernel", "block-sort"])
@pytest.mark.parametrize("t,k,e", [(1, 1, 1), (7, 3, 8), (300, 2, 9)])
def test_dispatch_appends_the_shared_group(sort_from, t, k, e):
    """The pairs sorted as without it, then every token in order as group E: offsets [E + 1] ending at T*k + T."""
    from backends.kernels.decoder.decoder_ops import SORT_DISPATCH_FROM, moe_dispatch

    torch.manual_seed(t + e)
    ids = torch.randint(0, e, (t, k), device=DEV)
    frm = SORT_DISPATCH_FROM if sort_from is None else sort_from
    tokens, inv, offs = moe_dispatch(ids, e, frm)
    s_tokens, s_inv, s_offs = moe_dispatch(ids, e, frm, shared=True)
    n = t * k
    assert s_tokens.shape == (n + t,) and s_offs.shape == (e + 1,)
    assert torch.equal(s_tokens[:n], tokens) and torch.equal(s_inv, inv) and torch.equal(s_offs[:e], offs)
    assert torch.equal(s_tokens[n:], torch.arange(t, device=DEV)) and int(s_offs[e]) == n + t


def _stacked(gate, bias, gu, dn, shared):
    """The same weights with the shared expert copied into one more stack slot."""
    e = gu.shape[0]

    def grown(w):  # a stack of one slot more holding w's experts
        shape = (e + 1, *w.shape[1:])
        big = BlockFP8.empty(shape, w.device) if isinstance(w, BlockFP8) else w.new_empty(shape)
        big[:e] = w
        return big

    return moe_weights(gate, bias, grown(gu), grown(dn), shared, e, 0)


def test_bf16_experts_keep_the_shared_expert_s_own_products(monkeypatch):
    """16-bit experts (emulated ``torch._grouped_mm``): the stack's views hold the weights given, and the MoE over
    them is the unstacked one (the fused ops take the stack for block-fp8 experts only, where it was measured)."""
    monkeypatch.setattr(torch, "_grouped_mm", _grouped_mm_emulated, raising=False)
    torch.manual_seed(3)
    e, d, i, t, k = 8, 24, 8, 41, 3
    spec = _spec(n_group=4, topk_group=2, num_experts_per_tok=k)
    gate, bias = torch.randn(e, d, device=DEV) / d**0.5, torch.randn(e, device=DEV) * 0.01
    gu, dn = torch.randn(e, 2 * i, d, device=DEV) / d**0.5, torch.randn(e, d, i, device=DEV) / i**0.5
    shared = DenseMLPWeights(torch.randn(2 * i, d, device=DEV) / d**0.5, torch.randn(d, i, device=DEV) / i**0.5)
    apart = MoEWeights(gate, bias, gu, dn, shared)
    fused = _stacked(gate, bias, gu, dn, shared)
    assert fused.stacked is not None and torch.equal(fused.shared.down, shared.down)
    assert fused.gate_up.data_ptr() == fused.stacked[0].data_ptr() and torch.equal(fused.gate_up, gu)
    x = torch.randn(t, d, device=DEV)
    _close(FusedOps().moe(spec, fused, x, True), REF.moe(spec, apart, x, True), 1e-5)
    _close(REF.moe(spec, fused, x, True), REF.moe(spec, apart, x, True), 0)


def test_fused_fp8_moe_over_the_stack_equals_separate_products(monkeypatch):
    """Block-fp8 experts above the few-row path: at 33-128 rows the shared expert is one more group of the grouped
    GEMMs (its W8A8 rows quantized per token as the dense products do), within rounding of its own products; at
    17-32 rows (the split kernel's) and above 128 (prefill) it keeps them."""
    from backends.kernels.decoder import decoder_ops

    torch.manual_seed(5)
    e, d, i, k = 4, 256, 128, 2
    spec = _spec(n_group=2, topk_group=1, num_experts_per_tok=k)

    def fp8(*shape):
        return BlockFP8.quantize(torch.randn(*shape, device=DEV) / shape[-1] ** 0.5)

    gu = BlockFP8(*(torch.stack(x) for x in zip(*[fp8(2 * i, d).tensors for _ in range(e)])))
    dn = BlockFP8(*(torch.stack(x) for x in zip(*[fp8(d, i).tensors for _ in range(e)])))
    gate, bias = torch.randn(e, d, device=DEV) / d**0.5, torch.randn(e, device=DEV) * 0.01
    shared = DenseMLPWeights(fp8(2 * i, d), fp8(d, i))
    ops = FusedOps()
    x = torch.randn(40, d, device=DEV).half()
    want = ops.moe(spec, MoEWeights(gate, bias, gu, dn, shared), x, True).float()
    got = ops.moe(spec, _stacked(gate, bias, gu, dn, shared), x, True).float()
    assert torch.isfinite(got).all()
    _close(got, want, 5e-3)  # 2.2e-3 on an H200 (FlashInfer beside), < 2e-3 on the CPU
    asked = []

    def spy(*a, **kw):  # which grouping each row count asks for (then stop: the products are tested above)
        asked.append(kw["shared"])
        raise StopIteration

    monkeypatch.setattr(decoder_ops, "moe_dispatch", spy)
    for t in (17, 32, 33, 128, 129):
        with pytest.raises(StopIteration):
            ops.moe(spec, _stacked(gate, bias, gu, dn, shared), x[:1].expand(t, d).contiguous(), True)
    assert asked == [False, False, True, True, False]


def test_the_presets_stack_the_shared_expert_with_the_same_values():
    """fp8 and float presets: stacked (tp 1 and 2) or not (moe=ep, or switched off), the same tensors; the stack's
    views count the bytes once (the memory estimate agrees)."""
    for fmt in ("fp8", "bf16"):
        on, off = (random_weights(spec_of(f"model.weights={fmt}", f"model.shared_expert_fusion={f}"), CPU)
                   for f in ("true", "false"))
        m, ref = on.layers[1].mlp, off.layers[1].mlp
        assert m.stacked is not None and ref.stacked is None and on.layers[0].mlp is not None
        for a, b in ((m.gate_up, ref.gate_up), (m.down, ref.down), (m.shared.gate_up, ref.shared.gate_up),
                     (m.shared.down, ref.shared.down)):
            for x, y in zip(*(v.tensors if isinstance(v, BlockFP8) else [v] for v in (a, b))):
                assert torch.equal(x, y)
        assert on.bytes_by_dtype() == off.bytes_by_dtype()
        assert weight_bytes(to_plain(compose_config(*ALIGNED, f"model.weights={fmt}"))["model"], 1, "tp") \
            == on.bytes_by_dtype()
    spec = spec_of("model.weights=fp8")
    assert random_weights(spec, CPU, Sharding(0, 2, "tp")).layers[1].mlp.stacked is not None
    assert random_weights(spec, CPU, Sharding(0, 2, "ep")).layers[1].mlp.stacked is None


def test_a_loaded_checkpoint_stacks_its_shared_expert(tmp_path):
    """A V3 checkpoint of per-expert tensors (the release's layout), as stored: the shared expert read into the
    stack's last slot, equal to its tensors loaded unstacked."""
    assert make_checkpoint([*ALIGNED, "model.weights=fp8", f"out={tmp_path}"]) == 0
    runs = []
    for fuse in ("true", "false"):
        cfg = to_plain(compose_config("model=hf", f"model.path={tmp_path}", "model.dtype=float32", "device=cpu",
                                      f"model.shared_expert_fusion={fuse}"))
        runs.append(load_checkpoint(ModelSpec.from_config(cfg["model"]), CPU).layers[1].mlp)
    on, off = runs
    assert on.stacked is not None and off.stacked is None and isinstance(on.shared.down, BlockFP8)
    assert torch.equal(on.shared.gate_up.weight.float(), off.shared.gate_up.weight.float())
    assert torch.equal(on.shared.down.scale, off.shared.down.scale)
    assert torch.equal(on.gate_up.weight.float(), off.gate_up.weight.float())


def test_a_stack_without_room_for_the_shared_expert_is_refused():
    gu, dn = torch.zeros(3, 8, 4), torch.zeros(3, 4, 4)
    with pytest.raises(ValueError, match="model.shared_expert_fusion=false"):
        moe_weights(None, None, gu, dn, DenseMLPWeights(torch.zeros(16, 4), torch.zeros(4, 8)), 2, 0)
