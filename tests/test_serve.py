"""The OpenAI-compatible server, live on 127.0.0.1 (a free port), driven by the official `openai` client and
raw HTTP: completions, chat, streaming, greedy equal to the offline prompts workload, seeded sampling
reproducible alone and in a batch, stop strings, logprobs, every bad input's status and error object, and a
bounded load with disconnects and bad bodies after which the KV pool is whole and /metrics adds up."""

from __future__ import annotations

import gc
import json
import re
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import compose_config  # noqa: E402
from test_sampling import F64, word_tokenizer  # noqa: E402

import containers  # noqa: E402
from runtime.app.serve.server import Background, make_server  # noqa: E402
from runtime.core.errors import ConfigError  # noqa: E402

TEMPLATE = ("{{ bos_token }} {% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w2{% endif %}")
PROMPTS = [[3, 1, 4, 1, 5], [7, 7, 2], list(range(40, 60)), [9]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return word_tokenizer(tmp_path_factory.mktemp("model"),
                          tokenizer_config={"chat_template": TEMPLATE, "bos_token": "w1", "eos_token": "w2"})


@pytest.fixture(scope="module")
def server(folder):
    srv = make_server(compose_config("device=cpu", *F64, "workload=chat", "kv.num_pages=96", f"workload.tokenizer={folder}",
                                     "workload.eos_token_ids=[]", "serve.port=0", "serve.max_queued_requests=64"))
    with Background(srv) as bg:
        yield bg


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tmp_path_factory, folder):
    """The greedy outputs of PROMPTS (16 tokens each) from `workload=prompts`, the offline path."""
    path = tmp_path_factory.mktemp("offline") / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": 16}) + "\n" for p in PROMPTS))
    rt = containers.build(compose_config("device=cpu", *F64, "workload=prompts", f"workload.path={path}",
                                         "kv.num_pages=96", "workload.eos_token_ids=[]"))
    return rt.engine.run(record_hidden=False).outputs


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def _concurrently(fn, args: list, workers: int = 8) -> list:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, args))


# ------------------------------------------------------------------------------------------ the API
def test_models_health_and_a_completion_with_usage(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny_mla"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = client.completions.create(model="tiny_mla", prompt="w3 w1 w4", max_tokens=5)
    c = r.choices[0]
    assert c.finish_reason == "length" and len(_ids(c)) == 5 and c.text == " ".join(f"w{t}" for t in _ids(c))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 5, 8)


