"""``model.weights=stored`` for DeepSeek-V4 (issue 46's stored precision, V4 part), on the CPU's torch path.

A tiny release folder (tests/dsv4_release.py: fp8 e4m3 matrices with ue8m0 block scales, fp4 e2m1 routed experts
packed two per byte) is loaded as stored (BlockFP8 / PackedFP4) and dequantized; both serve the same greedy tokens
(the stored product is dequantize-then-matmul, so the numbers are the same) and the stored one holds fewer bytes.
Tensor parallelism cuts the stored bytes with their scale blocks / groups; a cut through an fp8 block or an fp4
group is refused at startup with the parallel.tp values that work. ``quantize_fp4`` (the fp8 preset's experts)
round-trips values on the e2m1 grid exactly. fp4 scales stay ue8m0 bytes (uint8, 1 byte per 32 weights: the
release's F8_E8M0 / U8 as stored, float powers of two converted; other float scales float32) with the values of
float32 scales bit for bit, and the memory plan counts them as ``ue8m0 scales``. The release's dims are chosen so
that tp=2 keeps every block whole: o_lora_rank 128 (o_a_proj 256 rows, o_b_proj 256 columns), expert width 256
(shared expert 128 rows per rank).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from conftest import compose_config
from dependency_injector import providers
from hf_models import prompt_overrides
from test_dsv4_config import TINY

from containers import BACKENDS, Container, build, to_plain
from runtime.app.memory_estimate import weight_bytes
from runtime.app.report import memory_plan
from runtime.app.validation import validate
from runtime.app.weights_checks import weights_problems
from runtime.core.device import DeviceInfo
from runtime.core.errors import CheckpointError
from runtime.core.parallel import ONE_RANK, Sharding
from runtime.model.deepseek.checkpoint import TensorInfo, _Reader
from runtime.model.deepseek.hf_config import resolve_model_config
from runtime.model.deepseek.ops import TorchOps
from runtime.model.deepseek.sharding import Cut
from runtime.model.dsv4 import checkpoint as v4ckpt
from runtime.model.dsv4.checkpoint import load_dsv4_checkpoint, random_dsv4_weights
from runtime.model.dsv4.hf_config import dsv4_config
from runtime.model.dsv4.layer import grouped_output
from runtime.model.dsv4.stored import StoredFormat
from runtime.model.quantized import (
    E2M1_VALUES,
    BlockFP8,
    BlockLayoutError,
    PackedFP4,
    ScaledTensor,
    StoredKind,
    bytes_by_dtype,
    cat_rows,
    dequantize_fp4,
    linear,
    quantize_fp4,
    scale_values,
    stack_weights,
    ue8m0_bytes,
    unpack_fp4,
)

pytest.importorskip("transformers")
from dsv4_release import fp4_rows, stored_scale, write_release  # noqa: E402
from test_dsv4_tp_sharding import assert_reassembles  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
H100 = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "NVIDIA H100")
# even experts / vocabulary (tp=2), and dims whose tp=2 cuts keep every fp8 block whole (see the docstring)
DIMS = {"n_routed_experts": 6, "vocab_size": 98, "o_lora_rank": 128, "moe_intermediate_size": 256}
PROMPTS, NEW = [[5, 17, 3, 60, 8], [41, 2, 2, 90, 33, 7, 12, 71, 19]], 5


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4_stored")
    write_release(folder, **DIMS)
    model, problems = resolve_model_config({"name": "hf", "path": str(folder), "dtype": "float32"})
    assert not problems, problems
    return folder, model


def _load(release, weights: str, shard: Sharding = ONE_RANK):
    folder, model = release
    return load_dsv4_checkpoint(dsv4_config(model), folder, StoredFormat.of(model), torch.float32, CPU, shard,
                                weights=weights)


def dequantized(w, dtype=torch.float32):
    """A weights dataclass (nested ones, lists included) with every stored weight dequantized."""
    if isinstance(w, (BlockFP8, PackedFP4)):
        return w.dequantize(dtype)
    if isinstance(w, list):
        return [dequantized(x, dtype) for x in w]
    if dataclasses.is_dataclass(w):
        return dataclasses.replace(w, **{f.name: dequantized(getattr(w, f.name), dtype)
                                         for f in dataclasses.fields(w) if f.init})
    return w


# ------------------------------------------------------------------------------------------------ the type
def test_quantize_fp4_round_trips_the_e2m1_grid_and_bounds_the_error():
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor(E2M1_VALUES)
    nib = torch.randint(0, 16, (5, 96), generator=g)
    nib[:, ::32] = 7  # every group holds a 6: its scale is the power of two given below
    exps = torch.randint(-6, 6, (5, 3), generator=g).float()
    w = grid[nib] * exps.exp2().repeat_interleave(32, dim=1)
    q, s = quantize_fp4(w)
    assert q.dtype == s.dtype == torch.uint8 and q.shape == (5, 48) and s.shape == (5, 3)
    assert torch.equal(s, (exps + 127).to(torch.uint8)) and torch.equal(scale_values(s), exps.exp2())  # ue8m0
    assert torch.equal(dequantize_fp4(q, s, torch.float32), w)
    x = torch.randn(7, 160, generator=g) * 3
    q, s = quantize_fp4(x)
    back = dequantize_fp4(q, s, torch.float32)
    s = scale_values(s)
    scaled = (x / s.repeat_interleave(32, dim=1)).abs()
    step = torch.where(scaled <= 2, 0.5, torch.where(scaled <= 4, 1.0, 2.0))
    assert ((back - x).abs() <= step / 2 * s.repeat_interleave(32, dim=1) + 1e-7).all()
    assert (scaled <= 6).all() and (s <= x.abs().view(7, 5, 32).amax(-1) / 3).all()
    ref_q, ref_e = fp4_rows(x)  # the release writer's own quantizer (an argmin over the grid; it writes -0 as +0)
    assert torch.equal(unpack_fp4(q), unpack_fp4(ref_q)) and torch.equal(s, ref_e.exp2())


def test_packed_fp4_indexes_experts_rows_and_whole_groups_only():
    g = torch.Generator().manual_seed(1)
    w = PackedFP4.quantize(torch.randn(3, 40, 96, generator=g))
    full = w.dequantize(torch.float32)
    assert w.shape == (3, 40, 96) and w.weight.shape == (3, 40, 48) and w.scale.shape == (3, 40, 3)
    assert torch.equal(w[1].dequantize(torch.float32), full[1])
    assert torch.equal(w[:, 5:17].dequantize(torch.float32), full[:, 5:17])
    assert torch.equal(w[2, :, 32:96].dequantize(torch.float32), full[2, :, 32:96])
    assert w[:, :, 32:64].weight.shape == (3, 40, 16)  # a 32-input group is 16 bytes
    with pytest.raises(BlockLayoutError, match="fp4 scale group"):
        w[:, :, 16:48]
    assert torch.equal(cat_rows([w[:, :7], w[:, 7:]], dim=1).weight, w.weight)
    assert torch.equal(cat_rows([w[:, :, :32], w[:, :, 32:]], dim=2).dequantize(torch.float32), full)
    odd = PackedFP4.quantize(torch.randn(4, 80, generator=g))  # a partial last group of 16 inputs
    with pytest.raises(BlockLayoutError, match="model.weights=dequantize"):
        cat_rows([odd[:, 64:], odd[:, :64]], dim=1)  # the 16-input part may only come last
    stack = PackedFP4.empty((3, 40, 96), CPU)
    for e in range(3):
        stack[e] = w[e]
    assert torch.equal(stack_weights([w[e] for e in range(3)]).weight, w.weight) and torch.equal(stack.scale, w.scale)
    x = torch.randn(4, 96, generator=g)
    assert torch.equal(linear(x, w[0]), torch.nn.functional.linear(x, full[0]))
    by = bytes_by_dtype([w, torch.zeros(4)])
    assert by == {"fp4 e2m1 (packed)": 3 * 40 * 48, "ue8m0 scales": 3 * 40 * 3, "float32": 16}
    assert w.nbytes == 3 * 40 * 48 + 3 * 40 * 3
    as_f32 = PackedFP4(w.weight, scale_values(w.scale))
    assert bytes_by_dtype([as_f32])["float32 scales"] == 3 * 40 * 3 * 4


def test_packed_fp4_keeps_ue8m0_bytes_with_the_float32_values():
    """quantize gives uint8 exponents (at float32's extremes: byte 25, 2^-102, for a subnormal or all-zero group;
    253 for 3e38) whose dequantized weights are those of the float32 scales bit for bit; float scales become bytes
    only when every value is a power of two in range; parts of mixed storage join as float32; a store converts or
    refuses."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 64, generator=g)
    x[0, 0, :32], x[0, 1, :32], x[1, 2, 32:] = 1e-45, 3e38, 0.0
    w = PackedFP4.quantize(x)
    assert w.scale.dtype == torch.uint8 and w.scale[0, 0, 0] == w.scale[1, 2, 1] == 25 and w.scale[0, 1, 0] == 253
    exps = torch.ceil(torch.log2(x.view(2, 4, 2, 32).abs().amax(-1).clamp_min(2.0**-100) / 6)).clamp(-127, 127)
    f32 = PackedFP4(w.weight, exps.exp2())  # today's float32 scales
    assert torch.equal(scale_values(w.scale), f32.scale)
    assert torch.equal(w.dequantize(torch.float32), f32.dequantize(torch.float32))
    assert torch.equal(w.dequantize(torch.bfloat16), f32.dequantize(torch.bfloat16))
    assert torch.equal(ue8m0_bytes(f32.scale), w.scale) and torch.equal(ue8m0_bytes(f32.scale.bfloat16()), w.scale)
    for bad in (1.5, 0.0, -1.0, 2.0**-128, float("inf")):
        assert ue8m0_bytes(torch.tensor([1.0, bad])) is None, bad
    odd = PackedFP4(w.weight[1], scale_values(w.scale[1]) * 1.5)  # float32 scales that are no powers of two
    for joined in (cat_rows([w[0], odd]), stack_weights([w[0], odd])):
        assert joined.scale.dtype == torch.float32
        assert torch.equal(joined.dequantize(torch.float32).view(8, 64)[:4], w[0].dequantize(torch.float32))
    stack = PackedFP4.empty((2, 4, 64), CPU)
    stack[0], stack[1] = f32[0], w[1]  # float powers of two stored as bytes
    assert torch.equal(stack.scale, w.scale)
    with pytest.raises(BlockLayoutError, match="not all powers of two"):
        stack[1] = odd


