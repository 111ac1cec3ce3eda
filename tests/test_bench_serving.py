"""`python -m bench.serving` on the CPU: a self-hosted tiny_mla server, Poisson arrivals at two rates, every
request streamed to completion, the latency percentiles and throughputs printed and in the JSON line."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from bench import serving  # noqa: E402
from bench.harness import JSON_PREFIX  # noqa: E402


@pytest.mark.parametrize("host", [[], ["--in-process", "--max-concurrency", "1", "4", "--waves", "1"]],
                         ids=["own-process", "in-process-concurrency-sweep"])
def test_serving_bench_smoke(capsys, tmp_path, host):
    """The server in its own process (python -m runtime.serve, the default), and on a thread of this one with a
    concurrency sweep (each level sends ``waves * concurrency`` requests and the server batches at most that many)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [5 + i] * (3 + i), "max_new_tokens": 4}) + "\n"
                               for i in range(5)))
    rows = serving.main(["--serve", "device=cpu", "kv.num_pages=64", "workload=chat", "--prompts-file", str(prompts),
                         "--request-rate", "40", "inf", "--seed", "1", *host])
    out = capsys.readouterr().out
    levels = [1, 1, 4, 4] if host else [None, None]
    assert [r["rate"] for r in rows] == [40.0, "inf"] * (len(levels) // 2)
    assert [r.get("concurrency") for r in rows] == levels
    for r, c in zip(rows, levels, strict=True):
        assert r["done"] == (c or 5) and r["failed"] == 0 and r["out tok/s"] > 0 and r["req/s"] > 0
        assert all(math.isfinite(r[f"{m} p{q} ms"]) for m in ("ttft", "itl", "e2e") for q in (50, 90, 99))
        assert r["ttft p50 ms"] <= r["e2e p50 ms"]
        assert 0 < r["server ttft mean ms"] <= r["ttft mean ms"] and r["server itl mean ms"] > 0
        assert r["server prefill steps"] >= 1 and 1 <= r["server decode batch"] <= (c or 5)
        assert r["server prefill step mean ms"] > 0 and r["server decode step mean ms"] > 0  # resolved step times
    doc = json.loads(out.strip().splitlines()[-1][len(JSON_PREFIX):])
    assert doc["bench"] == "serving" and len(doc["rows"]) == len(levels) and "ttft p99 ms" in out


def test_a_server_that_cannot_start_says_why():
    from bench.serving_host import ServerProcess

    with pytest.raises(RuntimeError, match="exited with 2 before answering(.|\n)*kv.num_pages"):
        ServerProcess(["device=cpu", "kv.num_pages=-3"], timeout=120).__enter__()


def test_random_jobs_follow_the_lengths():
    jobs = serving.random_jobs(50, 20, 10, 0.5, 512, seed=0)
    assert all(10 <= len(j.prompt) <= 20 and 5 <= j.output_len <= 10 for j in jobs)
    assert all(1 <= t < 512 for j in jobs for t in j.prompt)
    row = serving.summarize(2.0, [serving.Outcome(True, 0.1, [0.01, 0.02], 0.5, 3)], 1.0)
    assert row["ttft p50 ms"] == pytest.approx(100) and row["out tok/s"] == 3 and row["done"] == 1
