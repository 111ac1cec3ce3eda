"""Sampling on CUDA: FlashInfer's renorm filters agree with the torch filters, the step issues no host sync, and a
seeded request is reproducible alone and in a batch through the engine (overlap on) and the server."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config

import containers
from runtime.engine.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _params(n: int) -> list[SamplingParams]:
    out = []
    for i in range(n):
        out.append(SamplingParams(temperature=0.6 + 0.1 * (i % 5), top_k=[0, 50, 5][i % 3], top_p=[1.0, 0.9, 0.5][i % 3],
                                  min_p=[0.0, 0.02][i % 2], seed=1000 + i))
    return out


def test_flashinfer_filters_match_the_torch_filters_and_sync_nothing():
    pytest.importorskip("flashinfer")
    torch.manual_seed(0)
    logits = torch.randn(256, 129280, device=CUDA) * 3
    greedy = torch.topk(logits, 2, dim=-1).indices[:, 0]
    ps, pos = _params(256), list(range(256))
    fi, plain = Sampler(CUDA), Sampler(CUDA, use_flashinfer=False)
    fi.sample(logits, ps, pos, greedy)  # first call: imports FlashInfer, JIT-loads its module
    assert fi.fallback_reason is None, fi.fallback_reason
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the step raises
    try:
        a = fi.sample(logits, ps, pos, greedy).tokens
        b = plain.sample(logits, ps, pos, greedy).tokens
    finally:
        torch.cuda.set_sync_debug_mode("default")
    agree = (a == b).float().mean().item()
    assert agree >= 0.98, agree  # the same noise; filter boundaries may differ by rounding
    cpu = Sampler(torch.device("cpu")).sample(logits.cpu(), ps, pos, greedy.cpu()).tokens
    assert (cpu == b.cpu()).float().mean().item() >= 0.98


def test_seeded_request_is_reproducible_alone_and_in_a_batch_on_the_engine(tmp_path):
    sampled = {"prompt_ids": [3, 1, 4, 1, 5], "max_new_tokens": 16, "temperature": 0.8, "top_k": 40, "seed": 9}
    other = [{"prompt_ids": [7] * n, "max_new_tokens": 12, "temperature": 1.0, "seed": n} for n in range(1, 6)]
    outs = []
    for name, lines in (("alone", [sampled]), ("batch", [*other[:2], sampled, *other[2:]])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        rt = containers.build(compose_config("device=cuda", "workload=prompts", f"workload.path={path}",
                                             "model.dtype=float32", "engine.overlap=on", "check=off"))
        outs.append(rt.engine.run(record_hidden=False).outputs)
    assert outs[1][2] == outs[0][0]


def test_server_on_cuda_serves_sampled_and_greedy():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from runtime.app.serve.server import Background, make_server

    srv = make_server(compose_config("device=cuda", "workload=chat", "serve.port=0"))
    with Background(srv) as bg:
        body = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 8, "temperature": 0.7, "seed": 5}
        one = httpx.post(bg.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
        two = httpx.post(bg.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]
        assert one == two and len(one) == 8
        assert srv.state.live.engine.sampler.fallback_reason is None or not srv.state.live.engine.sampler.use_flashinfer
