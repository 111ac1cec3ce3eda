"""DeepSeek-V4 held as stored on a GPU (marked gpu; skipped without a CUDA GPU with fp8 tensor cores): a tiny
preset-shaped model with ``model.weights=fp8`` (block-fp8 matrices, packed fp4 routed experts) in bf16.

* Every block-fp8 matrix of the model through the fused decoder ops (``model.fused=auto`` on CUDA: the block-fp8
  Triton kernels; W8A16 and W8A8) against the torch ops (the weight dequantized to bf16, then the matmul), at the
  row counts a step gives them (1, 2, 3, 17, 40), and the grouped output projection (o_a per output group): relative
  error below :data:`PRODUCT_TOL`. The ops are the only difference between the two paths (the model's call sites
  are the same, checked on the CPU by tests/test_dsv4_stored.py with a recording ops object), so this checks the
  fused path product by product. An end-to-end comparison of the final hidden states (torch run teacher-forced on
  the fused run's tokens) was tried first: on an H200 one request differed by 1.8e-1 (W8A16) on this tiny random
  model, whose top-4 CSA selection and 2-stream mHC amplify bf16 rounding differences into other selections (the
  same comparison in Triton's interpreter in float16 gave 2.9e-3): no bound on it would be both safe and tight.
* CUDA graphs (``graph=decode``, accepted for fp4 experts): decode replayed from graphs gives the eager tokens;
  the graphs capture every running-batch size, so replays are never padded and run the same kernels on the same
  rows as the eager steps.

Dims are multiples of 128 where the fp8 kernels read 128 x 128 scale blocks (hidden 256, q LoRA 128, 4 heads of 128,
o_lora_rank 128: each output group's o_a rows are one whole block row, so the grouped output runs one fp8 product
per group; shared expert 128 wide) and of 32 where the fp4 experts keep their scale groups. Both passed on an H200
(2026-11-27, with the fused RoPE, routing, SwiGLU and split compressor ops).
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import compose_config

from containers import build
from runtime.model.deepseek.ops import FusedOps, TorchOps
from runtime.model.quantized import BlockFP8, PackedFP4


def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA GPU with fp8 (SM89+)")]

SHAPES = ("model=deepseek_v4_flash", "backend=dsv4", "device=cuda", "model.dtype=bfloat16", "model.weights=fp8",
          "model.num_layers=3", "model.hidden_size=256", "model.num_heads=4", "model.q_lora_rank=128",
          "model.vocab_size=256", "model.n_routed_experts=4", "model.num_experts_per_tok=2",
          "model.moe_intermediate_size=128", "model.v4.head_dim=128", "model.v4.rope_head_dim=64",
          "model.v4.sliding_window=8", "model.v4.csa_rate=2", "model.v4.hca_rate=4", "model.v4.index_n_heads=2",
          "model.v4.index_head_dim=64", "model.v4.index_topk=4", "model.v4.o_groups=2", "model.v4.o_lora_rank=128",
          "model.v4.hc_mult=2", "model.v4.hc_sinkhorn_iters=4",
          "model.v4.layer_types=[compressed_sparse_attention,heavily_compressed_attention,sliding_attention]",
          "model.max_context=256")
# 3 requests of 17..40 prompt tokens (prefill chunks above 16 rows: the tiled / W8A8 fp8 GEMMs; decode at 3 rows:
# the few-row kernels), 8 new tokens each
WORK = ("workload.num_requests=3", "workload.max_running_requests=3", "workload.prompt_len.min=17",
        "workload.prompt_len.max=40", "workload.output_len.min=8", "workload.output_len.max=8",
        "workload.eos_token_ids=[]", "check=off", "progress=false")
#: relative error of a fused product against the torch ops' (bf16 output rounding, the dequantized weight's bf16
#: rounding on the torch side: ~2^-8 each; W8A8 also rounds the activations to e4m3 above the few-row path)
PRODUCT_TOL = {"w8a16": 1e-2, "w8a8": 8e-2}
ROWS = (1, 2, 3, 17, 40)


def _serve(*over: str, forced=None):
    """(RunResult, the decoder ops' class) of one run; the runtime is freed before the next one is built."""
    rt = build(compose_config(*SHAPES, *WORK, *over))
    w = rt.container.model().weights
    assert isinstance(w.layers[0].attn.o_a_proj, BlockFP8) and isinstance(w.layers[0].mlp.down_proj, PackedFP4)
    ops = type(rt.container.decoder_ops())
    res = rt.engine.run(forced=forced)
    del rt, w
    gc.collect()
    torch.cuda.empty_cache()
    return res, ops


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("fp8_compute", ["w8a16", "w8a8"])
def test_fused_fp8_products_match_the_torch_ops(fp8_compute):
    from runtime.model.dsv4.layer import grouped_output

    rt = build(compose_config(*SHAPES, *WORK, "graph=off", f"model.fp8_compute={fp8_compute}"))
    fused, ref = rt.container.decoder_ops(), TorchOps()
    assert isinstance(fused, FusedOps)
    weights = rt.container.model().weights
    stored = [(name, w) for name, w in weights.named() if isinstance(w, BlockFP8)]
    assert len(stored) >= 6 and isinstance(weights.layers[0].mlp.down_proj, PackedFP4)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, w in stored:
        for m in ROWS:
            x = torch.randn(m, w.shape[1], device="cuda", generator=gen).bfloat16()
            err = _rel(fused.linear(x, w), ref.linear(x, w))
            assert err < PRODUCT_TOL[fp8_compute], f"{name} at {m} rows: relative error {err:.2e}"
    cfg, attn = rt.container.dsv4_rank_cfg(), weights.layers[0].attn
    for m in ROWS:
        o = torch.randn(m, cfg.attention.num_heads, cfg.attention.head_dim, device="cuda", generator=gen).bfloat16()
        err = _rel(grouped_output(o, attn.o_a_proj, attn.o_b_proj, cfg.o_groups, fused),
                   grouped_output(o, attn.o_a_proj, attn.o_b_proj, cfg.o_groups, ref))
        assert err < 2 * PRODUCT_TOL[fp8_compute], f"grouped output at {m} rows: relative error {err:.2e}"


def test_graphed_fp8_decode_gives_the_eager_tokens():
    runs = {}
    for graph in ("decode", "off"):
        runs[graph], ops = _serve(f"graph={graph}", "graph.batch_sizes=[1,2,3]")
        assert ops is FusedOps
    graphed = [s.graphed for s in runs["decode"].steps if s.phase == "decode"]
    assert graphed and all(graphed)
    assert runs["decode"].outputs == runs["off"].outputs
