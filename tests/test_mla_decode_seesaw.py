"""The seesaw stage 1 of the MLA decode (:mod:`backends.kernels.mla_decode.mla_decode_seesaw_kernels`: 64 heads per
program, each of two warpgroups owning one tile of a pair and half the output columns; Hopper).

CPU: ``mla_decode(seesaw=True)`` asks the launcher for the seesaw kernel with every split request left to the merge
kernel, at 64-head blocks only. GPU (``gpu``-marked): 64 and 128 heads, bf16 and fp16, odd lengths (1, 7, 63, 64,
65, empty, page boundaries, odd and even tile counts) with NaN rows past every request's end, a batch of one, one
long split request, against the float32 reference and the lock-step 64-head kernel; one plan over three layers,
eager and replayed in a CUDA graph with other lengths.
"""

import importlib

import pytest
import torch
from test_mla_decode_wgmma import ODD, _decode, _problem, _reference
from triton_env import capture_graph, needs_gpu, rel_err, replays_equal_eager

from backends.kernels.mla_decode.mla_decode import decode_workspace_shapes

D_CKV, D_PE = 512, 64


FP8 = torch.float8_e4m3fn


def _ask(monkeypatch, H, block_h, seesaw, kv_dtype):
    """mla_decode's request to the wgmma launcher (seesaw, merge limit) and the plan it returns, off the GPU."""
    md = importlib.import_module("backends.kernels.mla_decode.mla_decode")
    seen = []
    monkeypatch.setattr(md, "wgmma_problems", lambda *a: [])
    monkeypatch.setattr(md, "wgmma_block_h", lambda *a: block_h)
    monkeypatch.setattr(md, "launch_wgmma_stage1", lambda *a, seesaw, merge_max, **k: seen.append((seesaw, merge_max)))
    B = 3
    po, pl, work = decode_workspace_shapes(B, H, 4).allocate("cpu")
    kv = torch.zeros(8, 64, D_CKV + D_PE).to(kv_dtype)
    plan = md.mla_decode(torch.zeros(B, H, D_CKV), torch.zeros(B, H, D_PE), kv, torch.zeros(B, 8, dtype=torch.int32),
                         torch.tensor([5, 300, 64], dtype=torch.int32), 0.1, torch.empty(B, H, D_CKV), po, pl, work,
                         max_splits=4, use_wgmma=True, target_programs=8, seesaw=seesaw, _skip_merge=True)  # fmt: skip
    return seen, plan


@pytest.mark.parametrize(
    "H,block_h,seesaw,kv_dtype,seesaw_from,expected",
    [(64, 64, True, torch.bfloat16, None, (True, 0)), (64, 16, True, torch.bfloat16, None, (False, 4)),
     (128, 64, None, torch.bfloat16, 3, (True, 0)), (128, 64, None, torch.bfloat16, None, (False, 4)),
     (64, 64, None, torch.bfloat16, 3, (False, 4)), (128, 64, False, torch.bfloat16, 3, (False, 4)),
     (128, 64, None, FP8, 3, (False, 4)), (32, 16, None, FP8, None, (False, 0))],
)
def test_seesaw_is_asked_for_64_head_blocks_with_the_merge_kernel(monkeypatch, H, block_h, seesaw, kv_dtype,
                                                                  seesaw_from, expected):
    """The launcher gets ``seesaw`` and a stage-1 merge limit of 0 (the kernel merges nothing) at 64-head blocks,
    asked for or by default from 128 heads and ``SEESAW_MIN_BATCH`` requests (``seesaw_from``: that floor for the
    call's 3 requests; None: the default floor, above 3) over a 16-bit cache; other blocks keep their kernel and
    merge limit (4 over bf16 and in the lock-step kernel, which is what 64-head blocks over fp8 run; 0 in the 16-head
    fp8 kernel)."""
    if seesaw_from is not None:
        monkeypatch.setattr(importlib.import_module("backends.kernels.mla_decode.mla_decode_wgmma"), "SEESAW_MIN_BATCH",
                            seesaw_from)
    seen, plan = _ask(monkeypatch, H, block_h, seesaw, kv_dtype)
    assert seen == [expected] and plan.merge_max == expected[1]


def test_seesaw_over_an_fp8_cache_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="seesaw=True needs a bf16 / fp16 cache"):
        _ask(monkeypatch, 128, 64, True, FP8)


SHAPES = {"odd": ODD, "one-token": [1], "one-long": [32768], "two-short": [5, 3], "tile-pairs": [65, 129, 191, 192]}


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gpu_seesaw_decode_matches_reference_and_lockstep(H, dtype, shape):
    needs_gpu()
    lens = SHAPES[shape]
    kv, pt, q_nope, q_pe = _problem(lens, H, dtype, seed=H + len(lens))
    scale = 0.07
    ref = _reference(q_nope, q_pe, kv, pt, lens, scale)
    ours = _decode(q_nope, q_pe, kv, pt, lens, scale, use_wgmma=True, seesaw=True)
    lockstep = _decode(q_nope, q_pe, kv, pt, lens, scale, use_wgmma=True)
    for b, L in enumerate(lens):
        if L == 0:
            assert (ours[b] == 0).all(), "a request with no keys gets zeros"
    assert rel_err(ours, ref) < 1e-2
    assert rel_err(ours, lockstep.float()) < 1e-2


@pytest.mark.gpu
def test_gpu_seesaw_one_plan_over_layers_in_a_graph():
    """Three layers under one plan at 128 heads (the plan written by the first, reused by the others), captured in
    a graph and replayed with other lengths: the eager bits, each layer against its reference."""
    needs_gpu()
    H = 128
    lens_a, lens_b = [4096, 17, 1, 2048, 333, 8192, 0], [5, 8192, 700, 1, 64, 3000, 129]
    longest = [max(a, b) for a, b in zip(lens_a, lens_b)]
    layers = []
    for seed in range(3):
        kv, pt, qn, qp = _problem(longest, H, torch.bfloat16, seed=seed)
        layers.append((kv.float().nan_to_num().to(kv.dtype), pt, qn, qp))  # every row up to the longer length is real
    B = len(lens_a)
    po, pl, work = decode_workspace_shapes(B, H, 8).allocate("cuda")
    sl = torch.tensor(lens_a, dtype=torch.int32, device="cuda")
    out_all = torch.empty(len(layers), B, H, D_CKV, dtype=torch.bfloat16, device="cuda")
    outs = list(out_all)  # views: one tensor to fill and compare
    md = importlib.import_module("backends.kernels.mla_decode.mla_decode")

    def step():
        plan = None
        for (kv, pt, qn, qp), out in zip(layers, outs):
            plan = md.mla_decode(qn, qp, kv, pt, sl, 0.1, out, po, pl, max_splits=8, work=work, use_wgmma=True,
                                 seesaw=True, plan=plan)  # fmt: skip

    step()  # compile outside capture
    graph = capture_graph(step)
    for lens in replays_equal_eager(graph, step, out_all, sl, (lens_a, lens_b)):
        for (kv, pt, qn, qp), out in zip(layers, outs):
            assert rel_err(out, _reference(qn, qp, kv, pt, lens, 0.1)) < 1e-2