@pytest.mark.parametrize("as_", ["e8m0", "u8", "f32", "bf16", "f32 * 1.5", "mixed"])
def test_the_reader_keeps_fp4_scales_as_ue8m0_bytes_where_it_can(as_, tmp_path):
    """An fp4 weight with its scales stored as F8_E8M0 / U8 (the release) or float (F32 / BF16, powers of two)
    is held with uint8 scales; float scales that are no powers of two stay float32 ("mixed": the last group's
    only, so the two pieces of a cut differ and join as float32). Whole and cut in two pieces (tensor
    parallelism): the dequantized weight is the float32 dequantization of the stored tensors."""
    from safetensors.torch import save_file

    packed, e = fp4_rows(torch.randn(4, 128, generator=torch.Generator().manual_seed(3)))
    scale = {"bf16": e.exp2().bfloat16(), "f32 * 1.5": e.exp2() * 1.5,
             "mixed": e.exp2() * torch.tensor([1.0, 1.0, 1.0, 1.5])}.get(as_)
    scale = stored_scale(e, as_) if scale is None else scale
    path = tmp_path / "w.safetensors"
    save_file({"w": packed, "w.scale": scale}, str(path))
    dtype = {"e8m0": "F8_E8M0", "u8": "U8", "bf16": "BF16"}.get(as_, "F32")
    index = {"w": TensorInfo(path, "I8", (4, 64)), "w.scale": TensorInfo(path, dtype, (4, 4))}
    reader = _Reader(index, CPU, torch.float32, {"w": ScaledTensor(StoredKind.fp4, "w.scale", (1, 32))},
                     keep=lambda name: True)
    want = dequantize_fp4(packed, scale_values(scale), torch.float32)
    for cut in (Cut(((slice(None), slice(None)),)), Cut(((slice(None), slice(0, 32)), (slice(None), slice(96, 128))),
                                                        dim=1)):
        got = reader.get("w", cut=cut)
        floats = as_ in ("f32 * 1.5", "mixed")
        assert isinstance(got, PackedFP4) and got.scale.dtype == (torch.float32 if floats else torch.uint8)
        assert torch.equal(got.dequantize(torch.float32), want[:, :got.shape[1]] if len(cut.pieces) == 1
                           else torch.cat([want[:, :32], want[:, 96:]], dim=1))
    reader.close()


