"""Linear attention (simple-GLA / lightning form): the chunked prefill and the recurrent step against the
token-by-token reference, the state pool, and the backend through ForwardBatch (EXTEND then DECODE).

CPU tests compare float32 paths with the float64 reference on fresh random inputs. GPU tests (marked ``gpu``)
compare fla-core's Triton kernels with the torch path on bf16 inputs, and replay the decode step in a CUDA graph.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from backends import linear_attn_ops as ops
from backends.base import CudaGraphLevel
from backends.linear_attention import LinearAttentionBackend
from runtime.core.batch import ForwardMode, make_batch
from runtime.core.state_pool import LinearStatePool

H, DK, DV = 4, 16, 8
SCALE = DK**-0.5
F32_TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def qkv(t: int, gen: torch.Generator, h: int = H, dk: int = DK, dv: int = DV, device="cpu", dtype=torch.float32):
    q, k = (torch.randn(t, h, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, h, dv, generator=gen)
    return tuple(x.to(device=device, dtype=dtype) for x in (q, k, v))


def reference64(q, k, v, g, s0):
    """The oracle: the token loop in float64."""
    return ops.recurrent_reference(q.double(), k.double(), v.double(), g.double(), s0.double(), SCALE)


# ------------------------------------------------------------------------------------------------ the math
def test_decay_rates_are_alibi_slopes():
    g = ops.decay_rates(8)
    assert g.dtype == torch.float32 and g.shape == (8,)
    assert torch.allclose(g, torch.tensor([-(2.0 ** (-(h + 1))) for h in range(8)]))
    assert (g < 0).all() and (g[1:] > g[:-1]).all()
    with pytest.raises(ValueError, match="num_heads"):
        ops.decay_rates(0)


def test_convention_decay_first_and_output_includes_current_token():
    """fla's convention, by hand: S_t = exp(g) S_{t-1} + k_t^T v_t, o_t = scale * q_t S_t."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = qkv(2, gen)
    g = ops.decay_rates(H)
    s0 = torch.randn(H, DK, DV, generator=gen)
    s1 = torch.exp(g)[:, None, None] * s0 + k[0, :, :, None] * v[0, :, None, :]
    s2 = torch.exp(g)[:, None, None] * s1 + k[1, :, :, None] * v[1, :, None, :]
    want = torch.stack([torch.einsum("hk,hkv->hv", q[0], s1), torch.einsum("hk,hkv->hv", q[1], s2)]) * SCALE
    o, s = ops.recurrent_reference(q, k, v, g, s0, SCALE)
    assert rel_err(o, want) < F32_TOL and rel_err(s, s2) < F32_TOL
    o, s = ops.chunked_prefill(q, k, v, g, s0, SCALE, chunk_size=16)
    assert rel_err(o, want) < F32_TOL and rel_err(s, s2) < F32_TOL


@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("t", [1, 7, 63, 64, 65, 200])
def test_chunked_prefill_matches_reference(t, chunk_size):
    gen = torch.Generator().manual_seed(1000 * t + chunk_size)
    q, k, v = qkv(t, gen)
    g = ops.decay_rates(H)
    s0 = torch.randn(H, DK, DV, generator=gen)
    s0_before = s0.clone()
    o, s = ops.chunked_prefill(q, k, v, g, s0, SCALE, chunk_size=chunk_size)
    o_ref, s_ref = reference64(q, k, v, g, s0)
    assert o.dtype == torch.float32 and o.shape == (t, H, DV) and s.shape == (H, DK, DV)
    assert rel_err(o, o_ref) < F32_TOL, rel_err(o, o_ref)
    assert rel_err(s, s_ref) < F32_TOL, rel_err(s, s_ref)
    assert torch.equal(s0, s0_before)  # the initial state is not modified
    # the float32 reference is as close to the float64 one
    o32, s32 = ops.recurrent_reference(q, k, v, g, s0, SCALE)
    assert rel_err(o32, o_ref) < F32_TOL and rel_err(s32, s_ref) < F32_TOL


def test_chunked_prefill_bf16_inputs_compute_in_float32():
    gen = torch.Generator().manual_seed(7)
    q, k, v = qkv(65, gen, dtype=torch.bfloat16)
    g, s0 = ops.decay_rates(H), torch.zeros(H, DK, DV)
    o, s = ops.chunked_prefill(q, k, v, g, s0, SCALE)
    o_ref, s_ref = reference64(q, k, v, g, s0)  # the same bf16 values, in float64
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-2 and rel_err(s, s_ref) < F32_TOL


