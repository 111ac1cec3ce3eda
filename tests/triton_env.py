"""Where the Triton kernel tests run: compiled on a CUDA GPU, or in Triton's CPU interpreter.

conftest.py sets TRITON_INTERPRET=1 on a machine without CUDA before any kernel module is imported, so the same
small cases run interpreted on the CPU and compiled on the GPU; ``gpu``-marked tests add the real sizes.
"""

import importlib

import pytest
import torch

pytest.importorskip("triton")

_kernels = importlib.import_module("backends.kernels.mla_decode.mla_decode_kernels")
INTERPRETED = importlib.import_module("backends.kernels.checks").interpreted(_kernels._mla_decode_stage1_kernel)
if INTERPRETED:
    DEV = "cpu"
elif torch.cuda.is_available():
    DEV = "cuda"
else:
    pytest.skip("backends.kernels was imported before TRITON_INTERPRET=1 was set and there is no CUDA; "
                "run with TRITON_INTERPRET=1", allow_module_level=True)

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; a NaN in ``out`` fails the test (it never passes a bound)."""
    assert not torch.isnan(out).any(), "NaN in the kernel's output"
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def needs_gpu() -> None:
    """Skip unless the kernels run compiled on CUDA (real sizes, CUDA graphs)."""
    if not torch.cuda.is_available() or INTERPRETED:
        pytest.skip("needs CUDA (and compiled, not interpreted, kernels)")


def capture_graph(step) -> "torch.cuda.CUDAGraph":
    """``step`` (a launcher call, already compiled) run once on a side stream, as capture requires, then captured."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def replays_equal_eager(graph, step, out: torch.Tensor, seq_lens: torch.Tensor, cases):
    """For each lengths list in ``cases``: ``seq_lens`` set in place, ``step`` run eagerly, then ``graph`` replayed
    (``out`` NaN-filled before each); asserts both give the same bits and yields the lengths, ``out`` holding the
    replay's result."""
    for lens in cases:
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        out.fill_(float("nan"))
        step()
        eager = out.clone()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        yield lens
