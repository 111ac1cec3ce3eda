"""DeepSeek-V4 served end to end: tiny random V4 models built and saved by transformers (the oracle), loaded through
``model=hf model.path=DIR`` with ``backend=dsv4``, batched prompts of different lengths through the engine (chunked
prefill, decode, retraction on a tiny pool); greedy tokens must equal transformers' ``generate(do_sample=False)``.

The models (tests/dsv4_harness.py): CSA every 2 tokens, HCA every 4, window 5, top-3 compressed entries, so the
prompts (1..19 tokens) and 8 generated tokens cross many windows; hash and routed MoE layers; YaRN on the compress
rope. Float64 on both sides: a greedy flip would be a bug, not rounding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from dsv4_harness import saved_reference
from hf_models import prompt_overrides

from backends.kernels.dsv4.dsv4_decode import CPU_SM_COUNT, decode_workspace_bytes
from containers import build
from runtime.core.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread", "no_indexer_ties")

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LENS = (1, 4, 7, 12, 19)
NEW = 8
MIN_GAP = 1e-6


def _reference(folder: Path, seed: int, **over):
    """Save a tiny random V4 model to ``folder``; transformers' greedy continuation of each prompt (alone)."""
    return saved_reference(folder, seed, PROMPT_LENS, NEW, MIN_GAP, **over)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("v4_tiny"), seed=0)


def _serve(ref, *overrides: str, dtype: str = "float64"):
    folder, prompts, _ = ref
    cfg = compose_config("model=hf", f"model.path={folder}", "backend=dsv4", f"model.dtype={dtype}",
                         f"backend.compute_dtype={dtype}", "device=cpu", "check=off", "progress=false",
                         *prompt_overrides(folder, prompts, NEW), *overrides)
    rt = build(cfg)
    return rt, rt.engine.run()


def test_batched_prompts_match_generate(v4):
    """All five prompts in one batch; prefill chunks of 5 tokens (a prompt's prefill spans steps and windows)."""
    rt, res = _serve(v4, "workload.chunked_prefill_size=5")
    assert [res.outputs[i] for i in range(len(PROMPT_LENS))] == v4[2]
    assert res.lost == 0 and res.retracted == 0
    assert "backend:dsv4" in rt.build_order and "dsv4_pools" in rt.build_order
    order = rt.build_order
    assert order.index("dsv4_pools") < order.index("backend:dsv4") < order.index("model")
    assert rt.container.kv_pool() is None  # no MLA latent cache is allocated for V4


def test_tiny_pool_retracts_and_loses_nothing(v4):
    """9 usable pages of 4 tokens (36 tokens) for 5 requests of up to 27: the engine queues and retracts;
    re-admitted requests recompute their windows, entries and compressor state and produce the same tokens."""
    rt, res = _serve(v4, "kv.page_size=4", "kv.num_pages=10")
    assert res.retracted > 0, "the pool was meant to force retraction"
    assert res.lost == 0
    assert [res.outputs[i] for i in range(len(PROMPT_LENS))] == v4[2]
    pools = rt.container.dsv4_pools()
    assert pools.csa.pages.available == pools.csa.pages.capacity  # every entry page came back
    assert pools.hca.pages.available == pools.hca.pages.capacity


def test_triton_kernels_in_the_engine(v4):
    """backend.impl=triton (the CPU interpreter here), float32: decode and extend (chunks of 5, and re-prefills
    after retraction) through the Triton kernels; the indexer batched in torch (index_head_dim 8 is below the DSA
    kernel's tile; tests/test_dsv4_model.py runs that kernel in the model); same tokens."""
    rt, res = _serve(v4, "backend.impl=triton", "kv.page_size=4", "kv.num_pages=10",
                     "workload.chunked_prefill_size=5", dtype="float32")
    backend = rt.container.backend()
    assert backend.impl == "triton" and backend.extend_kernel and res.retracted > 0
    # the decode's split partials come from the ledger, sized by the automatic choice's bound (CPU: a fixed SM count)
    spec = backend.spec
    assert rt.container.workspace_ledger().report()["dsv4_decode_splits"] == backend.decode_workspace.numel() \
        == decode_workspace_bytes(spec.num_heads, spec.head_dim, CPU_SM_COUNT) > 0
    assert [res.outputs[i] for i in range(len(PROMPT_LENS))] == v4[2]


