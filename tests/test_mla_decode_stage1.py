"""Which stage 1 the MLA decode launcher takes, called as its docstring shows (issue 52 item 4).

A caller that allocates the workspace :func:`decode_workspace_shapes` gives and calls ``mla_decode`` as its docstring
example does gets the Gluon wgmma stage 1 on Hopper (the plan space is part of that workspace), the Triton stage 1
on the CPU (compute capability 0: the device data decides, not a fallback), and a clear error, never a silent slow
path, where a requested kernel cannot run or the plan space is too small. All on the CPU: the Gluon kernels are
replaced by a stand-in that records the launch.
"""

import doctest
import importlib

import pytest
import torch
from triton_env import INTERPRETED  # noqa: F401  (skips the module without Triton)

from backends.kernels.mla_decode.mla_decode import (
    choose_stage1,
    decode_work_ints,
    decode_workspace_shapes,
    mla_decode,
    stage1_capability,
)
from backends.kernels.mla_decode.mla_decode_plan_kernels import plan_ints

md = importlib.import_module("backends.kernels.mla_decode.mla_decode")
D_CKV, D_PE = 512, 64


def _docstring_example():
    """The examples of mla_decode's docstring, as doctest parses them."""
    (test,) = doctest.DocTestFinder().find(mla_decode, "mla_decode", globs={})
    assert test.examples, "mla_decode's docstring has no example"
    return test


def test_the_docstring_example_runs_as_written():
    """The example runs unchanged (here: the Triton stage 1 in the interpreter) and its output line holds."""
    test = _docstring_example()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.summarize(verbose=False) == (0, len(test.examples))


class _Launched(Exception):
    pass


def test_the_docstring_call_takes_the_wgmma_stage1_on_hopper(monkeypatch):
    """The same example with the device reporting compute capability 9: the call reaches the wgmma launcher (a
    stand-in that stops there) with a plan space the plan kernel fits in; nothing in the documented call makes it
    fall back to the Triton stage 1."""
    launched = {}

    def stand_in(q_nope, q_pe, kv, pt, sl, work, po, pl, out, *, programs, block_h, **_):
        launched.update(work=work.numel(), need=plan_ints(programs, q_nope.shape[0], q_nope.shape[1] // block_h))
        raise _Launched

    monkeypatch.setattr(md, "stage1_capability", lambda device, interp: 9)
    monkeypatch.setattr(md, "launch_wgmma_stage1", stand_in)
    test = _docstring_example()
    globs = {}
    with pytest.raises(_Launched):
        for ex in test.examples:
            exec(compile(ex.source, "<mla_decode docstring>", "exec"), globs)
    assert launched["work"] >= launched["need"]


@pytest.mark.parametrize("heads,batch", [(16, 1), (16, 64), (32, 64), (64, 64), (128, 64), (128, 16)])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_documented_workspace_gets_the_fast_kernels(heads, batch, kv_dtype):
    """For the shapes the wgmma kernels measured faster on (FlashMLA's grid included: 128 heads, 64 requests), the
    workspace of decode_workspace_shapes takes them on Hopper; on the CPU and older GPUs the Triton stage 1."""
    q = torch.zeros(batch, heads, D_CKV, dtype=torch.bfloat16)
    kv = torch.zeros(4, 64, D_CKV + D_PE).to(kv_dtype)
    _, _, work = decode_workspace_shapes(batch, heads).allocate("cpu")
    assert choose_stage1(q, kv, work, capability=9) == "wgmma"
    assert choose_stage1(q, kv, work, capability=0) == "triton"
    assert choose_stage1(q, kv, work, capability=8) == "triton"
    assert stage1_capability("cpu", interp=False) == 0 and stage1_capability("cuda", interp=True) == 0


def _call(work=None, B=2, H=16, use_wgmma=None, page=64, max_splits=8):
    kv = torch.zeros(B * 2, page, D_CKV + D_PE, dtype=torch.bfloat16)
    po, pl, w = decode_workspace_shapes(B, H, max_splits).allocate("cpu")
    return mla_decode(
        torch.zeros(B, H, D_CKV, dtype=torch.bfloat16), torch.zeros(B, H, D_PE, dtype=torch.bfloat16), kv,
        torch.zeros(B, 2, dtype=torch.int32), torch.ones(B, dtype=torch.int32), 0.1,
        torch.empty(B, H, D_CKV, dtype=torch.bfloat16), po, pl, w if work is None else work,
        max_splits=max_splits, use_wgmma=use_wgmma,
    )  # fmt: skip


def test_wgmma_requested_where_it_cannot_run_names_every_reason():
    with pytest.raises(ValueError) as e:
        _call(use_wgmma=True)  # the CPU: no Hopper GPU
    msg = str(e.value)
    assert "use_wgmma=True" in msg and "expected a Hopper GPU (wgmma; compute capability 9), got no GPU" in msg
    assert "Fix: pass use_wgmma=None" in msg
    with pytest.raises(ValueError, match=r"got no GPU; expected contiguous pages of a multiple of 64 tokens, got page "
                                         r"size 16.*Fix"):
        _call(use_wgmma=True, page=16)


def test_a_plan_space_too_small_is_an_error_on_every_device():
    """The old sizing (the plan of 8 programs) is refused on the CPU too, whichever stage 1 would run: the same
    workspace must run on Hopper."""
    B, H, slots = 2, 16, 64 * 8
    need = decode_work_ints(B, H, slots)
    with pytest.raises(ValueError) as e:
        _call(work=torch.empty(plan_ints(8, B, 1), dtype=torch.int32))
    msg = str(e.value)
    assert f"got {plan_ints(8, B, 1)} elements" in msg and f"at least {need} elements" in msg
    assert "Fix: allocate the workspace that decode_workspace_shapes(batch, heads, max_splits) gives" in msg
    with pytest.raises(ValueError, match="got dtype torch.int64"):
        _call(work=torch.empty(need, dtype=torch.int64))


def test_no_work_is_an_error_naming_the_workspace():
    B, H = 2, 16
    kv = torch.zeros(4, 64, D_CKV + D_PE, dtype=torch.bfloat16)
    po, pl, _ = decode_workspace_shapes(B, H).allocate("cpu")
    with pytest.raises(ValueError, match=r"got a NoneType.*decode_workspace_shapes"):
        mla_decode(torch.zeros(B, H, D_CKV, dtype=torch.bfloat16), torch.zeros(B, H, D_PE, dtype=torch.bfloat16), kv,
                   torch.zeros(B, 2, dtype=torch.int32), torch.ones(B, dtype=torch.int32), 0.1,
                   torch.empty(B, H, D_CKV, dtype=torch.bfloat16), po, pl, None)  # fmt: skip


def test_the_triton_mla_backend_hands_a_plan_space_big_enough():
    """The backend's workspace tail covers the plan of every batch it decodes (B <= split_slots requests over
    ``B * min(max_splits, split_slots // B)`` slots)."""
    from backends.triton_mla import _work_ints

    for split_slots, max_splits in ((2048, 2048), (2048, 8), (64, 64)):
        for heads in (4, 16, 20, 64, 128):
            for B in (1, 2, 3, 63, 64, split_slots // 2, split_slots):
                splits = max(1, min(max_splits, split_slots // B))
                assert decode_work_ints(B, heads, B * splits) <= _work_ints(split_slots, heads)
