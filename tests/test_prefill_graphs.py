"""Graphed prefill on the CPU (runtime/engine/prefill_graphs.py): the padded layout, and the static buffers a replay
reads, with capture replaced by an eager stand-in that re-runs the captured function over the inputs it captured
(as a replay does). The function reads only the static device buffers; the host mirrors the backend's hooks get
describe the same layout. Real capture runs on a GPU (tests/test_engine_gpu.py, tests/test_prefill_graphs_gpu.py)."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.core.batch import ForwardBatch, ForwardMode, make_batch
from runtime.core.parallel import CollectiveStats
from runtime.engine import prefill_graphs
from runtime.engine.graph_runner import GraphDecision
from runtime.engine.prefill_graphs import PrefillGraphs, padded_layout

CPU = torch.device("cpu")
PAD_ROW = 99


def test_padded_layout_puts_the_padding_request_after_the_steps_and_empties_last():
    req, seq, ext, qo = padded_layout(64, 6, PAD_ROW, torch.tensor([3, 0, 5]),
                                      torch.tensor([40, 7, 1], dtype=torch.int32), torch.tensor([10, 7, 1], dtype=torch.int32))
    assert req.tolist() == [3, 0, 5, PAD_ROW, PAD_ROW, PAD_ROW]
    assert ext.tolist() == [10, 7, 1, 46, 0, 0] and seq.tolist() == [40, 7, 1, 46, 0, 0]
    assert qo.tolist() == [0, 10, 17, 18, 64, 64, 64]
    # capture: no request of the step, the padding holds every row (the attention grid every replay needs)
    none = torch.zeros(0, dtype=torch.int64)
    req, seq, ext, qo = padded_layout(32, 4, PAD_ROW, none, none.int(), none.int())
    assert req.tolist() == [PAD_ROW] * 4 and ext.tolist() == [32, 0, 0, 0] and qo.tolist() == [0, 32, 32, 32, 32]
    # an exact fit: the padding request is empty
    _, seq, ext, qo = padded_layout(8, 3, PAD_ROW, torch.tensor([1]), torch.tensor([8], dtype=torch.int32),
                                    torch.tensor([8], dtype=torch.int32))
    assert ext.tolist() == [8, 0, 0] and seq.tolist() == [8, 0, 0] and qo.tolist() == [0, 8, 8, 8]
    with pytest.raises(ValueError, match="do not fit 2 requests"):
        padded_layout(8, 3, PAD_ROW, torch.tensor([1, 2, 3]), torch.ones(3, dtype=torch.int32),
                      torch.ones(3, dtype=torch.int32))


class _EagerGraph:
    """A captured graph's stand-in: replay re-runs ``fn`` over the captured inputs into the captured output."""

    def __init__(self, fn, ids, batch, out):
        self.fn, self.ids, self.batch, self.out = fn, ids, batch, out

    def replay(self) -> None:
        self.out.copy_(self.fn(self.ids, self.batch))


def _eager_copies(fn, ids, batch, copies, pool, stats, device):
    out = fn(ids, batch)
    return [(_EagerGraph(fn, ids, batch, out), out, batch)], stats.take(), pool