@pytest.mark.parametrize("t1", [0, 1, 30, 64])
def test_prefill_then_decode_equals_one_prefill(t1):
    t = 70
    gen = torch.Generator().manual_seed(t1)
    q, k, v = qkv(t, gen)
    g = ops.decay_rates(H)
    s0 = torch.randn(H, DK, DV, generator=gen)
    o_all, s_all = ops.chunked_prefill(q, k, v, g, s0, SCALE)
    o1, state = ops.chunked_prefill(q[:t1], k[:t1], v[:t1], g, s0, SCALE)
    state = state.unsqueeze(0)  # [B=1, H, Dk, Dv], advanced in place
    outs = [o1]
    for i in range(t1, t):
        outs.append(ops.recurrent_step(q[i : i + 1], k[i : i + 1], v[i : i + 1], g, state, SCALE))
    assert rel_err(torch.cat(outs), o_all) < F32_TOL
    assert rel_err(state[0], s_all) < F32_TOL


def test_recurrent_step_batched_rows_are_independent():
    gen = torch.Generator().manual_seed(3)
    b = 5
    q, k, v = qkv(b, gen)  # one token of each of b requests
    g = ops.decay_rates(H)
    state = torch.randn(b, H, DK, DV, generator=gen)
    want = [reference64(q[i : i + 1], k[i : i + 1], v[i : i + 1], g, state[i]) for i in range(b)]
    o = ops.recurrent_step(q, k, v, g, state, SCALE)
    assert rel_err(o, torch.cat([w[0] for w in want])) < F32_TOL
    assert rel_err(state, torch.stack([w[1] for w in want])) < F32_TOL


@pytest.mark.parametrize("split", [1, 50, 64, 99])
def test_two_prefill_chunks_equal_one(split):
    t = 100
    gen = torch.Generator().manual_seed(split)
    q, k, v = qkv(t, gen)
    g = ops.decay_rates(H)
    s0 = torch.zeros(H, DK, DV)
    o_all, s_all = ops.chunked_prefill(q, k, v, g, s0, SCALE)
    o1, s1 = ops.chunked_prefill(q[:split], k[:split], v[:split], g, s0, SCALE)
    o2, s2 = ops.chunked_prefill(q[split:], k[split:], v[split:], g, s1, SCALE)
    assert rel_err(torch.cat([o1, o2]), o_all) < F32_TOL and rel_err(s2, s_all) < F32_TOL


def test_op_shape_errors_say_what_and_fix():
    g = ops.decay_rates(H)
    q, k, v = qkv(3, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"initial_state has shape .*expected \(4, 16, 8\).*Fix"):
        ops.chunked_prefill(q, k, v, g, torch.zeros(H, DV, DK), SCALE)
    with pytest.raises(ValueError, match=r"state is torch.bfloat16; expected torch.float32"):
        ops.recurrent_step(q, k, v, g, torch.zeros(3, H, DK, DV, dtype=torch.bfloat16), SCALE)
    with pytest.raises(ValueError, match=r"q has 4 dims"):
        ops.chunked_prefill(q[None], k, v, g, torch.zeros(H, DK, DV), SCALE)


# ----------------------------------------------------------------------------------------------- the pool
def test_state_pool_layout_reset_and_bytes():
    pool = LinearStatePool([1, 3], max_requests=6, num_heads=H, head_k_dim=DK, head_v_dim=DV,
                           device=torch.device("cpu"))
    assert pool.states.shape == (2, 7, H, DK, DV) and pool.states.dtype == torch.float32
    assert pool.state(3).shape == (6, H, DK, DV) and pool.buffer(3).shape == (7, H, DK, DV)
    assert pool.padding_row == 6
    assert pool.nbytes == LinearStatePool.planned_bytes(2, 6, H, DK, DV) == 2 * 7 * H * DK * DV * 4
    assert pool.state(3).data_ptr() == pool.states[1].data_ptr()  # a view, not a copy
    pool.states.normal_()
    kept = pool.states.clone()
    pool.reset([2, 5])
    assert (pool.states[:, [2, 5]] == 0).all()
    others = [r for r in range(7) if r not in (2, 5)]
    assert torch.equal(pool.states[:, others], kept[:, others])
    with pytest.raises(IndexError, match=r"rows \[6\].*\[0, 6\)"):
        pool.reset([6])
    with pytest.raises(KeyError, match=r"layer_id=2.*\[1, 3\]"):
        pool.state(2)
    with pytest.raises(ValueError, match="duplicates"):
        LinearStatePool([1, 1], 2, H, DK, DV, torch.device("cpu"))


