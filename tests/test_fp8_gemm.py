"""Block-fp8 linear layers (backends/kernels/gemm/fp8_gemm.py): the few-row W8A16 kernel, the W8A16 and W8A8 tiled GEMMs
and the activation quantizer.

CPU: Triton's interpreter at small odd sizes in float16 (its ``tl.dot`` is wrong for bfloat16, see test_gemv.py; its
fp8 x fp8 ``tl.dot`` is exact, so the W8A8 GEMM runs here too). Every case against float64: x times the dequantized
weight. Measured relative errors (random normal x, weights ~N(0, 1/K) quantized per 128 x 128 block):
W8A16 ~2e-4 in fp16 (the output's rounding), ~2e-3 in bf16; W8A8 0.025-0.027, all of it the activations' e4m3
rounding (against x's own fp8 values the GEMM is at the output's rounding). ``gpu`` tests: bf16 at one TP8 rank of
DeepSeek-V3, every path, and CUDA-graph replay.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEV, capture_graph, needs_gpu, rel_err

from backends.kernels.gemm import fp8_gemm
from runtime.model.quantized import dequantize_fp8, quantize_fp8

TOL_W8A16 = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
TOL_W8A8 = 3.5e-2  # measured 0.025-0.027 (activation rounding to e4m3)
#: one TP8 rank of DeepSeek-V3 (hidden 7168): (name, N, K)
TP8_SHAPES = [("qkv_a", 2112, 7168), ("q_b", 3072, 1536), ("o_proj", 7168, 2048), ("gate_up", 4608, 7168),
              ("down", 7168, 2304), ("shared_gate_up", 512, 7168), ("shared_down", 7168, 256)]


def make_weight(n, kd, block=(128, 128), dev=DEV):
    """Random fp8 weight [N, K], its float32 block scales, and the float64 dequantized weight."""
    w, s = quantize_fp8(torch.randn(n, kd, device=dev) / kd**0.5, block)
    return w, s, dequantize_fp8(w, s, torch.float64, block=block)


def strided_x(m, kd, dtype, dev=DEV):
    """[M, K] as a view with row stride K + 24 (as a slice of a fused projection's output)."""
    return torch.randn(m, kd + 24, dtype=dtype, device=dev)[:, :kd]


def torch_quantize_act(x, group):
    """float32 reference of quantize_act: per row and ``group`` inputs, s = max(amax / 448, 1e-12)."""
    m, kd = x.shape
    g = F.pad(x.float(), (0, -kd % group)).view(m, -1, group)
    s = (g.abs().amax(-1) / 448.0).clamp_min(1e-12)
    q = (g / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, -1)[:, :kd]
    return q, s


# ---------------------------------------------------------------------------------------- CPU (interpreter)
SHAPES = [(200, 320, (128, 128)), (256, 256, (128, 128)), (100, 200, (32, 64)), (70, 48, (50, 16))]


@pytest.mark.parametrize("n,kd,block", SHAPES)
@pytest.mark.parametrize("path", ["few", "w8a16"])
def test_w8a16_matches_float64(n, kd, block, path):
    torch.manual_seed(n + kd)
    w, s, wd = make_weight(n, kd, block)
    for m in ([1, 3, 16] if path == "few" else [1, 17, 129]):
        x = strided_x(m, kd, torch.float16)
        y = fp8_gemm.fp8_linear(x, w, s, block, path=path)
        assert y.dtype == torch.float16 and y.shape == (m, n)
        assert rel_err(y, x.double() @ wd.T) <= TOL_W8A16[torch.float16], (m, path)


@pytest.mark.parametrize("n,kd,block", [s for s in SHAPES if s[2][1] >= 32])
def test_w8a8_matches_float64_and_quantized_x(n, kd, block):
    torch.manual_seed(3 * n + kd)
    w, s, wd = make_weight(n, kd, block)
    for m in (1, 17, 129):
        x = strided_x(m, kd, torch.float16)
        y = fp8_gemm.fp8_linear(x, w, s, block, path="w8a8" if m <= 16 else None)
        assert y.dtype == torch.float16 and y.shape == (m, n)
        err = rel_err(y, x.double() @ wd.T)
        assert 5e-3 < err <= TOL_W8A8, err  # the activations' rounding is there, and no more
        q, qs = fp8_gemm.quantize_act(x, block[1])
        xq = q.double() * qs.double().repeat_interleave(block[1], 1)[:, :kd]
        assert rel_err(y, xq @ wd.T) <= TOL_W8A16[torch.float16]


@pytest.mark.parametrize("n,kd,block", [s for s in SHAPES if s[2][1] >= 32])
def test_split_w8a8_matches_float64_and_quantized_x(n, kd, block):
    """The "split" W8A8 kernel (the weight on the wide side, inputs split over programs): within the W8A8 bound of
    float64, at the output's rounding against x's own e4m3 values, whatever the split; its in-kernel quantization
    (times the scale's reciprocal) against quantize_act's (a division) within the output's rounding."""
    torch.manual_seed(5 * n + kd)
    w, s, wd = make_weight(n, kd, block)
    steps = -(-kd // block[1])
    for m in (1, 17, 33, 64):
        x = strided_x(m, kd, torch.float16)
        q, qs = fp8_gemm.quantize_act(x, block[1])
        xq = q.double() * qs.double().repeat_interleave(block[1], 1)[:, :kd]
        for split in sorted({1, 2, steps}):
            cfg = fp8_gemm.SplitConfig(64, split)
            y = fp8_gemm.fp8_linear(x, w, s, block, path="split", config=cfg)
            assert y.dtype == torch.float16 and y.shape == (m, n)
            err = rel_err(y, x.double() @ wd.T)
            assert 5e-3 < err <= TOL_W8A8, (m, split, err)
            assert rel_err(y, xq @ wd.T) <= TOL_W8A16[torch.float16], (m, split)
            pre = fp8_gemm.fp8_linear(x, w, s, block, path="split", config=fp8_gemm.SplitConfig(64, split, False))
            assert rel_err(y, pre) <= TOL_W8A16[torch.float16], (m, split)


@pytest.mark.parametrize("n,kd,block", SHAPES[:1] + SHAPES[2:3])
def test_split_partials_folded_by_the_last_program_give_the_second_kernels_bits(n, kd, block):
    """Few-row split-K with ``counters``: each column tile's last program sums the partials in order, the second
    kernel's additions, so the same bits (tensor-core and CUDA-core kernels, several splits); the counters are zero
    again after every launch, and a launch with fewer counters than column tiles falls back to the second kernel.
    The "split" W8A8 kernel keeps its second kernel (the counters untouched)."""
    torch.manual_seed(3 * n + kd)
    w, s, _ = make_weight(n, kd, block)
    counters = torch.zeros(64, dtype=torch.int32, device=DEV)
    for m, cfgs in ((3, [fp8_gemm.FewConfig(16, 32, 4, 2, sp) for sp in (2, 3)]),
                    (2, [fp8_gemm.FewConfig(8, 32, 4, 2, 3, True)])):
        x = strided_x(m, kd, torch.float16)
        for cfg in cfgs:
            two = fp8_gemm.fp8_linear(x, w, s, block, path="few", config=cfg)
            one = fp8_gemm.fp8_linear(x, w, s, block, path="few", config=cfg, counters=counters)
            assert torch.equal(one, two) and not counters.any(), (m, cfg)
            few = fp8_gemm.fp8_linear(x, w, s, block, path="few", config=cfg, counters=counters[:1])
            assert torch.equal(few, two) and not counters.any(), (m, cfg)
    counters[0] = 100  # not zero: the first tile's programs count on from it, none sums, the counter is left
    fp8_gemm.fp8_linear(x, w, s, block, path="few", config=cfgs[0], counters=counters)
    assert counters[0] == 100 + cfgs[0].split_k and not counters[1:].any()
    x = strided_x(17, kd, torch.float16)
    split = fp8_gemm.fp8_linear(x, w, s, block, path="split", config=fp8_gemm.SplitConfig(64, 2), counters=counters)
    assert torch.equal(split, fp8_gemm.fp8_linear(x, w, s, block, path="split", config=fp8_gemm.SplitConfig(64, 2)))
    assert counters[0] == 100 + cfgs[0].split_k and not counters[1:].any()
    with pytest.raises(ValueError, match="counters int32"):
        fp8_gemm.fp8_linear(x, w, s, block, counters=counters.long())


def test_default_path_by_rows():
    torch.manual_seed(1)
    w, s, wd = make_weight(64, 128)
    x = torch.randn(fp8_gemm.SPLIT_ROWS + 1, 128, dtype=torch.float16, device=DEV)
    assert fp8_gemm.choose_path(16, 128, DEV) == "few" and fp8_gemm.choose_path(17, 128, DEV) == "split"
    assert fp8_gemm.choose_path(fp8_gemm.SPLIT_ROWS, 128, DEV) == "split"
    assert fp8_gemm.choose_path(fp8_gemm.SPLIT_ROWS + 1, 128, DEV) == "w8a8"
    assert fp8_gemm.choose_path(17, 16, DEV) == "w8a16"  # fp8 steps are 32 deep
    assert torch.equal(fp8_gemm.fp8_linear(x[:16], w, s), fp8_gemm.fp8_linear(x[:16], w, s, path="few"))
    assert torch.equal(fp8_gemm.fp8_linear(x[:17], w, s), fp8_gemm.fp8_linear(x[:17], w, s, path="split"))
    assert torch.equal(fp8_gemm.fp8_linear(x, w, s), fp8_gemm.fp8_linear(x, w, s, path="w8a8"))
    # w8a8=False (model.fp8_compute=w8a16): 16-bit activations above 16 rows, the few-row kernel below
    assert fp8_gemm.choose_path(17, 128, DEV, w8a8=False) == "w8a16" and fp8_gemm.choose_path(16, 128, DEV,
                                                                                           w8a8=False) == "few"
    assert torch.equal(fp8_gemm.fp8_linear(x, w, s, w8a8=False), fp8_gemm.fp8_linear(x, w, s, path="w8a16"))


def test_few_rows_are_independent_of_m():
    """Each row's bits whatever the row count: the tensor-core kernel at any M <= 16, the default (CUDA-core up to
    2 rows) within each padded row count (1, 2, 3-16), so a CUDA graph captured for a padded batch of
    ``graph.batch_sizes`` (1, 2, 4, 8, 16) gives the eager run's bits."""
    torch.manual_seed(2)
    w, s, _ = make_weight(200, 320)
    x = strided_x(16, 320, torch.float16)
    for cfg in (fp8_gemm.FewConfig(16, 64), fp8_gemm.FewConfig(32, 256), fp8_gemm.FewConfig(16, 64, 4, 3, 3)):
        full = fp8_gemm.fp8_linear(x, w, s, path="few", config=cfg)
        for m in (1, 3, 7, 15):
            assert torch.equal(fp8_gemm.fp8_linear(x[:m], w, s, config=cfg), full[:m]), (cfg, m)
    for small, padded in ((3, 4), (5, 8), (3, 16)):
        assert torch.equal(fp8_gemm.fp8_linear(x[:small], w, s), fp8_gemm.fp8_linear(x[:padded], w, s)[:small])


def test_tile_configs_agree():
    """Sub-tiles narrower / wider than the scale block, other GEMM tiles: all within the fp16 bound."""
    torch.manual_seed(4)
    w, s, wd = make_weight(130, 300)
    x = torch.randn(5, 300, dtype=torch.float16, device=DEV)
    ref = x.double() @ wd.T
    for cfg in (fp8_gemm.FewConfig(16, 16), fp8_gemm.FewConfig(16, 512), fp8_gemm.FewConfig(64, 128, 4, 2)):
        assert rel_err(fp8_gemm.fp8_linear(x, w, s, path="few", config=cfg), ref) <= 2e-3
    # split-K: 5 steps of 64 in 3 splits (2 / 2 / 1 steps), more splits than steps (one step each), the
    # partials summed in order: within the same bound
    for cfg in (fp8_gemm.FewConfig(16, 64, 4, 3, 3), fp8_gemm.FewConfig(32, 128, 4, 3, 8),
                fp8_gemm.FewConfig(16, 16, 4, 3, 7)):
        assert rel_err(fp8_gemm.fp8_linear(x, w, s, path="few", config=cfg), ref) <= 2e-3, cfg
    for cfg in (fp8_gemm.GemmConfig(16, 32, 32), fp8_gemm.GemmConfig(32, 64, 128, 2)):
        assert rel_err(fp8_gemm.fp8_linear(x, w, s, path="w8a16", config=cfg), ref) <= 2e-3
        assert rel_err(fp8_gemm.fp8_linear(x, w, s, path="w8a8", config=cfg), ref) <= TOL_W8A8


def test_tma_tiles_give_the_plain_kernels_bits():
    """The TMA-loaded GEMM (edges read as zeros, no masks): the plain kernel's bits at odd M / N / K, both paths."""
    torch.manual_seed(5)
    w, s, _ = make_weight(130, 384)
    for m in (1, 7, 63):
        x = torch.randn(m, 384, dtype=torch.float16, device=DEV)
        for path, bk in (("w8a8", 128), ("w8a16", 64)):
            plain = fp8_gemm.fp8_linear(x, w, s, path=path, config=fp8_gemm.GemmConfig(32, 32, bk, 2))
            tma = fp8_gemm.fp8_linear(x, w, s, path=path, config=fp8_gemm.GemmConfig(32, 32, bk, 2, tma=True))
            assert torch.equal(tma, plain), (m, path)


FMA_CONFIGS = [fp8_gemm.FewConfig(4, 128, 4, 3, 1, True), fp8_gemm.FewConfig(16, 256, 4, 3, 3, True),
               fp8_gemm.FewConfig(64, 64, 4, 3, 1, True)]


@pytest.mark.parametrize("n,kd,block", SHAPES)
def test_fma_rows_match_float64(n, kd, block):
    """The CUDA-core kernel (M <= 2) at odd sizes, one and several scale rows per program, split-K: float32
    products, only the output rounded (bf16 too: no tl.dot, so the interpreter is right in bf16)."""
    torch.manual_seed(n * 3 + kd)
    w, s, wd = make_weight(n, kd, block)
    for m in (1, 2):
        for i, cfg in enumerate(FMA_CONFIGS):  # each config in both dtypes over the two row counts
            dtype = (torch.float16, torch.bfloat16)[(i + m) % 2]
            x = strided_x(m, kd, dtype)
            ref = x.double() @ wd.T
            y = fp8_gemm.fp8_linear(x, w, s, block, path="few", config=cfg)
            assert y.dtype == dtype and torch.isfinite(y).all()
            assert rel_err(y, ref) <= {torch.float16: 1e-3, torch.bfloat16: 5e-3}[dtype], (cfg, m, dtype)


def test_fma_second_row_leaves_the_first_rows_bits():
    """Each row accumulates on its own in the CUDA-core kernel: row 0 of a two-row call is row 0 alone, bit for
    bit, with and without the fused norm (a decode step's batch of 2 gives each request batch 1's numbers)."""
    torch.manual_seed(21)
    w, s, _ = make_weight(70, 300)
    x = strided_x(2, 300, torch.bfloat16)
    g = (torch.rand(300, device=DEV) + 0.5).bfloat16()
    for cfg in FMA_CONFIGS:
        two, one = (fp8_gemm.fp8_linear(x[:m], w, s, path="few", config=cfg) for m in (2, 1))
        assert torch.equal(two[:1], one), cfg
    two, one = (fp8_gemm.fp8_norm_linear(x[:m], g, 1e-6, w, s, config=FMA_CONFIGS[0]) for m in (2, 1))
    assert torch.equal(two[:1], one)


@pytest.mark.parametrize("m", [1, 2])
def test_norm_linear_equals_norm_then_linear(m):
    """fp8_norm_linear: the RMSNorm rounded as the fused norm kernel rounds (float32 rstd, x * rstd rounded, times
    the weight, rounded), then the same kernel's product: the bits of norming first in torch."""
    torch.manual_seed(11 + m)
    w, s, _ = make_weight(70, 300)
    x = strided_x(m, 300, torch.float16) * 3
    g = (torch.rand(300, device=DEV) + 0.5).half()
    xf = x.float()
    normed = ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).half().float() * g.float()).half()
    cfg = fp8_gemm.FewConfig(8, 128, 4, 3, 1, True)
    fused = fp8_gemm.fp8_norm_linear(x, g, 1e-6, w, s, config=cfg)
    plain = fp8_gemm.fp8_linear(normed, w, s, path="few", config=cfg)
    assert rel_err(fused, plain.double()) <= 1e-3  # rstd as 1 / sqrt in the kernel: an ulp apart at most
    with pytest.raises(ValueError, match="1 to 2 rows"):
        fp8_gemm.fp8_norm_linear(strided_x(3, 300, torch.float16), g, 1e-6, w, s)


