"""Prompts in, tokens out: prompt files (token ids and text), EOS stops in every decoding mode, report outputs,
and every kind of bad input refused before serving with one message that names each line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compose_config
from dependency_injector import providers
from test_cli import cli
from tokenizers import Tokenizer, models, pre_tokenizers

import containers
from runtime.app.parity import compare, reference_config
from runtime.core.errors import ConfigError
from runtime.core.kv_pool import TokenSlots
from runtime.engine.prompts import load_workload
from runtime.engine.step_outputs import StepOutputs

F64 = ("model.dtype=float64", "backend.compute_dtype=float64")  # no near-ties between batch compositions


def _file(tmp_path: Path, *lines, name: str = "requests.jsonl") -> Path:
    """A prompt file: dicts are written as JSON, strings as they are."""
    p = tmp_path / name
    p.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return p


def _tokenizer_folder(folder: Path, vocab_size: int = 512, **json_files) -> Path:
    """A model folder with a word-level tokenizer.json ("w<i>" is token i; 0 is <unk>) and the given JSON files."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    for name, data in json_files.items():
        (folder / f"{name}.json").write_text(json.dumps(data))
    return folder


def _build(path: Path, *overrides: str):
    return containers.build(compose_config("device=cpu", "workload=prompts", f"workload.path={path}", *overrides))


def _run(path: Path, *overrides: str):
    rt = _build(path, *overrides)
    return rt, rt.engine.run()