# -------------------------------------------------------------------------------------------- the backend
def _dummy_loc(n: int, device) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device=device)


def run_backend_scenario(impl: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """EXTEND 3 requests of different lengths, 4 DECODE steps (the last one with a graph-style padding entry
    pointing at row 0), then a chunked-prefill continuation of one request next to a fresh one.

    Returns (outputs per request, reference outputs per request, pool, untouched-row checks).
    """
    gen = torch.Generator().manual_seed(seed)
    layers = [1, 3]
    pool = LinearStatePool(layers, max_requests=6, num_heads=H, head_k_dim=DK, head_v_dim=DV, device=device)
    pool.states.copy_(torch.randn(pool.states.shape, generator=gen))  # garbage everywhere
    backend = LinearAttentionBackend(pool, H, DK, DV, impl=impl)
    rows, lens = [4, 0, 2], [5, 70, 1]
    pool.reset(rows)  # the engine resets admitted rows
    untouched = pool.states[:, [1, 3, 5]].clone()
    other_layer = pool.buffer(3).clone()
    total = {r: n for r, n in zip(rows, lens)}
    n_decode = 4
    full = {r: qkv(total[r] + n_decode + (10 if r == 4 else 0), gen, dtype=dtype) for r in rows}
    got = {r: [] for r in rows}

    def step(mode, req_rows, prefix, ext):
        batch = make_batch(mode, req_rows, prefix, ext, _dummy_loc(sum(ext), device), device)
        parts = [[full[r][i][p : p + e] for r, p, e in zip(req_rows, prefix, ext)] for i in range(3)]
        q, k, v = (torch.cat(x).to(device) for x in parts)
        backend.init_forward_metadata(batch)
        o = backend.forward(q, k, v, 1, batch)
        assert o.dtype == dtype and o.shape == (sum(ext), H, DV)
        qo = batch.qo_indptr_cpu.tolist()
        for b, r in enumerate(req_rows):
            got[r].append(o[qo[b] : qo[b + 1]])

    step(ForwardMode.EXTEND, rows, [0, 0, 0], lens)
    for _ in range(n_decode - 1):
        step(ForwardMode.DECODE, rows, [total[r] for r in rows], [1, 1, 1])
        total = {r: n + 1 for r, n in total.items()}
    # graph-runner padding: an extra entry on the padding row with seq_len 1; its output is dropped, and no
    # live row (row 0 included) may change
    pad = make_batch(ForwardMode.DECODE, rows + [pool.padding_row], [total[r] for r in rows] + [0], [1, 1, 1, 1],
                     _dummy_loc(4, device), device)
    junk = qkv(1, gen, dtype=dtype)  # the padding entry's inputs: anything
    q, k, v = (torch.cat([full[r][i][total[r] : total[r] + 1] for r in rows] + [junk[i]]).to(device)
               for i in range(3))
    backend.init_forward_metadata(pad)
    o = backend.forward(q, k, v, 1, pad)
    for b, r in enumerate(rows):
        got[r].append(o[b : b + 1])
    total = {r: n + 1 for r, n in total.items()}
    # chunked-prefill continuation (row 4, 10 more tokens over its carried state) next to a fresh request in
    # row 1 whose row holds garbage (no reset): a request with no prefix starts from zero regardless
    fresh = qkv(9, gen, dtype=dtype)
    full[1], got[1] = fresh, []
    batch = make_batch(ForwardMode.EXTEND, [4, 1], [total[4], 0], [10, 9], _dummy_loc(19, device), device)
    q, k, v = (torch.cat([full[4][i][total[4] : total[4] + 10], fresh[i]]).to(device) for i in range(3))
    backend.init_forward_metadata(batch)
    o = backend.forward(q, k, v, 1, batch)
    got[4].append(o[:10])
    got[1].append(o[10:])
    total[4] += 10
    total[1] = 9

    g = ops.decay_rates(H)
    zero = torch.zeros(H, DK, DV)
    want = {r: reference64(*(x[: total[r]].cpu() for x in full[r]), g, zero) for r in total}
    outs = {r: torch.cat(got[r]).cpu() for r in total}
    return outs, want, pool, untouched, other_layer, total


def test_backend_extend_decode_matches_reference_and_touches_only_its_rows():
    outs, want, pool, untouched, other_layer, total = run_backend_scenario("torch", torch.device("cpu"),
                                                                           torch.float32)
    for r in total:
        assert outs[r].shape == (total[r], H, DV)
        assert rel_err(outs[r], want[r][0]) < F32_TOL, (r, rel_err(outs[r], want[r][0]))
        assert rel_err(pool.state(1)[r], want[r][1]) < F32_TOL, r
    assert torch.equal(pool.states[:, [3, 5]], untouched[:, 1:])  # rows of no request
    assert torch.equal(pool.buffer(3), other_layer)  # the other linear layer
    pool.reset([4])
    assert (pool.states[:, 4] == 0).all() and pool.state(1)[0].abs().sum() > 0


def test_backend_capabilities_and_constructor_errors():
    caps = LinearAttentionBackend.capabilities
    assert caps.forward_modes == frozenset({ForwardMode.EXTEND, ForwardMode.DECODE})
    assert caps.graph_level(ForwardMode.DECODE) == CudaGraphLevel.SINGLE_TOKEN_DECODE
    assert caps.graph_level(ForwardMode.EXTEND) == CudaGraphLevel.NEVER
    assert caps.devices == frozenset({"cpu", "cuda"})
    pool = LinearStatePool([0], 2, H, DK, DV, torch.device("cpu"))
    with pytest.raises(ValueError) as e:
        LinearAttentionBackend(pool, H, DK, DV + 1, impl="triton")
    msg = str(e.value)
    assert "impl: got 'triton'" in msg and "['torch', 'fla']" in msg and f"expected {(H, DK, DV + 1)}" in msg
    with pytest.raises(ValueError, match="impl=fla: state pool is on cpu"):
        LinearAttentionBackend(pool, H, DK, DV, impl="fla")
    backend = LinearAttentionBackend(pool, H, DK, DV, impl="torch")
    batch = make_batch(ForwardMode.TARGET_VERIFY, [0], [3], [2], _dummy_loc(2, "cpu"), torch.device("cpu"))
    with pytest.raises(ValueError, match="forward mode target_verify"):
        backend.init_forward_metadata(batch)
    batch = make_batch(ForwardMode.EXTEND, [0], [0], [3], _dummy_loc(3, "cpu"), torch.device("cpu"))
    backend.init_forward_metadata(batch)
    q, k, v = qkv(3, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"v \(3, 4, 16\) \(expected \(3, 4, 8\)\)"):
        backend.forward(q, k, q, 0, batch)


# ------------------------------------------------------------------------------------------------------ GPU
FLA_OK = importlib.util.find_spec("fla") is not None
BF16_TOL = 2e-2


def gpu_fla(fn):
    """Mark ``gpu``; skip without CUDA or without fla-core."""
    fn = pytest.mark.skipif(not FLA_OK, reason="fla-core is not importable")(fn)
    fn = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(fn)
    return pytest.mark.gpu(fn)


def _gpu_inputs(t, h, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = qkv(t, gen, h, dk, dv)
    s0 = torch.randn(h, dk, dv, generator=gen)
    dev = torch.device("cuda")
    return (*(x.to(dev, torch.bfloat16) for x in (q, k, v)), ops.decay_rates(h).to(dev), s0.to(dev))


@gpu_fla
@pytest.mark.parametrize("t", [1, 7, 63, 64, 65, 1000])
@pytest.mark.parametrize("h,dk,dv", [(4, 64, 64), (8, 128, 64)])
def test_gpu_fla_prefill_matches_torch(t, h, dk, dv):
    q, k, v, g, s0 = _gpu_inputs(t, h, dk, dv, seed=t + h)
    scale = dk**-0.5
    o_t, s_t = ops.chunked_prefill(q, k, v, g, s0, scale)
    o_f, s_f = ops.fla_chunk_prefill(q, k, v, g, s0, scale)
    assert o_f.dtype == torch.bfloat16 and s_f.dtype == torch.float32 and s_f.shape == (h, dk, dv)
    assert rel_err(o_f, o_t) < BF16_TOL, rel_err(o_f, o_t)
    assert rel_err(s_f, s_t) < BF16_TOL, rel_err(s_f, s_t)
    # fla's own torch oracle, naive_recurrent_simple_gla with the per-token gate g broadcast over T
    from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

    o_n, s_n = naive_recurrent_simple_gla(q[None], k[None], v[None], g.expand(1, t, h), scale=scale,
                                          initial_state=s0[None], output_final_state=True)
    assert rel_err(o_t, o_n[0]) < 1e-2 and rel_err(s_t, s_n[0]) < 1e-4


@gpu_fla
@pytest.mark.parametrize("b,h,dk,dv", [(1, 4, 64, 64), (33, 8, 128, 64)])
def test_gpu_fla_decode_matches_torch(b, h, dk, dv):
    q, k, v, g, _ = _gpu_inputs(b, h, dk, dv, seed=b)
    state = torch.randn(b, h, dk, dv, device="cuda")
    s_t, s_f = state.clone(), state.clone()
    scale = dk**-0.5
    for _ in range(3):
        o_t = ops.recurrent_step(q, k, v, g, s_t, scale)
        o_f = ops.fla_recurrent_step(q, k, v, g, s_f, scale)
        assert rel_err(o_f, o_t) < BF16_TOL and rel_err(s_f, s_t) < 1e-4


@gpu_fla
@pytest.mark.parametrize("impl", ["torch", "fla"])
def test_gpu_backend_scenario(impl):
    outs, want, pool, untouched, other_layer, total = run_backend_scenario(impl, torch.device("cuda"),
                                                                           torch.bfloat16)
    for r in total:
        assert rel_err(outs[r], want[r][0]) < BF16_TOL, (r, rel_err(outs[r], want[r][0]))
        assert rel_err(pool.state(1)[r].cpu(), want[r][1]) < BF16_TOL, r
    assert torch.equal(pool.states[:, [3, 5]], untouched[:, 1:])
    assert torch.equal(pool.buffer(3), other_layer)


@gpu_fla
@pytest.mark.parametrize("impl", ["torch", "fla"])
def test_gpu_decode_replays_in_a_cuda_graph(impl):
    """Capture one decode step (4 slots: 3 live rows + 1 graph-runner padding entry on the padding row), replay
    it twice with new inputs; the states and outputs equal eager steps, row 0's live state is not clobbered."""
    dev = torch.device("cuda")
    pool = LinearStatePool([0], 8, H, 64, 64, dev)
    backend = LinearAttentionBackend(pool, H, 64, 64, impl=impl)
    gen = torch.Generator().manual_seed(5)
    pool.states.copy_(torch.randn(pool.states.shape, generator=gen))
    rows = [0, 5, 2]
    static = make_batch(ForwardMode.DECODE, rows + [pool.padding_row], [9, 3, 4, 0], [1, 1, 1, 1],
                        _dummy_loc(4, dev), dev)
    q, k, v = (torch.zeros(4, H, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    eager_state = pool.state(0)[rows].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    saved = pool.states.clone()
    with torch.cuda.stream(stream):
        for _ in range(2):
            backend.forward(q, k, v, 0, static)  # warm-up (fla autotunes on its first call)
    torch.cuda.current_stream().wait_stream(stream)
    pool.states.copy_(saved)
    graph = torch.cuda.CUDAGraph()
    backend.init_forward_metadata_capture(static)
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, 0, static)
    pool.states.copy_(saved)  # capture does not run the kernels, but be explicit
    g = ops.decay_rates(H).to(dev)
    for _ in range(2):
        new = [torch.randn(4, H, 64, generator=gen).to(dev, torch.bfloat16) for _ in range(3)]
        for buf, x in zip((q, k, v), new):
            buf.copy_(x)
        backend.init_forward_metadata_replay(static)
        graph.replay()
        want = ops.recurrent_step(new[0][:3], new[1][:3], new[2][:3], g, eager_state, 64**-0.5)
        torch.cuda.synchronize()
        assert rel_err(out[:3], want) < BF16_TOL
        assert rel_err(pool.state(0)[rows], eager_state) < 1e-4
    untouched = [r for r in range(8) if r not in rows]
    assert torch.equal(pool.state(0)[untouched], saved[0, untouched])