def test_fma_refuses_more_than_two_rows():
    w, s, _ = make_weight(64, 128)
    with pytest.raises(ValueError, match="fma for at most 2 rows"):
        fp8_gemm.fp8_linear(strided_x(3, 128, torch.float16), w, s, path="few", config=FMA_CONFIGS[0])


def test_quantize_act_gives_torch_bits():
    torch.manual_seed(5)
    x = strided_x(37, 300, torch.float16) * 3
    x[0, :128] = 0  # an all-zero group: scale 1e-12, values 0
    x[1, 5] = 30000.0  # one large value: the rest of its group near zero
    x[2, :] = torch.linspace(-126.6, 127.7, 300, dtype=torch.float16)  # carries into the next binade
    q, s = fp8_gemm.quantize_act(x, 128)
    qr, sr = torch_quantize_act(x, 128)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (37, 3) and torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    q32, s32 = fp8_gemm.quantize_act(x.float().contiguous(), 32)
    qr32, sr32 = torch_quantize_act(x, 32)
    assert torch.equal(s32, sr32) and torch.equal(q32.view(torch.uint8), qr32.view(torch.uint8))


def test_empty_inputs():
    w, s, _ = make_weight(8, 32)
    assert fp8_gemm.fp8_linear(torch.empty(0, 32, dtype=torch.float16), w, s).shape == (0, 8)
    w0 = torch.empty(0, 32, dtype=torch.float8_e4m3fn)
    assert fp8_gemm.fp8_linear(torch.ones(2, 32, dtype=torch.float16), w0, torch.empty(0, 1)).shape == (2, 0)


