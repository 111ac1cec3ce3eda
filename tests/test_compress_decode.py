"""The fused V4 compressor decode step (backends/kernels/dsv4/compress_decode.py) against the torch ops it replaces
(:func:`runtime.model.dsv4.compressor.compress_decode_rope`: ``compress_decode``, then the entry's RoPE).

Both run over several decode steps in a row from the same state (rows filled by ``compress_step`` prompts of
different lengths first, so windows close at different steps for different requests), batch 1 and 5 with rows out
of order, overlapping (width 2 * dim) and not, rates 4, 8 and 128 (128 also in chunks of slots). After every step
the state (pending and prev series) must be bit-equal to the torch one, and the entries equal up to float32
summation order.

CPU: Triton's interpreter in float16 and float32 (its bfloat16 casts truncate), states in float32 (what
``DSV4Pools`` allocates for 16-bit and float32 models). Measured on the interpreter (states always bit-equal):
float16 entries bit-equal to torch's, except 3 of 1600 values when rate 128 runs in chunks of 16 slots (2 ulp of
the value, 0.09 float16 eps of the row's largest: the softmax sum's order); float32 entries differ in about half
the values, by at most 4.6 float32 eps of the row's largest value (1.4e-6 absolute; float32 summation order).
The interpreter's launches mix a whole row per program unless a test asks for channel blocks (its time grows with
the programs): ``test_channel_blocks`` runs several, the last one partial. ``gpu`` tests: V4-Flash widths in bfloat16
(CSA kv dim 512 and indexer dim 128 at rate 4, overlapping; HCA dim 512 at rate 128), batch 1 and 32, the launcher's
channel blocks and blocks of 128, and a CUDA-graph replay (the launcher's blocks) equal to the eager call.
"""

from __future__ import annotations

import pytest
import torch
from triton_env import DEV, needs_gpu

from backends.kernels.dsv4 import compress_decode as cd
from runtime.core.dsv4_pools import CompressorStatePool
from runtime.model.deepseek.ops import FusedOps, TorchOps
from runtime.model.deepseek.rope import RopeParams, inv_freq_on
from runtime.model.dsv4.compressor import compress_decode, compress_decode_rope, compress_step

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER, EPS = 3, 1e-6
ROPE = RopeParams(theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
STATE = ("pending_kv", "pending_gate", "prev_kv", "prev_gate")
#: |fused - torch| <= BOUND * eps(dtype) * the row's largest |value| (measured: float16 0.09, float32 4.6)
BOUND = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 16}


def make_case(rate, dim, overlap, dt, prefill, dev, seed=0):
    """Weights, and two equal state pools (layers [1, LAYER]) whose rows hold ``prefill[row]`` prompt tokens."""
    g = torch.Generator(device=dev).manual_seed(seed)
    width = 2 * dim if overlap else dim
    bias = (0.5 * torch.randn(rate, width, generator=g, device=dev)).to(dt)
    norm = (1 + 0.1 * torch.randn(dim, generator=g, device=dev)).to(dt)
    pools = [CompressorStatePool([1, LAYER], max(prefill) + 1, rate, width, dim if overlap else 0, torch.device(dev))
             for _ in range(2)]
    for row, n in prefill.items():
        if n:
            kv, gate = torch.randn(n, width, generator=g, device=dev).to(dt), \
                (2 * torch.randn(n, width, generator=g, device=dev)).to(dt)
            for p in pools:
                compress_step(kv, gate, bias, norm, EPS, p, LAYER, row, 0)
    return g, bias, norm, pools


def fused(kv, gate, bias, norm, st, rows, pos, rope_dim, max_tile=cd.MAX_TILE, block_c=None):
    li, overlap = st.layer(LAYER), st.prev_kv is not None
    return cd.compress_decode(kv, gate, bias, norm, EPS, st.pending_kv[li], st.pending_gate[li],
                              st.prev_kv[li] if overlap else None, st.prev_gate[li] if overlap else None, rows, pos,
                              inv_freq_on(ROPE, rope_dim, pos.device, torch.float32), ROPE.attention_factor,
                              max_tile=max_tile, block_c=block_c)


def check_entries(got, want, dt):
    assert got.dtype == want.dtype == dt and got.shape == want.shape and not torch.isnan(got).any()
    scale = want.abs().amax(dim=1, keepdim=True).double()
    err = ((got.double() - want.double()).abs() / scale).max()
    assert err <= BOUND[dt] * torch.finfo(dt).eps, f"{float(err):.3g} of the row's largest value"
    return int((got != want).sum())