def test_second_model_hca_first_and_sliding_layers(tmp_path):
    """Another schedule (sliding first, two HCA) with routed-only MoE and a default (non-YaRN) compress rope."""
    ref = _reference(tmp_path, seed=3, layer_types=["sliding_attention", "heavily_compressed_attention",
                                                    "compressed_sparse_attention", "heavily_compressed_attention"],
                     mlp_layer_types=["moe"] * 4, rope_parameters=None, num_attention_heads=2, o_groups=1)
    _, res = _serve(ref, "workload.max_running_requests=3")
    assert [res.outputs[i] for i in range(len(PROMPT_LENS))] == ref[2]


def test_cli_report_outputs_memory_and_parity(v4, tmp_path):
    folder, prompts, tokens = v4
    args = [sys.executable, "-m", "runtime", "model=hf", f"model.path={folder}", "backend=dsv4", "model.dtype=float32",
            "device=cpu", "progress=false", f"hydra.run.dir={tmp_path}", *prompt_overrides(folder, prompts, NEW)]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [o["output_ids"] for o in report["outputs"]] == tokens  # float32 here: margins are far above 1e-4
    mem = report["memory"]
    assert mem["kv_pool_bytes"] == 0 and mem["dsv4_window_ring"] > 0 and mem["dsv4_csa_entries"] > 0
    assert mem["dsv4_hca_entries"] > 0 and mem["dsv4_compressor_state"] > 0
    assert report["parity"]["ok"] and report["parity"]["reference"] == "dsv4/float32"
    explain = subprocess.run(args + ["+explain=true"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert explain.returncode == 0 and "dsv4_window_ring" in explain.stdout and "dsv4_hca_entries" in explain.stdout


def test_checkpoint_problems_name_file_expected_and_found(v4, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((v4[0] / "config.json").read_text())
    state = load_file(v4[0] / "model.safetensors")  # transformers writes DeepSeek's release names
    del state["model.layers.1.attn.indexer.wq_b.weight"]
    state["model.layers.0.attn.compressor.ape"] = torch.zeros(3, 16, dtype=torch.float64)
    state["model.layers.0.ffn.gate.tid2eid"] = state["model.layers.0.ffn.gate.tid2eid"].double()
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ConfigError) as e:
        build(compose_config("model=hf", f"model.path={folder}", "backend=dsv4", "device=cpu"))
    msg = str(e.value)
    assert "3 problems" in msg
    assert "tensor model.layers.1.self_attn.compressor.indexer.q_b_proj.weight: got missing" in msg
    assert ("tensor model.layers.0.attn.compressor.ape (transformers: model.layers.0.self_attn.compressor."
            "position_bias) in model.safetensors: got shape [3, 16]; expected shape [4, 16]") in msg
    assert "tid2eid) in model.safetensors: got dtype F64" in msg


def test_expected_tensors_are_transformers_state_dict():
    """The one table behind scan, load and random weights has transformers' names and shapes, exactly."""
    from dsv4_harness import tiny_pair

    from runtime.model.dsv4.checkpoint import expected_tensors, hf_name

    ref, cfg, _ = tiny_pair(seed=1)
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert expected_tensors(cfg) == want
    assert hf_name("layers.2.ffn.experts.4.w3.weight") == "model.layers.2.mlp.experts.4.up_proj.weight"
    assert hf_name("hc_head_fn") == "model.hc_head.hc_fn" and hf_name("head.weight") == "lm_head.weight"
    assert all(hf_name(k) == k for k in want)