def test_refuses_what_it_cannot_take():
    w, s, _ = make_weight(40, 64)
    x = torch.randn(3, 64, dtype=torch.float16)
    cases = [
        ((x.float(), w, s), {}, "bf16 or fp16"),
        ((x, w.to(torch.float16), s), {}, "float8_e4m3fn"),
        ((x, w, s.to(torch.bfloat16)), {}, r"scale \[ceil"),
        ((x, w, torch.ones(2, 1)), {}, r"got \(2, 1\)"),
        ((x[:, :48], w, s), {}, r"K=48"),
        ((x.t().contiguous().t(), w, s), {}, "contiguous last dim"),
        ((x, w, s), {"block": (128, 48)}, "power of two >= 16"),
        ((x, w, s), {"block": 128}, r"block = \(bn, bk\)"),
        ((x, w, s), {"path": "fp8"}, "path one of"),
        ((torch.randn(17, 64, dtype=torch.float16), w, s), {"path": "few"}, "M <= 16"),
        ((x, w, s), {"config": fp8_gemm.GemmConfig(16, 16, 32), "path": "few"}, "FewConfig"),
        ((x, w, s), {"config": fp8_gemm.FewConfig(16, 32), "path": "w8a8"}, "GemmConfig"),
        ((x, w, s), {"config": fp8_gemm.FewConfig(16, 32, 4, 3, 0), "path": "few"}, "split_k a positive int"),
        ((x, w, s), {"config": fp8_gemm.GemmConfig(16, 16, 16), "path": "w8a8"}, "block_k a power of two >= 32"),
        ((torch.randn(129, 64, dtype=torch.float16), w, s), {"path": "split"}, "M <= 128"),
        ((x, w, s), {"config": fp8_gemm.FewConfig(16, 32), "path": "split"}, "SplitConfig"),
        ((x, w, s), {"config": fp8_gemm.SplitConfig(48), "path": "split"}, "block_n a power of two"),
        ((x, w, s), {"config": fp8_gemm.SplitConfig(64, 0), "path": "split"}, "split_k a positive int"),
    ]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fp8_gemm.fp8_linear(*args, **kw)
    w16, s16, _ = make_weight(40, 64, (128, 16))
    with pytest.raises(ValueError, match="bk >= 32 for path='w8a8'"):
        fp8_gemm.fp8_linear(x, w16, s16, (128, 16), path="w8a8")
    w256, s256, _ = make_weight(40, 512, (128, 256))
    with pytest.raises(ValueError, match="quant=False"):  # a 256-input scale group spans two 128-input steps
        fp8_gemm.fp8_linear(torch.randn(20, 512, dtype=torch.float16), w256, s256, (128, 256), path="split",
                            config=fp8_gemm.SplitConfig(64, 1, True))
    with pytest.raises(ValueError, match="group a power of two"):
        fp8_gemm.quantize_act(x, 100)
    with pytest.raises(ValueError, match="bf16 / fp16 / float32"):
        fp8_gemm.quantize_act(x.double(), 128)


