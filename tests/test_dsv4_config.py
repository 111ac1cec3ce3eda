"""DeepSeek-V4 configuration: the ``deepseek_v4_flash`` preset against transformers' ``DeepseekV4Config`` defaults
(the V4-Flash shapes), the preset's random weights through the engine, and validation refusing what V4 cannot run,
every reason at once, before anything is allocated."""

from __future__ import annotations

import pytest
from conftest import compose_config

from containers import build, to_plain
from runtime.core.errors import ConfigError
from runtime.model.deepseek.hf_config import resolve_model_config
from runtime.model.dsv4.config import DSV4Config
from runtime.model.dsv4.hf_config import dsv4_config

transformers = pytest.importorskip("transformers")

FLASH_COMPRESS_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                       "beta_fast": 32.0, "beta_slow": 1.0}
TINY = ("model.num_layers=3", "model.hidden_size=48", "model.num_heads=4", "model.q_lora_rank=24",
        "model.vocab_size=128", "model.n_routed_experts=4", "model.num_experts_per_tok=2",
        "model.moe_intermediate_size=24", "model.v4.head_dim=32", "model.v4.rope_head_dim=8",
        "model.v4.sliding_window=6", "model.v4.csa_rate=2", "model.v4.hca_rate=4", "model.v4.index_n_heads=2",
        "model.v4.index_head_dim=16", "model.v4.index_topk=3", "model.v4.o_groups=2", "model.v4.o_lora_rank=8",
        "model.v4.hc_mult=2", "model.v4.hc_sinkhorn_iters=4", "model.v4.layer_types=[compressed_sparse_attention,"
        "heavily_compressed_attention,sliding_attention]", "model.max_context=256")


@pytest.mark.parametrize("layers", [4, 7])
def test_flash_preset_is_transformers_default_config(layers):
    cfg = to_plain(compose_config("model=deepseek_v4_flash", "backend=dsv4", f"model.num_layers={layers}"))
    ours = dsv4_config(resolve_model_config(cfg["model"])[0])
    hf = transformers.DeepseekV4Config(num_hidden_layers=layers, rope_parameters=dict(FLASH_COMPRESS_YARN))
    assert ours == DSV4Config.from_hf_config(hf.to_dict())
    assert ours.attention.head_dim == 512 and ours.attention.index_topk == 512 and ours.hc_mult == 4


def test_flash_preset_random_weights_serve_on_the_cpu():
    """The preset's code path (seeded random weights, V4 pools, dsv4 backend, engine, parity) at tiny overrides."""
    cfg = compose_config("model=deepseek_v4_flash", "backend=dsv4", "device=cpu", "model.dtype=float32",
                         "progress=false", "workload.num_requests=3", "workload.prompt_len.max=20",
                         "workload.output_len.max=6", *TINY)
    rt = build(cfg)
    res = rt.engine.run()
    assert res.lost == 0 and res.finished == 3
    assert "weights:random" in rt.build_order
    assert len({tuple(v) for v in res.outputs.values()}) > 1 or len(res.outputs) == 1


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        build(compose_config(*overrides))
    return str(e.value)


def test_v4_model_refuses_unsupported_features_all_at_once():
    msg = _refused("model=deepseek_v4_flash", "backend=torch_mla", "device=cpu", "speculative=eagle_chain",
                   "hisparse=dsa_tiny", "kv.dtype=fp8_e4m3", "model.v4.o_groups=5", "model.mlp=none")
    assert "backend 'torch_mla' with model 'deepseek_v4_flash': got a DeepSeek-V4 model" in msg
    assert "capabilities.model_families has 'dsv4': ['dsv4']" in msg and "use backend=dsv4" in msg
    assert "hisparse.enabled=true" in msg and "model.v4.o_groups" in msg and "model.mlp" in msg
    assert "kv.dtype=fp8_e4m3" in msg


def test_dsv4_backend_refuses_speculative_and_fp8_with_a_v4_model():
    msg = _refused("model=deepseek_v4_flash", "backend=dsv4", "device=cpu", "speculative=eagle_chain",
                   "kv.dtype=fp8_e4m3", "attention.prefill=mha_chunked")
    assert "backend 'dsv4' with speculative decoding" in msg and "draft_extend" in msg
    assert "kv.dtype=fp8_e4m3 with backend 'dsv4'" in msg
    assert "backend 'dsv4' hook MHAChunkPrefill" in msg


def test_dsv4_backend_refuses_an_mla_model():
    msg = _refused("model=tiny_mla", "backend=dsv4", "device=cpu")
    assert "backend 'dsv4' with model 'tiny_mla': got an MLA model" in msg
    assert "use backend=dsa" in msg or "use backend=" in msg


def test_v4_checkpoint_fields_cannot_be_overridden(tmp_path):
    from dsv4_harness import tiny_hf_config

    tiny_hf_config().save_pretrained(tmp_path)
    msg = _refused("model=hf", f"model.path={tmp_path}", "backend=dsv4", "device=cpu", "model.v4.sliding_window=9")
    assert "model.v4.sliding_window: got 9; expected 5 (from" in msg


def test_triton_impl_refuses_float64_and_unknown_impls():
    msg = _refused("model=deepseek_v4_flash", "backend=dsv4", "device=cpu", "backend.impl=triton",
                   "model.dtype=float64", "backend.compute_dtype=float64")
    assert "compute_dtype=float64" in msg and "model.dtype=float64" in msg
    assert "backend.impl: got 'fast'" in _refused("model=deepseek_v4_flash", "backend=dsv4", "device=cpu",
                                                  "backend.impl=fast")