@pytest.mark.parametrize("as_", ["u8", "f32"])
def test_fp4_scales_past_what_the_kernels_take_are_refused_as_read(as_, tmp_path):
    """A kept fp4 weight whose scales reach past 2**64 (ue8m0 byte 192; 255, e8m0's NaN) is refused when read,
    whole or cut, with the scale tensor's name and the fix; 2**64 itself (byte 191) is held."""
    from safetensors.torch import save_file

    packed, e = fp4_rows(torch.randn(4, 128, generator=torch.Generator().manual_seed(4)))
    for top, ok in ((64, True), (65, False), (128, False)):
        if as_ == "f32" and top == 128:
            continue  # 2**128 is not a float32 power of two: inf, refused as such by the u8 case's NaN byte
        e2 = e.clone()
        e2[2, 1] = top
        scale = stored_scale(e2, as_)
        path = tmp_path / f"w{top}.safetensors"
        save_file({"w": packed, "w.scale": scale}, str(path))
        index = {"w": TensorInfo(path, "I8", (4, 64)), "w.scale": TensorInfo(path, "U8" if as_ == "u8" else "F32",
                                                                             (4, 4))}
        reader = _Reader(index, CPU, torch.float32, {"w": ScaledTensor(StoredKind.fp4, "w.scale", (1, 32))},
                         keep=lambda name: True)
        for cut in (Cut(((slice(None), slice(None)),)), Cut(((slice(None), slice(32, 64)),), dim=1)):
            if ok:
                assert isinstance(reader.get("w", cut=cut), PackedFP4)
                continue
            with pytest.raises(CheckpointError) as err:
                reader.get("w", cut=cut)
            msg = str(err.value)
            assert "w.scale (the fp4 scales of w)" in msg and "scales up to 2**64" in msg
            assert "download the shard" in msg
        reader.close()