def test_greedy_equals_the_offline_prompts_workload_batched_and_streamed(client, offline):
    def one(i):
        return _ids(client.completions.create(model="tiny_mla", prompt=PROMPTS[i], max_tokens=16).choices[0])

    def streamed(i):
        ids = []
        for ch in client.completions.create(model="tiny_mla", prompt=PROMPTS[i], max_tokens=16, stream=True):
            ids += _ids(ch.choices[0])
        return ids

    got = _concurrently(one, list(range(4))) + _concurrently(streamed, list(range(4)))
    assert got == [offline[i] for i in range(4)] * 2


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(client):
    kw = dict(model="tiny_mla", prompt=PROMPTS[0], max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    alone = _ids(client.completions.create(**kw).choices[0])
    others = [dict(kw, seed=s, prompt=PROMPTS[s % 4]) for s in range(5)] + [kw]
    batch = _concurrently(lambda k: _ids(client.completions.create(**k).choices[0]), others)
    assert batch[-1] == alone and len({tuple(b) for b in batch}) > 2
    greedy = _ids(client.completions.create(model="tiny_mla", prompt=PROMPTS[0], max_tokens=12).choices[0])
    assert alone != greedy


def test_stop_strings_are_cut_from_the_text_and_stop_ids_end_the_request(client):
    full = client.completions.create(model="tiny_mla", prompt=PROMPTS[1], max_tokens=10).choices[0]
    ids = _ids(full)
    t = ids[3]
    cut = ids.index(t)
    r = client.completions.create(model="tiny_mla", prompt=PROMPTS[1], max_tokens=10, stop=[f"w{t}"]).choices[0]
    assert r.finish_reason == "stop" and _ids(r) == ids[: cut + 1]
    assert r.text == " ".join(f"w{x}" for x in ids[:cut]) + (" " if cut else "")
    pieces = [ch.choices[0].text for ch in client.completions.create(
        model="tiny_mla", prompt=PROMPTS[1], max_tokens=10, stop=[f"w{t}"], stream=True) if ch.choices]
    assert "".join(pieces) == r.text
    r = client.completions.create(model="tiny_mla", prompt=PROMPTS[1], max_tokens=10,
                                  extra_body={"stop_token_ids": [t]}).choices[0]
    assert r.finish_reason == "stop" and _ids(r) == ids[: cut + 1] and r.text.endswith(f"w{t}")


def test_logprobs_completions_and_chat(client):
    r = client.completions.create(model="tiny_mla", prompt=PROMPTS[0], max_tokens=4, logprobs=3).choices[0]
    lp = r.logprobs
    assert lp.tokens == [f"w{t}" for t in _ids(r)] and len(lp.token_logprobs) == 4
    for chosen, top, tok in zip(lp.token_logprobs, lp.top_logprobs, lp.tokens):
        assert len(top) == 3 and max(top.values()) == top[tok] == pytest.approx(chosen)  # greedy: the best
    c = client.chat.completions.create(model="tiny_mla", messages=[{"role": "user", "content": "w5 w6"}],
                                       max_tokens=3, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in content)


def test_chat_renders_the_template_and_streams_with_role_then_usage(client):
    msgs = [{"role": "system", "content": "w8"}, {"role": "user", "content": "w5 w6"}]
    r = client.chat.completions.create(model="tiny_mla", messages=msgs, max_tokens=6)
    assert r.usage.prompt_tokens == 5  # "w1 w8 w5 w6 w2": bos, the contents, the generation prompt
    assert r.choices[0].message.role == "assistant" and len(r.choices[0].message.content.split()) == 6
    chunks = list(client.chat.completions.create(model="tiny_mla", messages=msgs, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("body,status,param,needle", [
    ({"prompt": [1, 2], "n": 2}, 400, "n", "one choice per request"),
    ({"prompt": [1, 2], "best_of": 3}, 400, "best_of", "best_of"),
    ({"prompt": [1, 2], "max_tokenz": 3}, 400, "max_tokenz", "unknown field"),
    ({"prompt": [1, 2], "temperature": -1, "top_p": 2}, 400, "temperature", "2 problems"),
    ({"prompt": [1, 2], "max_tokens": 2000}, 400, "max_tokens", "prompt 2 + max_tokens 2000 = 2002 tokens"),
    ({"prompt": [1, 900]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": ["a", "b"]}, 400, "prompt", "one request per prompt"),
    ({"prompt": [1], "model": "gpt-4"}, 404, "model", "tiny_mla"),
])
def test_bad_completion_bodies_get_their_status_and_error_object(server, body, status, param, needle):
    r = httpx.post(server.url + "/v1/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == status and err["param"] == param and needle in err["message"], err
    assert set(err) == {"message", "type", "param", "code"} and "Fix:" in err["message"]


def test_a_body_that_is_not_json(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_configs_the_server_cannot_run_are_refused_with_every_problem():
    with pytest.raises(ConfigError) as e:
        make_server(compose_config("device=cpu", "serve.max_queued_requests=0", "serve.port=70000",
                                   "speculative=eagle_chain", "serve.api_key=' '"))
    msg = str(e.value)
    assert "4 problems" in msg and all(k in msg for k in ("serve.port", "serve.max_queued_requests",
                                                          "speculative.enabled", "serve.api_key"))


def test_chat_without_a_template_names_the_fix(tmp_path):
    folder = word_tokenizer(tmp_path / "plain")  # a tokenizer, no tokenizer_config.json
    srv = make_server(compose_config("device=cpu", "kv.num_pages=32", f"workload.tokenizer={folder}",
                                     "serve.port=0", "serve.api_key=sekret", "serve.max_queued_requests=1",
                                     "workload.max_running_requests=1"))
    with Background(srv) as bg:
        url = bg.url + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "w5"}]}
        assert httpx.post(url, json=body).status_code == 401  # no key
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}).json()["error"]["code"] == \
            "invalid_api_key"
        auth = {"Authorization": "Bearer sekret"}
        r = httpx.post(url, json=body, headers=auth)
        assert r.status_code == 400 and "no chat_template" in r.json()["error"]["message"]
        assert "tokenizer_config.json" in r.json()["error"]["message"]
        assert httpx.get(bg.url + "/health").status_code == 200  # not behind the key
        r = httpx.post(bg.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 600}, headers=auth)
        assert r.status_code == 400 and "prompt 2 + max_tokens 600 = 602 tokens" in r.json()["error"]["message"]
        assert "KV pool holds for one request (496 tokens)" in r.json()["error"]["message"]  # 31 pages x 16
        # the queue: one running (a long one), one waiting, the next is refused with Retry-After
        comp = bg.url + "/v1/completions"
        long = {"prompt": [1, 2], "max_tokens": 400, "ignore_eos": True}
        release = threading.Event()

        def send():  # streams until released, then disconnects (which aborts it)
            with httpx.stream("POST", comp, json={**long, "stream": True}, headers=auth, timeout=60) as r:
                for _ in r.iter_lines():
                    if release.is_set():
                        break

        threads = [threading.Thread(target=send) for _ in range(2)]
        threads[0].start()
        _wait(lambda: srv.state.live.running == 1)
        threads[1].start()
        _wait(lambda: srv.state.live.queued == 1)
        r = httpx.post(comp, json=long, headers=auth)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "server_busy"
        release.set()
        for t in threads:
            t.join(60)
        _wait(lambda: srv.state.live.running == 0 and srv.state.live.pages[0] == srv.state.live.pages[1])


def test_a_closed_server_frees_its_engine():
    """Nothing global keeps a closed server's engine (FastAPI caches endpoint functions module-wide: a closure over
    the state kept every earlier server's engine and KV pool alive, and later GPU tests ran out of memory)."""
    srv = make_server(compose_config("device=cpu", "kv.num_pages=32", "workload=chat", "serve.port=0"))
    with Background(srv) as bg:
        assert httpx.post(bg.url + "/v1/completions", json={"prompt": [3, 1], "max_tokens": 2}).status_code == 200
        assert httpx.get(bg.url + "/health").status_code == 200
    engine = weakref.ref(srv.state.live.engine)
    del srv, bg
    gc.collect()
    assert engine() is None


def test_hisparse_serves_the_offline_tokens(tmp_path):
    """A sparse model with HiSparse behind the server (its page view is the device / host pools' pair: the server
    read a page size it did not have): greedy tokens equal the offline prompts workload's."""
    prompts = [list(range(3, 40)), [5, 9, 2, 7]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p, "max_new_tokens": 5}) + "\n" for p in prompts))
    base = ("+deploy=cpu_dsa_hisparse", "check=off", "progress=false", "workload.eos_token_ids=[]")
    rt = containers.build(compose_config(*base, "workload=prompts", f"workload.path={path}"))
    want = [rt.engine.run(record_hidden=False).outputs[i] for i in range(len(prompts))]
    del rt
    srv = make_server(compose_config(*base, "serve.port=0"))
    with Background(srv) as bg:
        got = [httpx.post(bg.url + "/v1/completions", json={"prompt": p, "max_tokens": 5, "temperature": 0},
                          timeout=60).json() for p in prompts]
    assert [_ids_of(g["choices"][0]) for g in got] == want