def test_configs_by_rule():
    cpu = torch.device("cpu")  # counted as an H100's 132 SMs
    # 3-16 rows: 64 x 256 tiles, the inputs split in runs of ~4 steps (whole runs), the same at every row count
    assert fp8_gemm.few_config(2112, 7168, cpu, 16) == fp8_gemm.FewConfig(64, 256, 4, 4, 7)
    assert fp8_gemm.few_config(2112, 7168, cpu, 3) == fp8_gemm.few_config(2112, 7168, cpu, 16)
    assert fp8_gemm.few_config(3072, 1536, cpu, 9) == fp8_gemm.FewConfig(64, 256, 4, 4, 2)
    assert fp8_gemm.few_config(7168, 2304, cpu, 9) == fp8_gemm.FewConfig(64, 256, 4, 4, 2)  # 9 steps: 5 + 4
    assert fp8_gemm.few_config(7168, 2048, cpu, 5) == fp8_gemm.FewConfig(64, 256, 4, 4, 2)
    assert fp8_gemm.few_config(7168, 256, cpu, 16) == fp8_gemm.FewConfig(64, 256, 4, 4, 1)
    assert fp8_gemm.few_config(40000, 100, cpu) == fp8_gemm.FewConfig(64, 128, 4, 4)
    assert fp8_gemm.few_config(6400, 65536, cpu).split_k == 6  # at most 4 programs an SM: 528 over 100 column tiles
    # up to 2 rows the CUDA-core kernel, no split-K: 8 x 512 where that makes 4 programs per SM, else 4 x 1024,
    # the same tile at 2 rows (each row accumulates in the tile's layout)
    assert fp8_gemm.few_config(2112, 7168, cpu, 1) == fp8_gemm.FewConfig(4, 1024, 4, 3, 1, True)
    assert fp8_gemm.few_config(7168, 2048, cpu, 1) == fp8_gemm.FewConfig(8, 512, 4, 3, 1, True)
    assert fp8_gemm.few_config(7168, 2048, cpu, 2) == fp8_gemm.FewConfig(8, 512, 4, 3, 1, True)
    assert fp8_gemm.few_config(7168, 2048, cpu, 3) == fp8_gemm.FewConfig(64, 256, 4, 4, 2)
    assert fp8_gemm.few_config(512, 100, cpu, 1) == fp8_gemm.FewConfig(4, 128, 4, 3, 1, True)
    assert fp8_gemm.gemm_config(4096, 7168, 7168, 128, True, cpu) == fp8_gemm.GemmConfig(64, 128, 128, 8, 4, 3)
    assert fp8_gemm.gemm_config(32, 2112, 7168, 128, True, cpu) == fp8_gemm.GemmConfig(64, 64, 128, 8, 4, 3)
    assert fp8_gemm.gemm_config(20, 512, 7168, 128, False, cpu) == fp8_gemm.GemmConfig(32, 64, 64, 8, 4, 4)
    # the split W8A8 kernel: 128 weight rows, splits for ~2 programs an SM, each at least two 128-input steps
    assert fp8_gemm.split_config(32, 2112, 7168, 128, cpu) == fp8_gemm.SplitConfig(128, 14, True, 4, 3)
    assert fp8_gemm.split_config(32, 7168, 2048, 128, cpu) == fp8_gemm.SplitConfig(128, 4, True, 4, 3)
    assert fp8_gemm.split_config(32, 7168, 256, 128, cpu) == fp8_gemm.SplitConfig(128, 1, True, 4, 3)
    assert fp8_gemm.split_config(32, 512, 512, 256, cpu) == fp8_gemm.SplitConfig(128, 2, False, 4, 3)