def run_steps(rate, dim, overlap, dt, prefill, rows, steps, rope_dim, dev, max_tile=cd.MAX_TILE, index_dtype=None,
              block_c=None):
    """``steps`` decode steps of ``rows`` through torch and the kernel; returns (differing entries, all entries)."""
    g, bias, norm, (ref, mine) = make_case(rate, dim, overlap, dt, prefill, dev)
    width = 2 * dim if overlap else dim
    pos = {r: prefill[r] for r in rows}
    closed, differ = set(), 0
    for step in range(steps):
        kv = torch.randn(len(rows), width, generator=g, device=dev).to(dt)
        gate = (2 * torch.randn(len(rows), width, generator=g, device=dev)).to(dt)
        r = torch.tensor(rows, device=dev, dtype=index_dtype or torch.int64)
        p = torch.tensor([pos[x] for x in rows], device=dev)
        want = compress_decode_rope(kv, gate, bias, norm, EPS, ref, LAYER, r, p, ROPE, rope_dim)
        got = fused(kv, gate, bias, norm, mine, r, p, rope_dim, max_tile, block_c)
        differ += check_entries(got, want, dt)
        for name in STATE:
            if getattr(ref, name) is not None:
                assert torch.equal(getattr(mine, name), getattr(ref, name)), name
        for x in rows:
            if pos[x] % rate == rate - 1:
                closed.add((x, step))
            pos[x] += 1
    # windows closed, at different steps for different requests (where there are several)
    assert len({s for _, s in closed}) >= min(2, len(rows))
    return differ, steps * len(rows) * dim


CASES = [  # rate, dim, overlap, prefill (row -> prompt tokens), rows of the batch in order
    pytest.param(4, 32, True, {4: 0, 1: 5, 3: 2, 0: 9, 2: 3}, [4, 1, 3, 0, 2], id="csa-r4-b5"),
    pytest.param(4, 32, False, {4: 0, 1: 5, 3: 2, 0: 9, 2: 3}, [4, 1, 3, 0, 2], id="r4-b5"),
    pytest.param(8, 48, True, {2: 3}, [2], id="csa-r8-b1"),
    pytest.param(8, 16, False, {0: 6, 3: 0, 1: 13}, [3, 0, 1], id="r8-b3"),
    pytest.param(128, 32, False, {4: 120, 1: 125, 3: 127, 0: 1, 2: 250}, [4, 1, 3, 0, 2], id="hca-r128-b5"),
]