def _wait(cond, timeout: float = 20.0) -> None:
    ev = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        ev.wait(0.01)
    raise AssertionError("condition not reached")


# ------------------------------------------------------------------------------------------ load with faults
def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_load_with_disconnects_and_bad_bodies(server, offline):
    """60 requests from 16 clients: 12 disconnect mid-stream, 3 give up waiting for a whole (not streamed) answer,
    6 are malformed, the rest complete with the offline greedy tokens; afterwards every KV page is free and
    /metrics counts what happened."""
    base = httpx.get(server.url + "/metrics").text
    live = server.server.state.live
    free0, capacity = live.pages
    assert free0 == capacity
    kinds = ["ok"] * 39 + ["drop"] * 12 + ["hang"] * 3 + ["bad"] * 6
    kinds = [kinds[(i * 7) % 60] for i in range(60)]  # interleaved (7 is prime to 60)

    def job(i: int):
        kind, p = kinds[i], i % 4
        with httpx.Client(base_url=server.url, timeout=60) as h:
            if kind == "bad":
                r = h.post("/v1/completions", json={"prompt": PROMPTS[p], "max_tokens": 4, "bogus": i})
                return kind, r.status_code
            if kind == "drop":
                body = {"prompt": PROMPTS[p], "max_tokens": 200, "stream": True, "ignore_eos": True}
                with h.stream("POST", "/v1/completions", json=body) as r:
                    lines = r.iter_lines()
                    got = [next(lines) for _ in range(3)]  # some tokens, then the client goes away
                return kind, len(got)
            if kind == "hang":  # the client stops waiting: the server notices the dropped connection
                body = {"prompt": PROMPTS[p], "max_tokens": 400, "ignore_eos": True}
                try:
                    h.post("/v1/completions", json=body, timeout=0.5)
                except httpx.TimeoutException:
                    return kind, True
                return kind, False
            body = {"prompt": PROMPTS[p], "max_tokens": 16, "stream": bool(i % 2)}
            if not body["stream"]:
                return kind, _ids_of(h.post("/v1/completions", json=body).json()["choices"][0]) == offline[p]
            ids = []
            with h.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        ids += json.loads(line[6:])["choices"][0]["token_ids"]
                    elif line == "data: [DONE]":
                        break
            return kind, ids == offline[p]

    results = _concurrently(job, list(range(60)), workers=16)
    assert all(v is True for k, v in results if k in ("ok", "hang"))
    assert all(v == 400 for k, v in results if k == "bad")
    _wait(lambda: live.running == 0 and live.queued == 0 and live.pages[0] == free0)
    text = httpx.get(server.url + "/metrics").text
    delta = {reason: _metric(text, "mla_requests_total", f'{{finish_reason="{reason}"}}')
             - _metric(base, "mla_requests_total", f'{{finish_reason="{reason}"}}') for reason in ("length", "abort")}
    assert delta == {"length": 39, "abort": 15}
    assert (_metric(text, "mla_requests_rejected_total", '{status="400"}')
            - _metric(base, "mla_requests_rejected_total", '{status="400"}')) == 6
    assert _metric(text, "mla_kv_pages_used") == 0 and _metric(text, "mla_requests_running") == 0
    first = (_metric(text, "mla_time_to_first_token_seconds_count")
             - _metric(base, "mla_time_to_first_token_seconds_count"))
    assert 51 <= first <= 54  # every request that started streaming (those that gave up: if it came in time)
    prefills = (_metric(text, "mla_engine_step_requests_total", '{phase="prefill"}')
                - _metric(base, "mla_engine_step_requests_total", '{phase="prefill"}'))
    assert prefills >= first and (_metric(text, "mla_engine_steps_total", '{phase="decode"}')
                                  > _metric(base, "mla_engine_steps_total", '{phase="decode"}'))
    assert httpx.get(server.url + "/health").status_code == 200 and live.errors == 0


def _ids_of(choice: dict) -> list[int]:
    return choice["token_ids"]


def test_python_m_runtime_serve_serves_until_interrupted(tmp_path):
    """The entry point: the Hydra config with the serve group, served until SIGINT."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    run = [sys.executable, "-m", "runtime.serve", "device=cpu", "kv.num_pages=32", f"hydra.run.dir={tmp_path}/run"]
    with socket.socket() as s:  # a free port (released just before the server binds it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([*run, f"serve.port={port}"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            assert p.poll() is None, p.communicate()[0]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}, timeout=30).json()
        assert len(r["choices"][0]["token_ids"]) == 4
        assert "mla_requests_running" in httpx.get(url + "/metrics").text
    finally:
        p.send_signal(signal.SIGINT)
        out = p.communicate(timeout=30)[0]
    assert p.returncode in (0, -signal.SIGINT), out
    assert "serving tiny_mla on http://127.0.0.1" in out and os.path.isdir(tmp_path / "run")
