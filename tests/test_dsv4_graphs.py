"""DeepSeek-V4 decode under CUDA graphs, on the CPU: the engine's real graph modes (static input buffers padded
to a captured size, the backend's graph hooks refreshing fixed-width lists in place) with capture replaced by an
eager stand-in that, on every replay, runs the captured function again over the inputs it captured. Those inputs'
host mirrors hold the capture-time padding, so a decode step that read anything but the static device buffers
(a host list, ``batch.max_seq_len``) would attend to the wrong rows and change the tokens. The tokens must equal
transformers' ``generate(do_sample=False)``. Real capture runs on a GPU (tests/test_dsv4_gpu.py).

Also: validation of graphed V4 decode (impl, HiSparse, dtype), and the fixed-width lists against the per-step
ones."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from dsv4_harness import saved_reference
from hf_models import prompt_overrides

import containers
from containers import build
from runtime.app.validation import validate
from runtime.core.batch import ForwardMode, make_batch
from runtime.core.device import DeviceInfo
from runtime.core.parallel import CollectiveStats
from runtime.engine.graph_runner import GraphDecision, ModeGraphs, plain_mode_graphs

pytestmark = pytest.mark.usefixtures("one_thread", "no_indexer_ties")

PROMPT_LENS = (1, 4, 7, 12, 19)
NEW = 8
SIZES = [1, 2, 8]  # 3..5 live requests replay the graph of 8 (padding rows), fewer the graph of 1 or 2
GPU = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "H100")


class _EagerGraph:
    """Stands in for a captured graph on the CPU: replay re-runs ``fn`` over the captured (static) inputs and
    writes the captured output tensor in place, as a graph replay does."""

    def __init__(self, fn, ids, batch, out):
        self.fn, self.ids, self.batch, self.out = fn, ids, batch, out

    def replay(self) -> None:
        self.out.copy_(self.fn(self.ids, self.batch))


def _eager_capture(self: ModeGraphs, pool):
    """ModeGraphs.capture without CUDA: per size (largest first) the hooks' capture call, one run over the static
    padding batch, and an :class:`_EagerGraph` over exactly those inputs."""
    for bs in sorted(self.decision.sizes, reverse=True):
        batch = self._static_batch(bs, self._padding_host(bs))
        ids = self._bufs["ids"][: bs * self.t]
        self.hooks.init_forward_metadata_capture(batch)
        out = self.fn(ids, batch)
        self.graphs[bs] = [(_EagerGraph(self.fn, ids, batch, out), out, batch)]
        self.collectives[bs] = self.stats.take()
    return pool


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return saved_reference(tmp_path_factory.mktemp("v4_graphs"), 0, PROMPT_LENS, NEW, 1e-6)


def test_graphed_decode_gives_transformers_tokens(v4, monkeypatch):
    folder, prompts, want = v4
    cfg = compose_config("model=hf", f"model.path={folder}", "backend=dsv4", "model.dtype=float32",
                         "backend.compute_dtype=float32", "backend.impl=triton", "device=cpu", "check=off",
                         "progress=false", "workload.chunked_prefill_size=5", *prompt_overrides(folder, prompts, NEW))
    rt = build(cfg)
    c, engine = rt.container, rt.engine
    monkeypatch.setattr(ModeGraphs, "capture", _eager_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    (mode,) = plain_mode_graphs({"decode": GraphDecision("decode", True, sizes=SIZES)}, engine.model,
                                engine.backend, c.req_to_token_pool().padding_row, torch.device("cpu"), 1,
                                CollectiveStats(torch.device("cpu")))
    c.graph_runner().modes["decode"] = mode
    res = engine.run()
    decode = [s for s in res.steps if s.phase == "decode"]
    assert decode and all(s.graphed for s in decode) and mode.replays == len(decode)
    assert [res.outputs[i] for i in range(len(prompts))] == want


def test_fixed_width_lists_equal_the_per_step_lists_where_they_count(v4):
    """The graph hooks' lists (the whole HCA table width, -1 past each request's count) hold the per-step
    lists' entries in front, and the counts bound both."""
    folder, prompts, _ = v4
    rt = build(compose_config("model=hf", f"model.path={folder}", "backend=dsv4", "model.dtype=float32",
                              "backend.compute_dtype=float32", "backend.impl=triton", "device=cpu", "check=off",
                              "progress=false", *prompt_overrides(folder, prompts, NEW)))
    backend = rt.engine.backend
    pools = backend.pools
    rows, prefix = [0, 2, 3], [0, 9, 21]
    for r, p in zip(rows, prefix):
        pools.hca.open(r)
        pools.hca.reserve(r, p + 1)
    batch = make_batch(ForwardMode.DECODE, rows, prefix, [1, 1, 1], [0, 0, 0], torch.device("cpu"))
    backend.init_forward_metadata(batch)
    win, hca, counts = backend._win_idx.clone(), backend._hca_idx.clone(), backend._hca_len.clone()
    backend.init_graph_state(make_batch(ForwardMode.DECODE, [0] * 8, [0] * 8, [1] * 8, [0] * 8, torch.device("cpu")))
    backend.init_forward_metadata_replay(batch)
    assert torch.equal(backend._win_idx, win) and torch.equal(backend._hca_len, counts)
    width = hca.shape[1]
    assert backend._hca_idx.shape[1] == pools.hca.table.shape[1] >= width
    assert torch.equal(backend._hca_idx[:, :width], hca) and (backend._hca_idx[:, width:] == -1).all()
    assert (hca[2, : counts[2]] > 0).all()  # real pages (page 0 is the padding page)
    assert counts.tolist() == [(p + 1) // pools.hca.rate for p in prefix]


def _problems(*overrides):
    plain = containers.to_plain(compose_config("model=deepseek_v4_flash", "backend=dsv4", "device=cuda",
                                               "graph=decode", *overrides))
    return "\n".join(map(str, validate(plain, containers.BACKENDS, GPU, package_present=lambda name: True)))


def test_graphed_v4_decode_validation():
    assert _problems("model.dtype=bfloat16") == ""
    assert _problems("model.dtype=bfloat16", "backend.impl=triton") == ""
    text = _problems("model.dtype=float32", "backend.impl=torch", "backend.compute_dtype=float32")
    assert "backend.impl in ['triton']" in text and "impl=torch" in text  # host loops
    assert "model.dtype=float32" in text and "grouped_mm" in text  # MoE loops over experts with a host sync
    text = _problems("model.dtype=bfloat16", "model.moe_intermediate_size=100")
    assert "MoE dims {'moe_intermediate_size': 100}" in text and "multiples of 8" in text
    text = _problems("model.dtype=bfloat16", "hisparse.enabled=true", "hisparse.top_k=512",
                     "hisparse.device_buffer_size=1024", "hisparse.host_to_device_ratio=1.0")
    assert "hisparse.enabled=true with DeepSeek-V4" in text and "use graph=off, or hisparse=off" in text