@pytest.mark.parametrize("dt", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("rate,dim,overlap,prefill,rows", CASES)
def test_fused_equals_torch_over_steps(rate, dim, overlap, prefill, rows, dt):
    steps = 2 * rate + 3 if rate <= 8 else 10  # rate 128: the prompts end close to a window's end
    differ, total = run_steps(rate, dim, overlap, dt, prefill, rows, steps, 16, DEV)
    if dt == torch.float16:
        assert differ <= total // 100


def test_window_in_chunks_of_slots():
    """A window longer than one tile (rate 128 in chunks of 16 slots; overlapping rate 8 in chunks of 4): three
    passes (max, sum, weighted sum) give the one-tile results; int32 rows."""
    run_steps(128, 32, False, torch.float16, {4: 120, 1: 125, 3: 127, 0: 1, 2: 250}, [4, 1, 3, 0, 2], 4, 16, DEV,
              max_tile=16 * 32, index_dtype=torch.int32)
    run_steps(8, 48, True, torch.float16, {2: 3, 0: 7}, [2, 0], 19, 16, DEV, max_tile=4 * 64)


def test_channel_blocks():
    """The mix on several channel blocks per request (the GPU launch's grid; the interpreter's default is one block
    per row): overlapping dim 42 in blocks of 16, the last one 10 channels wide (series B at pending channel 42 + c,
    prev moved per block); not overlapping, dim 20 in blocks of 8."""
    run_steps(4, 42, True, torch.float16, {0: 2, 1: 5}, [1, 0], 3, 16, DEV, block_c=16)
    run_steps(4, 20, False, torch.float16, {0: 2, 1: 1}, [0, 1], 3, 16, DEV, block_c=8)
    _, bias, norm, (_, st) = make_case(4, 20, False, torch.float16, {0: 0}, DEV)
    kv, one = torch.zeros(1, 20, dtype=torch.float16, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="block_c a power of two; got 12"):
        fused(kv, kv, bias, norm, st, one, one, 16, block_c=12)


def test_rope_over_the_whole_row():
    run_steps(4, 32, True, torch.float16, {1: 2, 0: 3}, [1, 0], 9, 32, DEV)


def test_without_rope_equals_compress_decode():
    """inv_freq of 0 elements: the kernel gives compress_decode's candidates themselves."""
    g, bias, norm, (ref, mine) = make_case(4, 32, True, torch.float16, {1: 2, 0: 3}, DEV)
    rows, pos = torch.tensor([1, 0], device=DEV), torch.tensor([2, 3], device=DEV)
    for step in range(6):
        kv, gate = torch.randn(2, 64, generator=g, device=DEV).half(), torch.randn(2, 64, generator=g, device=DEV).half()
        want = compress_decode(kv, gate, bias, norm, EPS, ref, LAYER, rows, pos + step)
        li = mine.layer(LAYER)
        got = cd.compress_decode(kv, gate, bias, norm, EPS, mine.pending_kv[li], mine.pending_gate[li],
                                 mine.prev_kv[li], mine.prev_gate[li], rows, pos + step,
                                 torch.empty(0, device=DEV), ROPE.attention_factor)
        check_entries(got, want, torch.float16)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_ops_method_wires_the_kernel(overlap):
    """FusedOps.compress_decode (the kernel) and TorchOps.compress_decode (the torch function) from one state; a
    float64 state (a float64 model) takes the torch path in FusedOps, which the launcher refuses."""
    for dt in (torch.float16, torch.float64):
        _, bias, norm, (ref, mine) = make_case(4, 32, overlap, dt, {0: 2, 1: 5, 2: 0}, DEV)
        if dt == torch.float64:
            for st in (ref, mine):
                for name in STATE:
                    if getattr(st, name) is not None:
                        setattr(st, name, getattr(st, name).double())
        width = bias.shape[1]
        rows, pos = torch.tensor([2, 0, 1], device=DEV), torch.tensor([0, 2, 5], device=DEV)
        for step in range(5):
            kv, gate = torch.randn(3, width, device=DEV).to(dt), torch.randn(3, width, device=DEV).to(dt)
            want = TorchOps().compress_decode(kv, gate, bias, norm, EPS, ref, LAYER, rows, pos + step, ROPE, 16)
            got = FusedOps().compress_decode(kv, gate, bias, norm, EPS, mine, LAYER, rows, pos + step, ROPE, 16)
            if dt == torch.float64:
                assert torch.equal(got, want)
            else:
                check_entries(got, want, dt)
        for name in STATE:
            if getattr(ref, name) is not None:
                assert torch.equal(getattr(mine, name), getattr(ref, name))
    with pytest.raises(ValueError, match="float64"):
        fused(kv, gate, bias, norm, mine, rows, pos, 16)


# ---------------------------------------------------------------------------------------- GPU
FLASH = [  # V4-Flash: the CSA kv and indexer compressors (rate 4, overlapping), HCA (rate 128)
    pytest.param(4, 512, True, id="csa-kv"), pytest.param(4, 128, True, id="csa-index"),
    pytest.param(128, 512, False, id="hca"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("block_c", [None, 128], ids=["auto", "c128"])
@pytest.mark.parametrize("batch", [1, 32])
@pytest.mark.parametrize("rate,dim,overlap", FLASH)
def test_gpu_flash_widths_bf16(rate, dim, overlap, batch, block_c):
    """The launcher's channel blocks (16 channels for dim 512: 32 programs per request; 8 for dim 128: 16) and
    blocks of 128 (4 per request for dim 512, the whole row for the indexer's dim 128; HCA's window then in 2 chunks
    of 64 slots)."""
    needs_gpu()
    assert dim // cd.block_channels(dim) >= 16  # batch 1 spreads over at least 16 programs
    gen = torch.Generator().manual_seed(batch)
    rows = torch.randperm(batch + 3, generator=gen)[:batch].tolist()  # rows out of order, some unused
    prefill = {r: int(torch.randint(0, 3 * rate, (1,), generator=gen)) for r in range(batch + 3)}
    differ, total = run_steps(rate, dim, overlap, torch.bfloat16, prefill, rows, rate + 3 if rate <= 8 else 2 * rate,
                              64, "cuda", block_c=block_c)
    assert differ <= total // 100


@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager():
    needs_gpu()
    from triton_env import capture_graph

    _, bias, norm, (st, _) = make_case(4, 512, True, torch.bfloat16, {r: 3 * r for r in range(9)}, "cuda")
    rows = torch.tensor([5, 2, 7, 0, 8, 1, 3, 4], device="cuda")
    pos = torch.tensor([3 * r for r in rows.tolist()], device="cuda")
    kv, gate = torch.randn(8, 1024, device="cuda").bfloat16(), torch.randn(8, 1024, device="cuda").bfloat16()
    saved = {n: getattr(st, n).clone() for n in STATE}
    out = {}

    def step():
        out["e"] = fused(kv, gate, bias, norm, st, rows, pos, 64)

    graph = capture_graph(step)  # runs it once on a side stream first (state changed): restore, then run eagerly
    replayed = out["e"]  # the captured call's output, which replays write
    for n in STATE:
        getattr(st, n).copy_(saved[n])
    step()
    eager, eager_state = out["e"].clone(), {n: getattr(st, n).clone() for n in STATE}
    for n in STATE:
        getattr(st, n).copy_(saved[n])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, eager)
    for n in STATE:
        assert torch.equal(getattr(st, n), eager_state[n])
