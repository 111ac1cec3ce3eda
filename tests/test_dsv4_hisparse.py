"""HiSparse with DeepSeek-V4: the CSA layers' compressed entries live in the coordinator's host pool, each request
keeps a device buffer of 4 entries per CSA layer (fewer than the up to 13 entries a request holds, more than the
indexer's top-3), and the greedy tokens must equal transformers' ``generate`` and the run without HiSparse.

The tiny models and the reference come from tests/test_dsv4_serving.py (float64 both sides)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import compose_config
from hf_models import prompt_overrides
from test_dsv4_serving import NEW, PROMPT_LENS, ROOT, _reference, _serve

from containers import build
from runtime.core.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread", "no_indexer_ties")

pytest.importorskip("transformers")

TOP_K, BUFFER = 3, 4
HISPARSE = ("hisparse.enabled=true", f"hisparse.top_k={TOP_K}", f"hisparse.device_buffer_size={BUFFER}",
            "hisparse.host_to_device_ratio=1.0")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("v4_hisparse"), seed=0)


def _outputs(res):
    return [res.outputs[i] for i in range(len(PROMPT_LENS))]


def test_offloaded_csa_entries_give_the_same_tokens(v4):
    rt, res = _serve(v4, *HISPARSE, "workload.chunked_prefill_size=5")
    c = rt.container.hisparse_coordinator()
    assert _outputs(res) == v4[2]
    _, plain = _serve(v4, "workload.chunked_prefill_size=5")
    assert _outputs(res) == _outputs(plain)
    st = c.stats()
    most = max(PROMPT_LENS) + NEW - 1
    assert BUFFER < most // 2  # the working set is smaller than the CSA entries the longest request holds
    assert st["swap_ins"] > 0 and st["hits"] > 0 and st["decode_steps"] > 0
    assert st["host_bytes_written"] == sum((n + NEW - 1) // 2 for n in PROMPT_LENS) * 2 * st["row_bytes"]
    # the coordinator (built before the backend) wraps the V4 allocator and is what the backend reads
    order = rt.build_order
    assert order.index("dsv4_token_slots") < order.index("hisparse_coordinator") < order.index("backend:dsv4")
    assert rt.container.backend().hisparse is c and rt.container.engine_token_slots() is c
    assert c.layer_ids == [1, 3] and c.per_row == 2  # the CSA layers; one entry per 2 tokens
    pools = rt.container.dsv4_pools()
    assert set(pools.csa.buffers) == {"index"} and set(pools.hca.buffers) == {"kv"}  # CSA entries not on the device


def test_retraction_with_offload_loses_nothing(v4):
    rt, res = _serve(v4, *HISPARSE, "kv.page_size=4", "kv.num_pages=10")
    assert res.retracted > 0 and res.lost == 0
    assert _outputs(res) == v4[2]
    c = rt.container.hisparse_coordinator()
    free = c.free_counts()
    assert free["host_pages"] == c.host_allocator.capacity and free["device_pages"] == c.kv_allocator.pages.capacity
    assert free["buffer_slots_held"] == 0
    pools = rt.container.dsv4_pools()
    assert pools.csa.pages.available == pools.csa.pages.capacity


def test_triton_decode_reads_the_device_buffer(v4):
    """impl=triton (CPU interpreter, float32): the decode kernel's compressed rows are the coordinator's buffer;
    extend runs the Triton kernel on the HCA and sliding layers and the torch path on the CSA layers (host reads)."""
    rt, res = _serve(v4, *HISPARSE, "backend.impl=triton", dtype="float32")
    assert _outputs(res) == v4[2] and rt.container.hisparse_coordinator().stats()["swap_ins"] > 0


def test_report_and_memory_plan_show_host_pool_and_buffers(v4, tmp_path):
    folder, prompts, tokens = v4
    args = [sys.executable, "-m", "runtime", "model=hf", f"model.path={folder}", "backend=dsv4", "model.dtype=float32",
            "device=cpu", "progress=false", f"hydra.run.dir={tmp_path}", *prompt_overrides(folder, prompts, NEW),
            *HISPARSE]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [o["output_ids"] for o in report["outputs"]] == tokens
    hs, mem = report["hisparse"], report["memory"]
    assert hs["host_kv_bytes"] > 0 and hs["device_buffer_bytes"] > 0 and hs["swap_ins"] > 0
    # 2 CSA layers x 65 request rows x 4 entries x 16 channels x 4 bytes
    assert hs["device_buffer_bytes"] == 2 * 65 * BUFFER * 16 * 4
    assert mem["hisparse_device_bytes"] > hs["device_buffer_bytes"] and mem["dsv4_csa_entries"] > 0
    assert report["parity"]["ok"]
    explain = subprocess.run(args + ["+explain=true"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert explain.returncode == 0
    assert "hisparse_device" in explain.stdout and "host (pinned): hisparse KV" in explain.stdout


def test_v4_hisparse_refusals_are_listed_together(tmp_path):
    from dsv4_harness import tiny_hf_config

    tiny_hf_config().save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        build(compose_config("model=hf", f"model.path={tmp_path}", "backend=dsv4", "device=cpu",
                             "hisparse.enabled=true", "hisparse.top_k=8", "hisparse.device_buffer_size=4",
                             "hisparse.host_to_device_ratio=0.5"))
    msg = str(e.value)
    assert "hisparse.top_k: got 8 (model.v4.index_topk is 3)" in msg and "set hisparse.top_k=3" in msg
    assert "hisparse.device_buffer_size: got 4 (< top_k 8)" in msg and "hisparse.host_to_device_ratio" in msg
    with pytest.raises(ConfigError) as e:
        build(compose_config("model=hf", f"model.path={tmp_path}", "backend=dsv4", "device=cpu",
                             "hisparse.enabled=true", "hisparse.top_k=3", "hisparse.device_buffer_size=4",
                             "model.num_layers=1"))  # layer 0 is HCA: nothing the indexer selects
    assert "at least one compressed_sparse_attention layer" in str(e.value)
