"""``backend=dsv4 backend.impl=flashinfer``: the backend's argument preparation for FlashInfer's
``trtllm_batch_decode_sparse_mla_dsv4`` runs through the emulation of the kernel's contract
(``backend.kernel=emulate``, :mod:`backends.kernels.dsv4.emulated_dsv4`) and must give the torch impl's tokens; the
gate refuses real kernels off Blackwell naming the GPU, the requirement and the impls that run there.

The kernel's shapes are fixed (head dim 512, 8..128 heads, a 128-token SWA tile, bf16), so the tiny model here has
512-wide heads, 8 of them, a 128-token window and prompts longer than it. Nothing here imports FlashInfer."""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import compose_config
from dsv4_harness import randomize_, tiny_hf_config
from hf_models import prompt_overrides

from backends.dsv4 import DSV4Backend
from backends.kernels.dsv4.emulated_dsv4 import EmulatedDSV4SparseDecode
from containers import build
from runtime.core.device import DeviceInfo
from runtime.core.errors import ConfigError

pytest.importorskip("transformers")
from transformers import DeepseekV4ForCausalLM  # noqa: E402

PROMPT_LENS = (140, 3, 131)
NEW = 6
#: The torch impl's top-1 / top-2 logit margin must exceed this at every generated position (a few bf16 steps at
#: these logits' size): the two impls round differently in bf16, so a closer call may go either way (with prompt
#: seed 7, one margin was 0.008 and the impls picked different tokens on an AVX2-only CPU; 88's smallest is 0.11).
MIN_MARGIN = 0.05


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    folder = tmp_path_factory.mktemp("v4_wide")
    torch.manual_seed(5)
    model = DeepseekV4ForCausalLM(tiny_hf_config(head_dim=512, num_attention_heads=8, sliding_window=128,
                                                 partial_rotary_factor=1 / 32, index_head_dim=32,
                                                 max_position_embeddings=256, o_groups=2)).eval()
    randomize_(model, 5)
    model.save_pretrained(folder)
    gen = torch.Generator().manual_seed(88)
    return folder, [torch.randint(0, 97, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _serve(wide, *overrides: str):
    rt, res = _run(wide, *overrides)
    return rt, [res.outputs[i] for i in range(len(PROMPT_LENS))]


def _run(wide, *overrides: str):
    folder, prompts = wide
    cfg = compose_config("model=hf", f"model.path={folder}", "backend=dsv4", "model.dtype=bfloat16", "device=cpu",
                         "check=off", "progress=false", *prompt_overrides(folder, prompts, NEW), *overrides)
    rt = build(cfg)
    return rt, rt.engine.run()


@pytest.fixture(scope="module")
def torch_tokens(wide) -> list[list[int]]:
    """The torch impl's tokens (served once for the module), refused where a margin is a near-tie (then the prompts
    need another seed)."""
    _, res = _run(wide, "backend.impl=torch")
    margin = min(min(res.margins[i]) for i in range(len(PROMPT_LENS)))
    assert margin > MIN_MARGIN, f"torch impl near-tie (top-1 / top-2 logit margin {margin:.3g}): reseed the prompts"
    return [res.outputs[i] for i in range(len(PROMPT_LENS))]


FI = ("backend.impl=flashinfer", "backend.kernel=emulate", "backend.workspace_bytes=4096")


def test_emulated_flashinfer_decode_gives_the_torch_tokens(wide, torch_tokens):
    rt, tokens = _serve(wide, *FI)
    fi = rt.container.dsv4_flashinfer()
    assert rt.container.backend().flashinfer is fi and isinstance(fi.kernel, EmulatedDSV4SparseDecode)
    assert fi.kernel.calls == 4 * (NEW - 1) > 0  # every layer of every decode step (one batch of 3)
    assert "flashinfer" not in sys.modules  # the real kernel is imported only by load_kernel
    assert rt.container.workspace_ledger().report()["dsv4_flashinfer_workspace"] == 4096
    assert tokens == torch_tokens


def test_emulated_flashinfer_decode_over_the_hisparse_buffer(wide, torch_tokens):
    rt, tokens = _serve(wide, *FI, "hisparse.enabled=true", "hisparse.top_k=3", "hisparse.device_buffer_size=8",
                        "hisparse.host_to_device_ratio=1.0")
    assert rt.container.hisparse_coordinator().stats()["swap_ins"] > 0
    assert tokens == torch_tokens


def test_contract_violations_are_named():
    k = EmulatedDSV4SparseDecode()
    q = torch.zeros(2, 1, 8, 512, dtype=torch.bfloat16)
    cache = torch.zeros(3, 128, 512, dtype=torch.bfloat16)
    args = dict(query=q, swa_kv_cache=cache, workspace_buffer=torch.zeros(16, dtype=torch.uint8),
                sparse_indices=torch.zeros(2, 132, dtype=torch.int32), compressed_kv_cache=cache,
                sparse_topk_lens=torch.full((2,), 130, dtype=torch.int32), seq_lens=torch.tensor([5, 9], dtype=torch.int32),
                sinks=torch.zeros(8))
    assert k(**args).shape == (2, 1, 8, 512)
    bad = {"sparse_indices": torch.zeros(2, 130, dtype=torch.int32), "sparse_topk_lens": torch.full((2,), 127, dtype=torch.int32),
           "query": q.float(), "seq_lens": torch.tensor([0, 9], dtype=torch.int32),
           "compressed_kv_cache": torch.zeros(3, 128, 256, dtype=torch.bfloat16),
           "sinks": torch.zeros(8, dtype=torch.bfloat16)}
    for key, value in bad.items():
        with pytest.raises(ValueError, match="emulated"):
            k(**{**args, key: value})
    idx = torch.zeros(2, 132, dtype=torch.int32)
    idx[1, 129] = 3 * 128  # one past the compressed cache
    with pytest.raises(ValueError, match="compressed columns"):
        k(**{**args, "sparse_indices": idx})


def _device(kind: str, cc, name: str) -> DeviceInfo:
    return DeviceInfo(kind, kind, 0, kind == "cuda", cc, name, 132 if cc else 0)


@pytest.mark.parametrize("kind,cc,name", [("cuda", (9, 0), "NVIDIA H100 80GB HBM3"), ("cpu", None, "cpu")])
def test_real_kernel_gate_names_gpu_requirement_and_impls_that_run(kind, cc, name):
    backend = {"name": "dsv4", "impl": "flashinfer", "kernel": "real", "compute_dtype": "float32",
               "workspace_bytes": 1}
    model = {"dtype": "bfloat16", "num_heads": 64, "v4": {"head_dim": 512, "sliding_window": 128}}
    (p,) = DSV4Backend.config_problems(backend, model, _device(kind, cc, name))
    text = str(p)
    assert "compute capability 10.0 / 10.3 / 12.0 / 12.1" in text
    assert (f"GPU {name} (compute capability 9.0)" in text) if cc else ("device cpu" in text)
    assert ("backend.impl=torch or triton" in text) if cc else ("backend.impl=torch" in text)
    assert "backend.kernel=emulate" in text
    for bw in ((10, 0), (10, 3), (12, 0), (12, 1)):  # Blackwell: the gate opens
        assert DSV4Backend.config_problems(backend, model, _device("cuda", bw, "B")) == []


def test_kernel_shape_refusals_are_listed_together(wide):
    folder, _ = wide
    with pytest.raises(ConfigError) as e:
        build(compose_config("model=hf", f"model.path={folder}", "backend=dsv4", "model.dtype=float32",
                             "device=cpu", *FI[:2], "backend.workspace_bytes=0"))
    msg = str(e.value)
    assert "model.dtype=float32" in msg and "backend.workspace_bytes" in msg
    tiny = folder.parent / "tiny_cfg"
    tiny_hf_config().save_pretrained(tiny)
    with pytest.raises(ConfigError) as e:
        build(compose_config("model=hf", f"model.path={tiny}", "backend=dsv4", "model.dtype=bfloat16", "device=cpu",
                             *FI))
    msg = str(e.value)
    assert "model.v4.head_dim=16" in msg and "model.num_heads=4" in msg and "model.v4.sliding_window=5" in msg