def rows_of(ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """What a prefill forward may read, per row, from the device tensors only: [T, 6] int64 (token id, position,
    KV slot, the row's request, its table row, its KV length)."""
    t = ids.shape[0]
    request = torch.searchsorted(batch.qo_indptr[1:].long(), torch.arange(t), right=True)
    return torch.stack([ids, batch.positions, batch.out_cache_loc, request, batch.req_pool_indices[request],
                        batch.seq_lens[request].long()], dim=1)


class _Hooks:
    def __init__(self):
        self.replays: list[ForwardBatch] = []

    def init_graph_state(self, batch):
        self.slots = batch.batch_size

    def init_forward_metadata_capture(self, batch):
        assert batch.max_extend_len == batch.num_tokens  # the grid covers every row in one request

    def init_forward_metadata_replay(self, batch):
        self.replays.append(batch)


def test_replays_read_the_step_then_the_padding_from_the_static_buffers(monkeypatch):
    monkeypatch.setattr(prefill_graphs, "capture_copies", _eager_copies)
    hooks = _Hooks()
    graphs = PrefillGraphs(GraphDecision("prefill", True, sizes=[16, 64]), rows_of, hooks, 4, PAD_ROW, CPU, 1,
                           CollectiveStats(CPU))
    graphs.init_state()
    graphs.capture(None)
    assert sorted(graphs.graphs) == [16, 64] and hooks.slots == 4
    # three requests (two with a cached prefix), 14 tokens: the graph of 16, two padding rows; then one of 40 (the
    # graph of 64), then a smaller step again (the larger one's values must not show through)
    steps = [([7, 2, 5], [20, 0, 3], [9, 1, 4]), ([1], [0], [40]), ([3, 4], [0, 6], [6, 4])]
    for rows, prefix, ext in steps:
        t = sum(ext)
        locs = torch.arange(100, 100 + t)
        batch = make_batch(ForwardMode.EXTEND, rows, prefix, ext, locs, CPU)
        ids = torch.arange(1000, 1000 + t)
        assert graphs.can_run(batch)
        eager = rows_of(ids, batch)
        graphs.prepare(ids, batch)
        out = graphs.replay()
        assert torch.equal(out, eager)  # the step's rows, nothing of the padding
        tokens = 16 if t <= 16 else 64
        full = graphs.graphs[tokens][0][1]
        pad = full[t:]
        n = len(rows)
        assert (pad[:, 0] == 0).all() and (pad[:, 1] == 0).all() and (pad[:, 2] == 0).all()  # id, position, slot 0
        assert (pad[:, 3] == n).all() and (pad[:, 4] == PAD_ROW).all() and (pad[:, 5] == tokens - t).all()
        host = hooks.replays[-1]
        assert host.req_pool_indices_cpu.tolist() == rows + [PAD_ROW] * (4 - n)
        assert host.extend_lens_cpu.tolist()[: n + 1] == ext + [tokens - t] and host.num_tokens == tokens
    assert graphs.replays == 3
    # too many requests (one slot pads), too many tokens, or another mode: eager
    four = make_batch(ForwardMode.EXTEND, [1, 2, 3, 4], [0] * 4, [1] * 4, list(range(4)), CPU)
    long = make_batch(ForwardMode.EXTEND, [1], [0], [65], list(range(65)), CPU)
    decode = make_batch(ForwardMode.DECODE, [1], [5], [1], [5], CPU)
    assert not any(graphs.can_run(b) for b in (four, long, decode))


def test_graphed_prefill_needs_a_padding_slot():
    with pytest.raises(ValueError, match="graph.prefill_requests=8"):
        PrefillGraphs(GraphDecision("prefill", True, sizes=[16]), rows_of, _Hooks(), 1, PAD_ROW, CPU)
    off = PrefillGraphs(GraphDecision("prefill", False, reason="graph.prefill_tokens=[]"), rows_of, _Hooks(), 1,
                        PAD_ROW, CPU)  # not graphed: the slots are never used
    assert not off.can_run(make_batch(ForwardMode.EXTEND, [1], [0], [4], list(range(4)), CPU))


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_models import CASES, make_case

    return make_case(CASES[0], tmp_path_factory.mktemp("prefill_graphs"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="triton_mla on the CPU runs in Triton's interpreter (machines without CUDA)")
@pytest.mark.usefixtures("one_thread")
def test_graphed_prefill_of_triton_mla_gives_transformers_first_tokens(tiny_v3, monkeypatch):
    """A transformers-saved V3 (q LoRA, YaRN, grouped MoE) served by triton_mla (its extend kernel in Triton's
    interpreter) with every prefill step that fits replayed from a stand-in graph: chunks of 16 tokens, steps of up
    to 48 tokens over 1-3 running requests with cached prefixes, padded to 16 or 64 rows (64 is past
    ``model.max_context``: the padding's positions and page-table reads must stay in bounds). The first tokens and
    the prompts' last logits must be transformers' (the padding, the empty requests and the capture-time host mirrors
    changing nothing)."""
    from conftest import compose_config
    from hf_models import prompt_overrides

    from containers import build

    ref = tiny_v3
    monkeypatch.setattr(prefill_graphs, "capture_copies", _eager_copies)
    cfg = compose_config("model=hf", f"model.path={ref.folder}", "model.dtype=float32", "backend=triton_mla",
                         "device=cpu", "check=off", "progress=false", *prompt_overrides(ref.folder, ref.prompts, 1),
                         "workload.chunked_prefill_size=16", "workload.max_tokens_per_batch=48",
                         "workload.max_running_requests=3", "model.max_context=48")
    rt = build(cfg)
    engine, c = rt.engine, rt.container
    graphs = PrefillGraphs(GraphDecision("prefill", True, sizes=[16, 64]), engine.model.forward, engine.backend, 4,
                           c.req_to_token_pool().padding_row, CPU, 1, CollectiveStats(CPU))
    c.graph_runner().modes["prefill"] = graphs  # the runner captures it when the run begins
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    res = engine.run()
    prefill = [s for s in res.steps if s.phase == "prefill"]
    assert all(s.graphed for s in prefill) and graphs.replays == len(prefill) >= 5
    assert [res.outputs[i] for i in range(len(ref.prompts))] == [t[:1] for t in ref.tokens]
    first = torch.stack([res.hidden[i][0] for i in range(len(ref.prompts))])
    logits = c.model().logits(first)
    rel = (torch.linalg.vector_norm(logits - ref.last_logits, dim=-1)
           / torch.linalg.vector_norm(ref.last_logits, dim=-1)).max().item()
    assert rel < 1e-4, rel


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="triton_mla on the CPU runs in Triton's interpreter (machines without CUDA)")
def test_triton_mla_graph_page_table_covers_every_graphed_length():
    """The static page table is as wide as the longest request the request table holds or the longest a graphed
    batch holds (a prefill graph's padding request of 4096 rows past a max_context of 1024), whichever is wider,
    and as tall as the most requests asked; asking again for less keeps it (captured graphs read it)."""
    from conftest import compose_config

    from containers import build

    rt = build(compose_config("backend=triton_mla", "device=cpu", "check=off", "model.max_context=1024",
                              "kv.page_size=64"))
    backend, pad = rt.engine.backend, rt.container.req_to_token_pool().padding_row
    backend.init_graph_state(make_batch(ForwardMode.DECODE, [pad] * 16, [0] * 16, [1] * 16, [0] * 16, CPU))
    assert tuple(backend._graph_page_table.shape) == (16, 1024 // 64)
    host = padded_layout(4096, 8, pad, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                         torch.zeros(0, dtype=torch.int32))
    prefill = ForwardBatch(ForwardMode.EXTEND, host[0], host[0], host[1], host[1], host[2], host[3], host[3],
                           torch.zeros(4096, dtype=torch.int64), torch.zeros(4096, dtype=torch.int64))
    backend.init_graph_state(prefill)
    table = backend._graph_page_table
    assert tuple(table.shape) == (16, 4096 // 64)
    backend.init_graph_state(make_batch(ForwardMode.DECODE, [pad] * 4, [0] * 4, [1] * 4, [0] * 4, CPU))
    assert backend._graph_page_table is table