# ------------------------------------------------------------------------------------------- checkpoints
def test_auto_is_stored_for_a_quantized_v4_checkpoint(release):
    _, model = release
    assert model["weights"] == "stored"
    a100 = DeviceInfo("cuda", "cuda", 0, True, (8, 0), "NVIDIA A100")
    plain = to_plain(compose_config("model=hf", f"model.path={release[0]}", "backend=dsv4", "device=cpu"))
    assert not weights_problems(plain, DeviceInfo("cpu", "cpu", 0, False, None, "cpu"))  # V4 no longer refused
    (p,) = weights_problems(plain, a100)
    assert "8.0" in p.got and p.fix == "model.weights=dequantize"
    deq = to_plain(compose_config("model=hf", f"model.path={release[0]}", "backend=dsv4", "device=cpu",
                                  "model.weights=dequantize"))
    assert deq["model"]["weights"] == "dequantize" and not weights_problems(deq, a100)
    graphed = to_plain(compose_config("model=hf", f"model.path={release[0]}", "backend=dsv4", "graph=decode"))
    assert not weights_problems(graphed, H100)  # fp4 experts: the fp4 kernels, no host sync


def test_stored_weights_keep_the_release_formats(release):
    stored, deq = _load(release, "stored"), _load(release, "dequantize")
    a, m = stored.layers[1].attn, stored.layers[1].mlp
    for w in (a.q_a_proj, a.q_b_proj, a.kv_proj, a.o_a_proj, a.o_b_proj, a.indexer.q_b_proj, m.shared_gate_proj,
              m.shared_up_proj, m.shared_down_proj):  # fp8 e4m3 in the release
        assert isinstance(w, BlockFP8) and w.dtype == torch.float8_e4m3fn, w.shape
    assert isinstance(m.gate_up_proj, PackedFP4) and m.gate_up_proj.shape == (6, 512, 64)  # fp4 experts, stacked
    assert isinstance(m.down_proj, PackedFP4) and m.down_proj.shape == (6, 64, 256)
    for w in (a.compressor.kv_proj, a.indexer.weights_proj, m.gate, stored.embed_tokens, stored.lm_head):
        assert isinstance(w, torch.Tensor) and w.dtype == torch.float32  # bf16 / float32 in the release
    assert len(dequantized(stored).tensors) == len(deq.tensors)
    for got, want in zip(dequantized(stored).tensors, deq.tensors):
        assert torch.equal(got, want)
    by = stored.bytes_by_dtype()
    assert {"float8_e4m3fn", "fp4 e2m1 (packed)", "ue8m0 scales", "float32 scales", "float32"} <= set(by)
    assert m.gate_up_proj.scale.dtype == m.down_proj.scale.dtype == torch.uint8  # the release's F8_E8M0, as stored
    assert by["ue8m0 scales"] * 16 == by["fp4 e2m1 (packed)"]  # a byte per 32 weights (16 packed bytes)
    assert stored.nbytes == sum(by.values()) < deq.nbytes
    assert "mlp.gate_up_proj" not in stored.unquantized_bytes() and "mlp.gate_up_proj" in deq.unquantized_bytes()