def test_bench_arguments_and_shapes():
    from bench import fp8_gemm_bench as b

    args = b.parse_args(["--m", "1,16,4096", "--shapes", "qkv_a,down"])
    assert args.m == [1, 16, 4096] and [s[0] for s in b.selected_shapes(args)] == ["qkv_a", "down"]
    assert b.SHAPES == TP8_SHAPES and b.parse_args([]).m == [1, 2, 4, 8, 16, 32, 64, 4096]
    with pytest.raises(SystemExit):
        b.parse_args(["--shapes", "nope"])


# ---------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name,n,kd", TP8_SHAPES)
def test_tp8_shapes_bf16_gpu(name, n, kd):
    needs_gpu()
    torch.manual_seed(n + kd)
    w, s, wd = make_weight(n, kd, dev="cuda")
    for m in (1, 2, 4, 16, 64, 1024):
        x = strided_x(m, kd, torch.bfloat16, "cuda")
        ref = x.double() @ wd.T
        paths = ["few", "w8a16", "w8a8"] if m <= 16 else ["w8a16", "w8a8"]
        for path in paths:
            y = fp8_gemm.fp8_linear(x, w, s, path=path)
            assert y.dtype == torch.bfloat16 and y.shape == (m, n)
            tol = TOL_W8A8 if path == "w8a8" else TOL_W8A16[torch.bfloat16]
            assert rel_err(y, ref) <= tol, (name, m, path, rel_err(y, ref))
        if m <= 16:  # split-K (partials summed in order by a second kernel): the same bound
            for cfg in (fp8_gemm.FewConfig(64, 256, 4, 4, 4), fp8_gemm.FewConfig(32, 512, 4, 3, 3)) + (
                    (fp8_gemm.FewConfig(8, 512, 4, 3, 3, True), fp8_gemm.FewConfig(4, 1024, 8, 3, 1, True))
                    if m <= fp8_gemm.FMA_ROWS else ()):
                y = fp8_gemm.fp8_linear(x, w, s, path="few", config=cfg)
                assert rel_err(y, ref) <= TOL_W8A16[torch.bfloat16], (name, m, cfg, rel_err(y, ref))
        if m == 16:  # our few-row kernel: a row's bits whatever the rows from 3 on (1 and 2: the CUDA-core kernel)
            full = fp8_gemm.fp8_linear(x, w, s, path="few")
            for r in (3, 8):
                assert torch.equal(fp8_gemm.fp8_linear(x[:r], w, s, path="few"), full[:r]), (name, r)


