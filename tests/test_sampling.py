"""Sampling in the engine: per-request temperature / top-k / top-p / min-p with counter-based seeds (the same
tokens whatever a request is batched with), stop strings and stop ids, logprobs, greedy unchanged; the prompts
file's per-line parameters and their refusals; the step-wise engine interface (admit / step / abort)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import compose_config
from test_prompts import _tokenizer_folder as word_tokenizer
from tokenizers import Tokenizer

import containers
from runtime.app.parity import compare, reference_config
from runtime.app.report import _outputs
from runtime.core.errors import ConfigError
from runtime.engine.sampling import Sampler, SamplingParams, filter_probs, parse_params, uniform_noise
from runtime.engine.stops import StopRule, TextStream
from runtime.engine.workload import Request

F64 = ("model.dtype=float64", "backend.compute_dtype=float64")
CPU = torch.device("cpu")


def _file(tmp_path: Path, *lines, name: str = "requests.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return p


def _run(path: Path, *overrides: str):
    rt = containers.build(compose_config("device=cpu", "workload=prompts", f"workload.path={path}", "kv.num_pages=256",
                                         *F64, *overrides))
    return rt, rt.engine.run()


# ------------------------------------------------------------------------------------------- the sampler
def test_sampled_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(8000, 1)
    greedy = logits.argmax(-1)
    probs = torch.softmax(logits[0], -1)
    cases = {(): probs, (("top_k", 2),): torch.tensor([0, probs[1], probs[2], 0]),
             (("top_p", 0.7),): torch.tensor([0, probs[1], probs[2], 0]),
             (("min_p", 0.1),): torch.tensor([probs[0], probs[1], probs[2], 0])}
    for extra, want in cases.items():
        ps = [SamplingParams(temperature=1.0, seed=i, **dict(extra)) for i in range(8000)]
        got = torch.bincount(Sampler(CPU).sample(logits, ps, [0] * 8000, greedy).tokens, minlength=4) / 8000
        assert torch.allclose(got, want / want.sum(), atol=0.02), (extra, got)
    cold = [SamplingParams(temperature=0.05, seed=i) for i in range(200)]  # low temperature: the top token
    assert (Sampler(CPU).sample(logits[:200], cold, [0] * 200, greedy[:200]).tokens == 2).all()


def test_noise_is_a_function_of_seed_position_and_token_only():
    seeds, pos = torch.tensor([5, 5, 6, 2**62 + 3]), torch.tensor([0, 1, 0, 7])
    u = uniform_noise(seeds, pos, 1000)
    assert u.shape == (4, 1000) and 0 < u.min() and u.max() < 1 and abs(u.mean().item() - 0.5) < 0.02
    assert torch.equal(uniform_noise(seeds[[2, 0]], pos[[2, 0]], 1000), u[[2, 0]])  # any batch order
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_greedy_rows_keep_the_top1_and_mixed_batches_draw_the_same_as_alone():
    torch.manual_seed(0)
    logits = torch.randn(5, 512)
    greedy = torch.topk(logits, 2, dim=-1).indices[:, 0]
    s = Sampler(CPU)
    ps = [None, SamplingParams(temperature=0.9, seed=3, top_k=50), SamplingParams(), SamplingParams(temperature=1.3,
          seed=4, top_p=0.8, min_p=0.01, logprobs=3), SamplingParams(logprobs=0)]
    d = s.sample(logits, ps, [0, 4, 2, 9, 1], greedy)
    assert d.tokens[[0, 2, 4]].tolist() == greedy[[0, 2, 4]].tolist()
    for i in (1, 3):  # alone, the same token
        assert s.sample(logits[i : i + 1], [ps[i]], [[0, 4, 2, 9, 1][i]], greedy[i : i + 1]).tokens.item() == d.tokens[i]
    lp = torch.log_softmax(logits, -1)
    assert torch.allclose(d.logprob, lp.gather(1, d.tokens[:, None]).squeeze(1))
    assert d.top_ids.shape == (5, 3) and d.top_ids[3].tolist() == torch.topk(lp[3], 3).indices.tolist()
    assert d.wanted == [None, None, None, 3, 0]
    assert not s.needed([None, SamplingParams()]) and s.needed([SamplingParams(logprobs=0)])


def test_filters_apply_top_k_then_top_p_on_the_renormalized_set_then_min_p_and_keep_the_top_token():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    one, all_k = torch.ones(1), torch.tensor([0])

    def kept(k, p, m):
        return (filter_probs(logits, one, torch.tensor([k]), torch.tensor([p]), torch.tensor([m])) > 0).tolist()[0]

    assert kept(2, 1.0, 0.0) == [True, True, False, False]
    assert kept(3, 0.5, 0.0) == [True, True, False, False]  # top-3 renormalized: 0.44, 0.33, 0.22
    assert kept(0, 0.5, 0.0) == [True, True, False, False] and kept(0, 0.35, 0.0) == [True, False, False, False]
    assert kept(0, 1.0, 0.45) == [True, True, True, False]  # p >= 0.45 * 0.4
    assert kept(1, 0.01, 1.0) == [True, False, False, False]
    assert torch.allclose(filter_probs(logits, one, all_k, one, torch.zeros(1)), torch.exp(logits))


def test_parse_params_lists_every_problem():
    p, problems = parse_params({"temperature": -1, "top_p": 0, "top_k": 1.5, "min_p": 2, "seed": "x", "stop": [""],
                                "stop_token_ids": [600], "ignore_eos": 1, "logprobs": 50}, "line 3 ", 512)
    assert p is None and len(problems) == 9
    assert all(str(x).startswith("line 3 ") and "Fix:" in str(x) for x in problems)
    p, problems = parse_params({"temperature": 0.5, "stop": "w7", "top_k": -1, "seed": None}, "", 512)
    assert not problems and p.stop == ("w7",) and p.top_k == 0 and p.seed is None and not p.greedy
    assert p.seeded().seed is not None and SamplingParams().seeded().seed is None


# --------------------------------------------------------------------------------------------- stops
def test_text_stream_cuts_before_a_stop_string_and_holds_back_its_start(tmp_path):
    tok = Tokenizer.from_file(str(word_tokenizer(tmp_path) / "tokenizer.json"))
    ts = TextStream(tok, ("w7 w8",))
    assert not ts.push(5) and ts.ready() == "w5"
    assert not ts.push(7) and ts.text == "w5 w7" and ts.ready() == "w5 "  # " w7" may start the stop string
    assert ts.push(8) and ts.stopped and ts.text == "w5 " and ts.ready() == "w5 "
    rule = StopRule(SamplingParams(stop_token_ids=(9,), ignore_eos=True), frozenset({2}), tok)
    assert not rule.hit(2) and rule.hit(9) and rule.matched == "token"


# ----------------------------------------------------------------------------------- the prompts file
def test_prompt_file_sampling_is_reproducible_alone_and_in_a_batch_and_greedy_is_unchanged(tmp_path):
    sampled = {"prompt_ids": [3, 1, 4, 1, 5], "max_new_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 42}
    greedy = [{"prompt_ids": [7, 7, 2], "max_new_tokens": 6}, {"prompt_ids": list(range(40, 52)), "max_new_tokens": 4}]
    _, alone = _run(_file(tmp_path, sampled, name="alone.jsonl"))
    rt, mixed = _run(_file(tmp_path, greedy[0], sampled, greedy[1], {**sampled, "seed": 43}, name="mixed.jsonl"))
    _, plain = _run(_file(tmp_path, *greedy, name="plain.jsonl"))
    assert mixed.outputs[1] == alone.outputs[0]  # the seeded request, whatever it is batched with
    assert mixed.outputs[3] != mixed.outputs[1]  # another seed, other tokens
    assert [mixed.outputs[0], mixed.outputs[2]] == [plain.outputs[0], plain.outputs[1]]  # greedy lines unchanged
    assert mixed.outputs[1] != mixed.argmax[1]  # it did sample
    ref = containers.build(reference_config(rt.config)).engine.run(forced=mixed.outputs)
    assert compare(mixed, ref, "float64").ok  # parity compares the model's own greedy choices


def test_prompt_file_stop_strings_stop_ids_and_logprobs(tmp_path):
    folder = word_tokenizer(tmp_path / "tok")
    base = {"prompt": "w3 w1 w4 w1 w5", "max_new_tokens": 10}
    _, full = _run(_file(tmp_path, base, name="full.jsonl"), f"workload.tokenizer={folder}")
    out = full.outputs[0]
    third = out[2]
    lines = [{**base, "stop": [f"w{third}"]}, {**base, "stop_token_ids": [third]}, {**base, "logprobs": 2}]
    rt, res = _run(_file(tmp_path, *lines), f"workload.tokenizer={folder}")
    first = out.index(third)  # the first time that token appears
    assert res.outputs[0] == out[: first + 1] and res.finish_reasons[0] == "stop"
    assert res.outputs[1] == out[: first + 1] and res.finish_reasons[1] == "stop"
    assert res.outputs[2] == out and res.finish_reasons[2] == "length"
    shown = _outputs(res, rt.container.workload())  # the report's text: cut before the stop string, as served
    assert f"w{third}" not in shown[0]["text"] and shown[2]["text"].startswith(shown[0]["text"])
    pages = rt.container.page_allocator()
    assert pages.available == pages.capacity


def test_prompt_file_refuses_bad_sampling_parameters_with_their_line(tmp_path):
    path = _file(tmp_path, {"prompt_ids": [1, 2], "temperature": -0.5, "top_k": "many"},
                 {"prompt_ids": [1, 2], "stop": ["x"]})
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config("device=cpu", "workload=prompts", f"workload.path={path}", "kv.num_pages=64"))
    msg = str(e.value)
    assert "line 1 temperature" in msg and "line 1 top_k" in msg and "line 2 stop" in msg and "no tokenizer" in msg


# ------------------------------------------------------------------------------------------- step-wise
def test_requests_admitted_between_steps_and_aborted_ones_free_their_pages():
    rt = containers.build(compose_config("device=cpu", "kv.num_pages=64", *F64))
    eng = rt.engine
    pages = eng.slots.pages
    a = Request(rid=0, prompt=[3, 1, 4], max_new_tokens=6)
    eng.begin([a], record_hidden=False)
    assert eng.step()  # a's prefill
    b = Request(rid=1, prompt=[3, 1, 4], max_new_tokens=6)
    c = Request(rid=2, prompt=list(range(50)), max_new_tokens=40)
    eng.admit([b, c])
    assert eng.step() and eng.load == (0, 3)  # both join at the next step
    eng.abort(c)
    assert eng.load == (0, 2) and c.row is None and c.done
    while eng.step():
        pass
    res = eng.end([a, b])
    assert res.outputs[0] == res.outputs[1] and len(res.outputs[0]) == 6  # same prompt, greedy: same tokens
    assert pages.available == pages.capacity and eng.load == (0, 0)


def test_live_engine_finishes_the_last_request_while_its_token_is_still_pending(monkeypatch):
    """With overlap the newest step's tokens resolve later (as on a GPU that runs behind the host): when the last
    request leaves the batch with its final token still pending, the engine thread flushes instead of waiting."""
    import threading

    from runtime.engine.live import LiveEngine
    from runtime.engine.step_outputs import StepOutputs

    monkeypatch.setattr(StepOutputs, "_ready", lambda self, step: len(self._q) > 2)
    rt = containers.build(compose_config("device=cpu", "kv.num_pages=64", "engine.overlap=on"))
    live = LiveEngine(rt.engine, None, frozenset(), 8)
    live.start()
    try:
        done, got = threading.Event(), []

        def sink(ev):
            got.extend(ev.token_ids)
            if ev.kind == "done":
                done.set()

        live.submit([3, 1, 4], 5, SamplingParams(temperature=0.7, seed=1), sink)
        assert done.wait(20) and len(got) == 5
        assert live.pages[0] == live.pages[1] and live.running == 0
    finally:
        live.stop()


@pytest.mark.parametrize("budget,want", [(64, {"a": 1}), (3, {"a": 2, "b": 2})])
def test_live_engine_sends_a_first_token_before_the_next_launch(budget, want, monkeypatch):
    """With overlap a step is read back after the next launch (the device here never reports a step done on its
    own, as a GPU behind the host); a first token is read back at once when no prompt waits: alone, its event
    follows the prefill step, not the decode steps launched behind it (it came after 3 steps before). With a second
    prompt waiting (a batch budget of one 3-token prompt), the first prefill's token waits for the second
    prefill's launch (overlap kept), then both go out."""
    import threading

    from runtime.engine.live import LiveEngine
    from runtime.engine.step_outputs import StepOutputs

    monkeypatch.setattr(StepOutputs, "_ready", lambda self, step: False)

    rt = containers.build(compose_config("device=cpu", "kv.num_pages=64", "engine.overlap=on",
                                         f"workload.max_tokens_per_batch={budget}",
                                         f"workload.chunked_prefill_size={budget}"))
    live = LiveEngine(rt.engine, None, frozenset(), 8)
    firsts, seen = {}, threading.Event()

    def sink_for(name):
        def sink(ev):
            if ev.kind == "tokens" and name not in firsts:
                firsts[name] = live.steps  # steps launched when the first token went out
                if len(firsts) == len(want):
                    seen.set()
        return sink

    for name in want:
        live.submit([3, 1, 4], 6, SamplingParams(), sink_for(name))
    live.start()
    try:
        assert seen.wait(20) and firsts == want
    finally:
        live.stop()


def test_live_engine_survives_a_failing_step():
    """A step that raises fails the requests in flight with an error event, returns their pages, and the engine
    thread goes on serving the next request."""
    import threading

    from runtime.engine.live import LiveEngine

    rt = containers.build(compose_config("device=cpu", "kv.num_pages=64"))
    eng = rt.engine
    live = LiveEngine(eng, None, frozenset(), 8)
    real_step, calls = eng.step, []

    def flaky(bar=None):
        calls.append(1)
        if len(calls) == 2:  # the first request's first decode step
            raise RuntimeError("device fell over")
        return real_step(bar)

    eng.step = flaky
    live.start()
    try:
        events, done = [], threading.Event()

        def sink(ev):
            events.append(ev)
            if ev.kind in ("done", "error"):
                done.set()

        live.submit([3, 1, 4], 6, SamplingParams(), sink)
        assert done.wait(20) and events[-1].kind == "error" and "device fell over" in events[-1].message
        assert live.errors == 1 and live.pages[0] == live.pages[1]
        done.clear()
        live.submit([3, 1, 4], 4, SamplingParams(), sink)
        assert done.wait(20) and events[-1].kind == "done" and live.alive
    finally:
        live.stop()