def _serve(release, weights: str, container: Container | None = None):
    folder = release[0]
    rt = build(compose_config("model=hf", f"model.path={folder}", "backend=dsv4", "model.dtype=float32",
                              "backend.compute_dtype=float32", "device=cpu", "check=off", "progress=false",
                              f"model.weights={weights}", *prompt_overrides(folder, PROMPTS, NEW)), container)
    res = rt.engine.run()
    return [res.outputs[i] for i in range(len(PROMPTS))], rt


@pytest.fixture(scope="module")
def served(release):
    """(tokens, runtime) of the release served as stored on the CPU (the torch decoder ops)."""
    return _serve(release, "stored")


def test_stored_serves_the_dequantized_tokens(release, served):
    """Same checkpoint, same compute dtype (float32): stored and dequantize give the same greedy tokens; the stored
    one holds fewer bytes (the fp4 experts 1/8 of float32 plus a scale per 32, the fp8 matrices 1/4)."""
    tokens, rt = served
    want, rt_deq = _serve(release, "dequantize")
    assert tokens == want and all(len(t) == NEW for t in tokens)
    w, w_deq = rt.container.model().weights, rt_deq.container.model().weights
    assert isinstance(w.layers[0].mlp.down_proj, PackedFP4) and not rt.container.model().grouped_mm
    assert memory_plan(rt.container)["weights_bytes"] == w.nbytes < 0.5 * w_deq.nbytes
    assert weight_bytes(rt.config["model"], 1, "tp") == w.bytes_by_dtype()  # the plan's prediction


class CountingOps(TorchOps):
    """The torch ops, counting the block-fp8 weights ``linear`` multiplies: (values' data_ptr, shape) -> calls."""

    def __init__(self):
        self.fp8 = Counter()

    def linear(self, x, w):
        if isinstance(w, BlockFP8):
            self.fp8[w.weight.data_ptr(), tuple(w.shape)] += 1
        return super().linear(x, w)


def test_stored_fp8_matrices_go_through_the_injected_ops(release, served):
    """The container gives the V4 model its decoder ops (the CPU: TorchOps); a recording stand-in sees every stored
    fp8 matrix of every layer (o_a_proj once per output group, on the group's 128 rows) and serves the same tokens."""
    want, rt = served
    assert type(rt.container.decoder_ops()) is TorchOps and rt.container.model().ops is rt.container.decoder_ops()
    ops, container = CountingOps(), Container()
    container.decoder_ops.override(providers.Object(ops))
    tokens, rt = _serve(release, "stored", container)
    assert tokens == want
    seen = {ptr for ptr, _ in ops.fp8}
    for layer in rt.container.model().weights.layers:
        fp8 = {name: w for name, w in layer.named() if isinstance(w, BlockFP8)}
        assert {"attn.q_a_proj", "attn.q_b_proj", "attn.kv_proj", "attn.o_a_proj", "attn.o_b_proj",
                "mlp.shared_gate_proj", "mlp.shared_up_proj", "mlp.shared_down_proj"} <= set(fp8)
        assert all(w.weight.data_ptr() in seen for w in fp8.values()), [n for n, w in fp8.items()
                                                                         if w.weight.data_ptr() not in seen]
        o_a = layer.attn.o_a_proj
        rows, cols = o_a.shape[0] // 2, o_a.shape[1]
        calls = [ops.fp8[o_a.weight.data_ptr() + g * rows * cols, (rows, cols)] for g in range(2)]
        assert calls[0] == calls[1] > 0  # one product per group and step