@pytest.mark.gpu
@pytest.mark.parametrize("ws", [False, True])
def test_tma_gemm_gpu(ws):
    """TMA loads (warp-specialized or not) at a TP8 shape and odd rows: the plain kernel's bits."""
    needs_gpu()
    torch.manual_seed(7)
    w, s, _ = make_weight(2112, 7168, dev="cuda")
    for m in (17, 129, 1000):
        x = torch.randn(m, 7168, dtype=torch.bfloat16, device="cuda")
        plain = fp8_gemm.fp8_linear(x, w, s, path="w8a8", config=fp8_gemm.GemmConfig(128, 128, 128, 8, 8, 3))
        tma = fp8_gemm.fp8_linear(x, w, s, path="w8a8", config=fp8_gemm.GemmConfig(128, 128, 128, 8, 8, 3, True, ws))
        assert torch.equal(tma, plain), (m, ws)


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,kd", TP8_SHAPES)
def test_split_w8a8_tp8_shapes_gpu(name, n, kd):
    """The "split" kernel at one TP8 rank's shapes, 17-128 rows, TMA and pointer loads, any split: within the W8A8
    bound of float64 and at bf16's rounding of the tiled W8A8 GEMM's result (the same e4m3 activations); in-kernel
    quantization agrees with quantize_act's; a CUDA graph with PDL replays the eager bits."""
    needs_gpu()
    torch.manual_seed(n + kd)
    w, s, wd = make_weight(n, kd, dev="cuda")
    for m in (17, 32, 64, 128):
        x = torch.randn(m, kd, dtype=torch.bfloat16, device="cuda")
        tiled = fp8_gemm.fp8_linear(x, w, s, path="w8a8")
        for cfg in (None, fp8_gemm.SplitConfig(64, 1, True, 4, 3, False), fp8_gemm.SplitConfig(128, 5, False)):
            y = fp8_gemm.fp8_linear(x, w, s, path="split", config=cfg)
            assert 5e-3 < rel_err(y, x.double() @ wd.T) <= TOL_W8A8, (name, m, cfg)
            assert rel_err(y, tiled) <= TOL_W8A16[torch.bfloat16], (name, m, cfg)
        cfg = fp8_gemm.split_config(m, n, kd, 128, "cuda")
        assert rel_err(fp8_gemm.fp8_linear(x, w, s, path="split", config=replace(cfg, quant=not cfg.quant)),
                       fp8_gemm.fp8_linear(x, w, s, path="split", config=cfg)) <= TOL_W8A16[torch.bfloat16]
    out = {}

    def step():
        out["y"] = fp8_gemm.fp8_linear(x, w, s, path="split", pdl=True)

    graph = capture_graph(step)
    x.copy_(torch.randn_like(x))
    eager = fp8_gemm.fp8_linear(x, w, s, path="split", pdl=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out["y"], eager)


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,kd", TP8_SHAPES)
def test_few_split_folded_tp8_shapes_gpu(name, n, kd):
    """Few-row split-K at one TP8 rank's shapes (3, 9 and 16 rows on the tensor cores, 1-2 on the CUDA cores): the
    partials summed in each column tile's last program (``counters``) give the second kernel's bits, eager and in a
    CUDA graph with PDL replayed several times (the counters re-armed between launches), and the default config's
    result within bf16's rounding of float64."""
    needs_gpu()
    torch.manual_seed(n + kd)
    w, s, wd = make_weight(n, kd, dev="cuda")
    counters = torch.zeros(1024, dtype=torch.int32, device="cuda")
    for m in (1, 2, 3, 9, 16):
        x = torch.randn(m, kd, dtype=torch.bfloat16, device="cuda")
        assert rel_err(fp8_gemm.fp8_linear(x, w, s, counters=counters), x.double() @ wd.T) <= 1e-2, (name, m)
        for sp in (2, 4):
            cfg = replace(fp8_gemm.few_config(n, kd, "cuda", m), split_k=sp)
            for pdl in (False, True):
                assert torch.equal(fp8_gemm.fp8_linear(x, w, s, path="few", config=cfg, pdl=pdl, counters=counters),
                                   fp8_gemm.fp8_linear(x, w, s, path="few", config=cfg)), (name, m, sp, pdl)
            assert not counters.any()
    cfg = replace(fp8_gemm.few_config(n, kd, "cuda", 16), split_k=4)
    out = {}

    def step():  # the folded launch twice in one graph
        out["f"] = fp8_gemm.fp8_linear(x, w, s, path="few", config=cfg, pdl=True, counters=counters)
        out["g"] = fp8_gemm.fp8_linear(x, w, s, path="few", config=cfg, pdl=True, counters=counters)

    graph = capture_graph(step)
    x.copy_(torch.randn_like(x))
    eager = fp8_gemm.fp8_linear(x, w, s, path="few", config=cfg, pdl=True)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out["f"], eager) and torch.equal(out["g"], eager) and not counters.any()