def _cut(tokens: list[int], eos: set[int]) -> list[int]:
    """``tokens`` up to and including the first EOS id."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


# four requests of different lengths; several decode at once
REQUESTS = [{"prompt_ids": [3, 1, 4, 1, 5, 9, 2, 6], "max_new_tokens": 8}, {"prompt_ids": [27, 18], "max_new_tokens": 6},
            {"prompt_ids": list(range(100, 140)), "max_new_tokens": 8}, {"prompt_ids": [7], "max_new_tokens": 5}]


def _lagging(monkeypatch, behind: int = 3):
    """Make the host resolve a step only when ``behind`` newer ones are queued, as on a GPU that runs behind the
    host: steps for a request that has already emitted its EOS get enqueued before the host sees it."""
    monkeypatch.setattr(StepOutputs, "_ready", lambda self, step: len(self._q) > behind)


# ------------------------------------------------------------------------------------------ end to end
def test_prompt_ids_file_through_the_cli_reports_outputs_in_input_order(tmp_path):
    lines = [{"prompt_ids": [5] * n, "max_new_tokens": m} for n, m in ((9, 3), (2, 7), (30, 1), (4, 5))]
    path = _file(tmp_path, lines[0], "", lines[1], *lines[2:])  # a blank line is skipped
    p = cli("device=cpu", "workload=prompts", f"workload.path={path}", tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    outs = rep["outputs"]
    assert [o["rid"] for o in outs] == [0, 1, 2, 3]
    assert [(o["prompt_tokens"], len(o["output_ids"])) for o in outs] == [(9, 3), (2, 7), (30, 1), (4, 5)]
    assert all(o["finish_reason"] == "length" and "text" not in o for o in outs)
    assert all(0 <= t < 512 for o in outs for t in o["output_ids"])
    assert rep["requests"]["prompt_tokens"] == 45 and rep["requests"]["lost"] == 0
    assert rep["workload"] == "prompts" and rep["parity"]["ok"] is True
    assert "#0 (3 tok, length)" in p.stdout and "1 more in report.json" in p.stdout


def test_text_prompts_through_the_cli_with_a_tokenizer_override(tmp_path):
    folder = _tokenizer_folder(tmp_path / "tok")
    path = _file(tmp_path, {"prompt": "w5 w17 w300 w2", "max_new_tokens": 4}, {"prompt_ids": [8, 9], "max_new_tokens": 3})
    p = cli("device=cpu", "workload=prompts", f"workload.path={path}", f"workload.tokenizer={folder}", "check=off",
            tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr
    outs = json.loads((tmp_path / "run" / "report.json").read_text())["outputs"]
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert outs[0]["prompt_tokens"] == 4 and [len(o["output_ids"]) for o in outs] == [4, 3]
    for o in outs:  # every request gets its text, decoded from its ids (one word per id)
        assert o["text"] == tok.decode(o["output_ids"]) and len(o["text"].split()) == len(o["output_ids"])


def test_model_folder_gives_tokenizer_and_eos_ids(tmp_path):
    folder = _tokenizer_folder(tmp_path / "model", config={"eos_token_id": 1},
                               generation_config={"eos_token_id": [7, 11]})
    path = _file(tmp_path, {"prompt": "w5 w6", "max_new_tokens": 2})
    cfg = containers.to_plain(compose_config("workload=prompts"))
    model, work = {**cfg["model"], "path": str(folder)}, {**cfg["workload"], "path": str(path)}
    wl = load_workload(work, model)
    assert wl.specs[0].prompt == (5, 6) and wl.eos_ids == {7, 11}  # generation_config.json wins over config.json
    (folder / "generation_config.json").unlink()
    assert load_workload(work, model).eos_ids == {1}
    assert load_workload(work, {**model, "eos_token_id": [9]}).eos_ids == {9}  # a model config's (checkpoint) ids
    assert load_workload({**work, "eos_token_ids": []}, model).eos_ids == frozenset()  # [] never stops early
    assert load_workload({**work, "eos_token_ids": [3]}, model).decode([5, 3]) == "w5 w3"
    ids_only = {**work, "path": str(_file(tmp_path, {"prompt_ids": [5]}, name="ids.jsonl"))}
    assert load_workload(ids_only, {**model, "path": None}).eos_ids == frozenset()  # presets: none unless configured


# ------------------------------------------------------------------------------------------------- EOS
class CountingSlots(TokenSlots):
    """Token slots that count reservations (one per step) and note the count at each release."""

    def __init__(self, req_to_token_pool, pages):
        super().__init__(req_to_token_pool, pages)
        self.reserves, self.released_at = 0, []

    def reserve_many(self, spans):
        self.reserves += 1
        return super().reserve_many(spans)

    def release(self, row):
        self.released_at.append(self.reserves)
        super().release(row)


def _eos_ids(outputs: dict[int, list[int]]) -> set[int]:
    """Two ids a run emits: request 3's first token (sampled at its prefill) and one emitted mid-way by request 0
    (absent from the tokens before it)."""
    out0 = outputs[0]
    return {next(t for i, t in enumerate(out0) if i >= 2 and t not in out0[:i]), outputs[3][0]}


@pytest.fixture(scope="module")
def no_eos(tmp_path_factory):
    """REQUESTS as a file, and their outputs without EOS ids (float64)."""
    path = _file(tmp_path_factory.mktemp("eos"), *REQUESTS)
    return path, _run(path, *F64)[1].outputs


@pytest.mark.parametrize("lag,pool", [(False, ()), (True, ()), (True, ("kv.page_size=4", "kv.num_pages=16"))])
def test_eos_cuts_the_output_right_after_it_and_frees_the_request(lag, pool, no_eos, monkeypatch):
    """With ``pool`` the KV pool is small: a request is retracted (its pending outputs resolved first)."""
    path, full = no_eos
    eos = _eos_ids(full)
    if lag:
        _lagging(monkeypatch)
    container = containers.Container()
    container.token_slots.override(providers.Singleton(
        CountingSlots, container.req_to_token_pool, container.page_allocator))
    rt = containers.build(compose_config("device=cpu", "workload=prompts", f"workload.path={path}", *F64,
                                         f"workload.eos_token_ids=[{','.join(map(str, sorted(eos)))}]", *pool,
                                         # a lagging GPU only matters with overlap: without it every step is
                                         # read back before the next is scheduled
                                         f"engine.overlap={'on' if lag else 'off'}"),
                          container=container)
    res = rt.engine.run()
    assert (res.retracted > 0) == bool(pool)
    want = {rid: _cut(toks, eos) for rid, toks in full.items()}
    assert res.outputs == want
    assert len(want[0]) < REQUESTS[0]["max_new_tokens"] and want[3] == full[3][:1]  # stopped at its prefill token
    assert res.finish_reasons == {rid: "stop" if toks[-1] in eos else "length" for rid, toks in want.items()}
    assert res.finished == 4 and res.lost == 0
    # per request: greedy choices, margins and hidden states stop where the output stops
    assert all(len(res.argmax[rid]) == len(res.margins[rid]) == res.hidden[rid].shape[0] == len(want[rid])
               for rid in want)
    pages = rt.container.page_allocator()
    assert pages.available == pages.capacity
    assert rt.container.req_to_token_pool().available == rt.config["kv"]["max_requests"]
    decoded = sum(s.tokens for s in res.steps if s.phase == "decode")
    released_at = sorted(container.token_slots().released_at)
    if lag:  # steps enqueued before the host saw an EOS generated more; none of it is reported
        assert pool or decoded > sum(len(t) - 1 for t in want.values())  # (a retracted request re-prefills)
        return
    # a stopped request takes part in no later step: the one prefill samples every request's token 0, decode
    # step i its token i, and a request is released right after the step that sampled its last token
    assert decoded == sum(len(t) - 1 for t in want.values())
    assert released_at == sorted(len(t) for t in want.values())
    # the parity check replays the stopped outputs on the reference
    ref = containers.build(reference_config(rt.config)).engine.run(forced=res.outputs)
    assert {rid: len(t) for rid, t in ref.outputs.items()} == {rid: len(t) for rid, t in want.items()}
    assert compare(res, ref, "float64").ok


def test_eos_under_speculation_equals_plain_greedy_with_eos(tmp_path, monkeypatch):
    """Speculative rounds cut accepted tokens past an EOS. The host lags behind (as on a GPU), so a request
    whose prefill token is an EOS is found stopped only after a round for it was launched."""
    path = _file(tmp_path, *REQUESTS)
    full = _run(path, *F64, "model.num_layers=4")[1].outputs  # the target of cpu_speculative, plain greedy
    eos = _eos_ids(full)
    _lagging(monkeypatch)
    rt = containers.build(compose_config("+deploy=cpu_speculative", "workload=prompts", f"workload.path={path}",
                                         "speculative.baseline=false", *F64,
                                         f"workload.eos_token_ids=[{','.join(map(str, sorted(eos)))}]"))
    res = rt.engine.run()
    assert res.outputs == {rid: _cut(t, eos) for rid, t in full.items()}
    assert res.finish_reasons[3] == "stop" and res.lost == 0 and res.finished == 4
    st = rt.container.speculative().stats
    assert st.rounds > 0 and sum(st.accept_hist) == st.request_rounds
    pages = rt.container.page_allocator()
    assert pages.available == pages.capacity


# ------------------------------------------------------------------------------------------- bad input
def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config("device=cpu", *overrides))
    return str(e.value)


BAD_LINES = [
    ('{"prompt_ids": [1, 2], "max_new_tokens": 4}\n{"prompt_ids": [1, 2,\n', ["line 2", "not JSON", "column"]),
    ('[1, 2, 3]\n', ["line 1", "a JSON list", "JSON object"]),
    ('{"prompt_ids": [1], "temprature": 0.7}\n', ["line 1", "unknown key", "temprature", "max_new_tokens"]),
    ('{"prompt_ids": [1], "prompt": "hi"}\n', ["both 'prompt' and 'prompt_ids'", "exactly one"]),
    ('{"max_new_tokens": 3}\n', ["neither 'prompt' nor 'prompt_ids'"]),
    ('{"prompt": "hello there"}\n', ["line 1 prompt", "no tokenizer", "workload.tokenizer", "prompt_ids"]),
    ('{"prompt_ids": [0, 511, 512, -1]}\n', ["2 id(s) of prompt_ids outside the vocabulary", "[512, -1]", "[0, 512)"]),
    ('{"prompt_ids": [1, "2"]}\n', ["a list of integer token ids"]),
    ('{"prompt_ids": []}\n', ["empty prompt"]),
    ('{"prompt_ids": [1], "max_new_tokens": 0}\n', ["max_new_tokens", "an integer >= 1"]),
    ('{"prompt_ids": [1], "max_new_tokens": "8"}\n', ["max_new_tokens", "'8'"]),
    ('{"prompt_ids": [1], "max_new_tokens": true}\n', ["max_new_tokens", "true"]),
    ('{"prompt_ids": ' + json.dumps([1] * 1000) + ', "max_new_tokens": 100}\n',
     ["prompt 1000 + max_new_tokens 100 = 1100 tokens", "model.max_context (1024)",
      "lower max_new_tokens on this line to 24 or less"]),
    ('{"prompt_ids": ' + json.dumps([1] * 1030) + ', "max_new_tokens": 1}\n', ["shorten the prompt to at most 1023"]),
    ('', ["has no requests (empty file)"]),
    ('\n  \n', ["has no requests (empty file)"]),
]


@pytest.mark.parametrize("text,fragments", BAD_LINES)
def test_each_bad_line_is_refused_with_its_line_and_a_fix(text, fragments, tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(text)
    msg = _refused("workload=prompts", f"workload.path={path}")
    for f in fragments:
        assert f in msg, (f, msg)
    assert "Fix:" in msg


@pytest.mark.parametrize("overrides,fragments", [
    (["workload=prompts"], ["workload.path: got null", "workload.path=requests.jsonl"]),
    (["workload=prompts", "workload.path=/nonexistent/r.jsonl"], ["/nonexistent/r.jsonl", "no such file"]),
    (["workload=prompts", "workload.path=/tmp"], ["a directory"]),
    (["workload.path=/tmp/r.jsonl"], ["a prompt file only with workload=prompts"]),
    (["workload.tokenizer=/nonexistent/tok"], ["workload.tokenizer", "no such file"]),
    (["workload.eos_token_ids=[3,600]"], ["workload.eos_token_ids", "[600]", "[0, 512)"]),
])
def test_bad_workload_settings_are_refused(overrides, fragments):
    msg = _refused(*overrides)
    for f in fragments:
        assert f in msg, (f, msg)


def test_text_prompts_need_their_tokens_in_range_and_nonempty(tmp_path):
    folder = _tokenizer_folder(tmp_path / "tok", vocab_size=1024)  # ids past the model's 512
    path = _file(tmp_path, {"prompt": "w3 w700"}, {"prompt": ""}, {"prompt": "   "})
    msg = _refused("workload=prompts", f"workload.path={path}", f"workload.tokenizer={folder}")
    assert "line 1 prompt: got 1 id(s) of the tokenizer's ids for 'prompt' outside the vocabulary: [700]" in msg
    assert "line 2 prompt: got an empty prompt" in msg and "line 3 prompt: got an empty prompt" in msg


def test_max_context_counts_the_speculative_look_ahead(tmp_path):
    path = _file(tmp_path, {"prompt_ids": [1] * 1000, "max_new_tokens": 20})
    msg = _refused("+deploy=cpu_speculative", "workload=prompts", f"workload.path={path}")
    assert "prompt 1000 + max_new_tokens 20 + speculative look-ahead 5 = 1025 tokens" in msg
    assert "lower max_new_tokens on this line to 19 or less" in msg


def test_every_bad_line_in_one_message_capped_at_twenty(tmp_path):
    good = {"prompt_ids": [1, 2], "max_new_tokens": 2}
    lines = [good, "not json", {"prompt_ids": []}, good, {"prompt": 3}]
    msg = _refused("workload=prompts", f"workload.path={_file(tmp_path, *lines)}")
    assert "(3 problems)" in msg and "line 2" in msg and "line 3" in msg and "line 5" in msg
    assert "line 1" not in msg and "line 4" not in msg
    many = _file(tmp_path, *["{oops"] * 30, name="many.jsonl")
    msg = _refused("workload=prompts", f"workload.path={many}")
    assert "(21 problems)" in msg and "line 20:" in msg and "line 21:" not in msg
    assert "10 more problems" in msg and "line 21" in msg  # the rest are counted, the first of them named


def test_bad_file_through_the_cli_exits_2_with_every_line_and_no_traceback(tmp_path):
    path = _file(tmp_path, {"prompt_ids": [1], "max_new_tokens": 0}, "{", {"prompt": "x"})
    p = cli("device=cpu", "workload=prompts", f"workload.path={path}", tmp_path=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    for f in ("line 1 max_new_tokens", "line 2", "not JSON", "line 3 prompt", "no tokenizer"):
        assert f in p.stderr, (f, p.stderr)
    assert not (tmp_path / "run" / "report.json").exists()