def test_grouped_output_multiplies_a_block_fp8_o_a_per_group():
    """o_a [G * R, H * D / G] in block-fp8 with R = 128 (whole blocks): one ``ops.linear`` per group, within float32
    rounding of the dequantized einsum; R = 8 (a cut through a block: tiny shapes) takes that einsum itself."""
    g = torch.Generator().manual_seed(0)
    o = torch.randn(5, 4, 96, generator=g)  # [T, H, D], 2 groups of 2 heads: 192 inputs per group
    o_b = torch.randn(40, 256, generator=g) / 16
    for rows, calls in ((128, 2), (8, 0)):
        o_a = BlockFP8.quantize(torch.randn(2 * rows, 192, generator=g) / 14)
        ops = CountingOps()
        got = grouped_output(o, o_a, o_b[:, : 2 * rows], 2, ops)
        want = grouped_output(o, o_a.dequantize(torch.float32), o_b[:, : 2 * rows], 2, TorchOps())
        assert sum(ops.fp8.values()) == calls and all(shape == (rows, 192) for _, shape in ops.fp8)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        if not calls:
            assert torch.equal(got, want)


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_tensor_parallel_cuts_reassemble_to_the_full_weights(release, moe):
    """Each of two ranks reads its bytes and scale blocks / groups; dequantized and put back together as the
    sharding cut them, they are the full dequantized load."""
    cfg = dsv4_config(release[1])
    full = _load(release, "dequantize")
    ranks = [_load(release, "stored", Sharding(r, 2, moe)) for r in range(2)]
    assert isinstance(ranks[1].layers[2].attn.o_a_proj, BlockFP8) and ranks[1].layers[2].attn.o_a_proj.shape == (
        128, 128)
    assert isinstance(ranks[1].layers[2].mlp.down_proj, PackedFP4)
    assert ranks[1].layers[2].mlp.down_proj.shape == ((6, 64, 128) if moe == "tp" else (3, 64, 256))
    assert_reassembles(full, [dequantized(r) for r in ranks], cfg, moe)


# ------------------------------------------------------------------------------------------------ presets
def test_fp8_preset_generates_the_release_formats_and_serves():
    rt = build(compose_config("model=deepseek_v4_flash", "backend=dsv4", "device=cpu", "model.dtype=float32",
                              "model.weights=fp8", "progress=false", "workload.num_requests=2",
                              "workload.prompt_len.max=12", "workload.output_len.max=4", *TINY))
    res = rt.engine.run()
    assert res.lost == 0 and res.finished == 2
    w = rt.container.model().weights
    assert isinstance(w.layers[0].mlp.gate_up_proj, PackedFP4) and isinstance(w.layers[0].attn.o_b_proj, BlockFP8)
    by = w.bytes_by_dtype()
    assert w.layers[0].mlp.gate_up_proj.scale.dtype == torch.uint8 and by["ue8m0 scales"] > 0
    lines = rt.container.memory_budget().as_dict()["fixed"]  # the plan: predicted before allocating, as held
    assert lines["weights: ue8m0 scales"] == by["ue8m0 scales"] and lines["weights: float32 scales"] == by[
        "float32 scales"] and weight_bytes(rt.config["model"], 1, "tp") == by
    assert isinstance(w.layers[0].attn.compressor.kv_proj, torch.Tensor)
    cfg = dsv4_config(to_plain(compose_config("model=deepseek_v4_flash", *TINY))["model"])
    bf16 = random_dsv4_weights(cfg, 0, torch.float32, CPU)
    fp8 = random_dsv4_weights(cfg, 0, torch.float32, CPU, weights="fp8")
    ref, got = bf16.layers[1].mlp.down_proj, fp8.layers[1].mlp.down_proj.dequantize(torch.float32)
    assert 0 < (got - ref).norm() / ref.norm() < 0.15  # the same draws, rounded to e2m1
    ref, got = bf16.layers[1].attn.q_b_proj, fp8.layers[1].attn.q_b_proj.dequantize(torch.float32)
    assert 0 < (got - ref).norm() / ref.norm() < 0.05