@pytest.mark.gpu
def test_quantize_act_gpu_gives_torch_bits():
    needs_gpu()
    torch.manual_seed(6)
    x = strided_x(300, 7168, torch.bfloat16, "cuda") * 5
    q, s = fp8_gemm.quantize_act(x, 128)
    qr, sr = torch_quantize_act(x, 128)
    # torch on CUDA divides by the scalar 448 as a product with its reciprocal: the scales may differ by an ulp
    assert torch.allclose(s, sr, rtol=2.4e-7, atol=0)
    g = F.pad(x.float(), (0, -x.shape[1] % 128)).view(x.shape[0], -1, 128)
    qs = (g / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(x.shape[0], -1)[:, : x.shape[1]]
    assert torch.equal(q.view(torch.uint8), qs.view(torch.uint8))  # the quotient by the kernel's own scales


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 64])
def test_cuda_graph_replay_gpu(m):
    """Captured with PDL (Hopper), replayed: the eager run's bits."""
    needs_gpu()
    torch.manual_seed(m)
    w, s, _ = make_weight(2112, 7168, dev="cuda")
    x = torch.randn(m, 7168, dtype=torch.bfloat16, device="cuda")
    out = {}

    def step():
        out["y"] = fp8_gemm.fp8_linear(x, w, s, pdl=True)

    eager = fp8_gemm.fp8_linear(x, w, s, pdl=True)
    graph = capture_graph(step)
    x.copy_(torch.randn_like(x))
    eager = fp8_gemm.fp8_linear(x, w, s, pdl=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out["y"], eager)