def test_random_weights_of_any_dtype_are_one_model():
    """A bf16 preset and its float32 parity reference hold the same model: every value drawn in float32, then cast
    (drawn in bf16, torch's sampler gave other mHC bases, sinks and biases: the full-width preset failed parity)."""
    cfg = dsv4_config(to_plain(compose_config("model=deepseek_v4_flash", *TINY))["model"])
    f32, b16 = (random_dsv4_weights(cfg, 0, dt, CPU) for dt in (torch.float32, torch.bfloat16))
    for get in (lambda w: w.layers[0].attn_hc.base, lambda w: w.layers[1].ffn_hc.fn, lambda w: w.layers[0].attn.sinks,
                lambda w: w.layers[1].attn.q_b_proj, lambda w: w.hc_head.hc_base):
        assert get(b16).dtype == torch.bfloat16 and torch.equal(get(b16), get(f32).to(torch.bfloat16))


@pytest.mark.parametrize("kind", [StoredKind.fp4, StoredKind.fp8])
def test_an_expert_stack_is_quantized_slice_by_slice_to_the_whole_draw(monkeypatch, kind):
    """Stacked experts are drawn in _normal's slices and quantized slice by slice (never held whole in the model
    dtype: 16 GiB in float32 at V4-Flash's width): the same values, scales and dtypes as the whole draw quantized,
    with slices of two experts and a last one of one."""
    monkeypatch.setattr(v4ckpt, "DRAW_ROWS_ELEMENTS", 2 * 128 * 64)
    shape, block = (5, 128, 64), (128, 128)
    got = v4ckpt._normal_quantized(shape, 0.125, torch.Generator().manual_seed(4), torch.bfloat16, CPU, kind, block)
    want = v4ckpt._quantized(v4ckpt._normal(shape, 0.125, torch.Generator().manual_seed(4), torch.bfloat16, CPU),
                             kind, block)
    assert type(got) is type(want) and got.scale.dtype == want.scale.dtype
    assert torch.equal(got.weight.view(torch.uint8), want.weight.view(torch.uint8)) and torch.equal(got.scale,
                                                                                                  want.scale)


# the tiny preset with dims whose tp=2 cuts keep every fp8 block whole (q_b_proj 256 rows, o_a_proj 256 rows,
# shared expert 256 wide)
ALIGNED = (*TINY, "model.v4.head_dim=64", "model.v4.o_lora_rank=128", "model.moe_intermediate_size=256")


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_fp8_preset_ranks_reassemble(moe):
    tp2 = ("model=deepseek_v4_flash", "backend=dsv4", "model.weights=fp8", "parallel.tp=2", f"parallel.moe={moe}")
    assert _problems(*tp2, *TINY) and not _problems(*tp2, *ALIGNED)  # TINY: 64-row cuts of q_b_proj
    cfg = dsv4_config(to_plain(compose_config("model=deepseek_v4_flash", *ALIGNED))["model"])
    full = random_dsv4_weights(cfg, 3, torch.float32, CPU, weights="fp8")
    ranks = [random_dsv4_weights(cfg, 3, torch.float32, CPU, Sharding(r, 2, moe), weights="fp8") for r in range(2)]
    assert isinstance(ranks[0].layers[0].mlp.down_proj, PackedFP4)
    assert_reassembles(dequantized(full), [dequantized(r) for r in ranks], cfg, moe)