def test_library_path_is_refused_where_it_cannot_run():
    w, s, _ = make_weight(256, 256, dev=DEV)
    x = strided_x(3, 256, torch.float16, DEV)
    with pytest.raises(ValueError, match="path='flashinfer'"):
        fp8_gemm.fp8_linear(x, w, s, path="flashinfer")  # fp16 activations (and no SM90 GPU here)
    with pytest.raises(ValueError, match="path='scaled_mm'"):
        fp8_gemm.fp8_linear(x, w, s, path="scaled_mm")
    assert fp8_gemm.choose_path(3, 128, DEV, torch.float16) == "few"


@pytest.mark.gpu
def test_library_path_gpu():
    """FlashInfer's SM90 block-scale GEMM, the default where it serves: W8A8-level error at decode and prefill
    rows, odd N / M included."""
    needs_gpu()
    if not fp8_gemm._library_serves(torch.bfloat16, (128, 128), "cuda"):
        pytest.skip("FlashInfer's fp8_blockscale_gemm_sm90 does not serve this GPU")
    torch.manual_seed(3)
    w, s, wd = make_weight(2112, 7168, dev="cuda")
    for m in (1, 3, 16, 17, 129):
        x = strided_x(m, 7168, torch.bfloat16, "cuda")
        assert fp8_gemm.choose_path(m, 128, "cuda", torch.bfloat16) == ("few" if m <= 16 else "flashinfer")
        y = fp8_gemm.fp8_linear(x, w, s, path="flashinfer")
        assert rel_err(y, x.double() @ wd.double().T) <= TOL_W8A8, m


@pytest.mark.gpu
def test_scaled_mm_path_gpu(monkeypatch):
    """torch's block-scaled F.scaled_mm (cuBLAS), chosen from SCALED_MM_ROWS rows where it serves (4096 by
    default; 2048 here): W8A8-level error at odd M and N, strided rows; the same activation quantization as ours,
    so within an output rounding of our W8A8 kernel."""
    needs_gpu()
    assert fp8_gemm.choose_path(2048, 128, "cuda", torch.bfloat16, k_dim=7168) != "scaled_mm"  # the default
    monkeypatch.setattr(fp8_gemm, "SCALED_MM_ROWS", 2048)
    if not fp8_gemm._scaled_mm_serves(torch.bfloat16, (128, 128), "cuda", 7168):
        pytest.skip("torch's block-scaled scaled_mm does not serve this GPU")
    torch.manual_seed(4)
    w, s, wd = make_weight(2112, 7168, dev="cuda")
    big = fp8_gemm.SCALED_MM_ROWS + 3
    # K 2304 (the dense down's: 18 scale blocks, not a multiple of 4): not cuBLAS's
    assert fp8_gemm.choose_path(big, 128, "cuda", torch.bfloat16, k_dim=2304) != "scaled_mm"
    for m in (17, 129, big):  # rows padded to 16 for cuBLAS, the padding's output rows dropped
        x = strided_x(m, 7168, torch.bfloat16, "cuda")
        want = "scaled_mm" if m >= fp8_gemm.SCALED_MM_ROWS else "flashinfer"
        if want == "scaled_mm" or fp8_gemm._library_serves(torch.bfloat16, (128, 128), "cuda"):
            assert fp8_gemm.choose_path(m, 128, "cuda", torch.bfloat16, k_dim=7168) == want
        y = fp8_gemm.fp8_linear(x, w, s, path="scaled_mm")
        assert y.shape == (m, 2112) and y.dtype == torch.bfloat16
        assert rel_err(y, x.double() @ wd.double().T) <= TOL_W8A8, m
        assert rel_err(y, fp8_gemm.fp8_linear(x, w, s, path="w8a8")) <= 5e-3, m