# ------------------------------------------------------------------------------------------------ refusals
def _problems(*overrides: str) -> list:
    return weights_problems(to_plain(compose_config(*overrides)), DeviceInfo("cpu", "cpu", 0, False, None, "cpu"))


def test_a_preset_cut_through_an_fp4_group_or_fp8_block_is_refused_with_the_valid_tp():
    flash = ("model=deepseek_v4_flash", "backend=dsv4", "model.weights=fp8")
    assert not _problems(*flash, "parallel.tp=8")  # the real shapes cut whole blocks and groups
    probs = _problems(*flash, "model.moe_intermediate_size=2112", "parallel.tp=2")  # 1056 per rank: 1056 % 32 = 0
    assert probs and {p.what.split()[0] for p in probs} == {"fp8"}  # the shared expert's 128-blocks only
    assert all("model.weights=bf16 (parallel.tp in [1])" == p.fix for p in probs)
    probs = _problems(*flash, "model.moe_intermediate_size=2064", "parallel.tp=2")  # 1032: 1032 % 32 = 8
    fp4 = [p for p in probs if p.what.startswith("fp4")]
    assert len(fp4) == 1 and "experts.down_proj" in fp4[0].what and "[1032, 2064) of 2064" in fp4[0].got
    assert "whole 32-input fp4 scale groups (16 bytes)" in fp4[0].expected
    assert any("shared_experts.gate_proj" in p.what and "128 x 128 fp8" in p.expected for p in probs)
    ep = _problems(*flash, "model.moe_intermediate_size=2064", "parallel.tp=2", "parallel.moe=ep")
    assert ep and not [p for p in ep if p.what.startswith("fp4")]  # ep: whole experts


def test_graphs_are_refused_only_for_routed_experts_that_loop_on_the_host():
    """graph=decode with V4 weights held as stored: fp4 routed experts (the release's, the preset's default) take the
    fp4 kernels and the fp8 matrices the fused ops' fp8 kernels, no host sync: accepted; fp8 routed experts still
    loop over the active experts (a host sync): refused, naming the fix."""
    flash = ("model=deepseek_v4_flash", "backend=dsv4", "model.weights=fp8", "graph=decode", *TINY)
    fp4, fp8 = (to_plain(compose_config(*flash, f"model.v4.expert_dtype={e}")) for e in ("fp4", "fp8"))
    assert not weights_problems(fp4, H100)
    (p,) = weights_problems(fp8, H100)
    assert p.what == "graph.enabled=true" and "block-fp8 routed experts" in p.got and "host sync" in p.expected
    assert p.fix == "graph=off, or model.weights=bf16, or model.v4.expert_dtype=fp4 (the release's)"
    assert not weights_problems({**fp8, "model": {**fp8["model"], "weights": "bf16"}}, H100)  # the grouped GEMMs
    no_limit = {**fp4, "model": {**fp4["model"], "v4": {**fp4["model"]["v4"], "swiglu_limit": 0.0}}}
    (p,) = weights_problems(no_limit, H100)  # the fp4 kernels clamp with a positive limit only
    assert "swiglu_limit=0.0" in p.got and p.fix == "graph=off, or model.weights=bf16"


def test_fused_ops_mode_is_validated_for_v4():
    """model.fused picks the V4 model's decoder ops too: =on on the CPU is refused before anything is built."""
    plain = to_plain(compose_config("model=deepseek_v4_flash", "backend=dsv4", "device=cpu", "model.fused=on", *TINY))
    text = "\n".join(map(str, validate(plain, BACKENDS, DeviceInfo("cpu", "cpu", 0, False, None, "cpu"),
                                       package_present=lambda name: True)))
    assert "model.fused=on" in text and "model.fused=auto" in text


def test_a_checkpoint_cut_through_a_block_is_refused_before_reading(release):
    with pytest.raises(CheckpointError) as e:
        _load(release, "stored", Sharding(0, 4, "tp"))  # q_b_proj: 64 rows per rank, o_a_proj: 64 columns
    msg = str(e.value)
    assert "whole 128 x 128 fp8 scale blocks" in msg and "model.weights=dequantize (parallel.tp in [1, 2])" in msg
    assert "self_attn.q_b_proj" in msg and "self_attn.o_a_proj" in msg
