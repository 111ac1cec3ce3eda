"""Requests from a JSON-lines prompt file; the tokenizer and stop (EOS) ids of a Hugging Face model folder.

The file (``workload=prompts workload.path=FILE``) holds one JSON object per line (blank lines are skipped)::

    {"prompt_ids": [0, 17, 943], "max_new_tokens": 16}
    {"prompt": "The capital of France is", "max_new_tokens": 8}    # text: needs a tokenizer
    {"prompt_ids": [0, 5]}                                          # max_new_tokens: workload.max_new_tokens
    {"prompt": "Once", "temperature": 0.8, "top_p": 0.9, "seed": 7, "stop": ["."], "logprobs": 2}

A line may carry the sampling parameters of runtime/engine/sampling.py (``temperature`` 0, the default, is greedy).

Text is encoded with the tokenizer ``workload.tokenizer`` (a ``tokenizer.json``, or a folder holding one), else
``model.path/tokenizer.json`` when the model folder has one. Stop ids: ``workload.eos_token_ids`` when set,
else ``eos_token_id`` of the model folder's ``generation_config.json``, else of its ``config.json``, else none.

Every problem of the file is collected (one :class:`Problem` per problem, naming the line) before anything is
served: a bad line refuses the whole file, so no request is silently dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from runtime.core.config import WorkloadKind
from runtime.core.errors import ConfigError, Problem
from runtime.engine.sampling import PARAM_KEYS, parse_params
from runtime.engine.workload import RequestSpec, Workload, synthetic_specs

PROMPT_KEYS = ("prompt", "prompt_ids", "max_new_tokens", *PARAM_KEYS)
TOKENIZER_FILE = "tokenizer.json"
EOS_FILES = ("generation_config.json", "config.json")  # the first that names eos_token_id wins (as in HF)
MAX_LISTED = 20  # problems listed one by one; the rest are counted


@dataclass(frozen=True)
class Limits:
    """What a request must fit: token ids in ``[0, vocab_size)``, and prompt + max_new_tokens + ``lookahead``
    (positions speculative decoding reserves past a request) within ``max_context``."""

    vocab_size: int
    max_context: int
    lookahead: int = 0


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true/false are not token ids


def _short(v: Any, n: int = 60) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def capped(problems: list[Problem], limit: int = MAX_LISTED) -> list[Problem]:
    """The first ``limit`` problems and, when there are more, one that counts the rest."""
    if len(problems) <= limit:
        return problems
    rest = problems[limit:]
    where = list(dict.fromkeys(p.what for p in rest))  # in file order, each once
    named = ", ".join(where[:5]) + (", ..." if len(where) > 5 else "")
    return problems[:limit] + [Problem(f"{len(rest)} more problems", f"not listed ({named})", "a clean file",
                                       "fix the problems above and run again to see the rest")]


# ------------------------------------------------------------------------------------ tokenizer, EOS
def tokenizer_file(work: dict, model: dict) -> tuple[Path | None, list[Problem]]:
    """The tokenizer.json to use: ``workload.tokenizer`` (a file, or a folder holding one), else the model
    folder's when it has one, else None."""
    override = work.get("tokenizer")
    if override:
        p = Path(override)
        p = p / TOKENIZER_FILE if p.is_dir() else p
        if not p.is_file():
            return None, [Problem("workload.tokenizer", f"'{override}' (no such file)",
                                  f"a {TOKENIZER_FILE} file, or a folder holding one",
                                  "fix the path, or drop workload.tokenizer to use model.path's tokenizer")]
        return p, []
    folder = model.get("path")
    if folder and (Path(folder) / TOKENIZER_FILE).is_file():
        return Path(folder) / TOKENIZER_FILE, []
    return None, []


def load_tokenizer(path: Path) -> tuple[Any, list[Problem]]:
    """A ``tokenizers.Tokenizer`` from ``path``, or None and the problem."""
    try:
        return Tokenizer.from_file(str(path)), []
    except Exception as e:  # tokenizers raises a bare Exception for unreadable or malformed files
        return None, [Problem("tokenizer", f"'{path}' cannot be read ({str(e)[:120]})",
                              "a Hugging Face tokenizer.json (tokenizers library format)",
                              "point workload.tokenizer at a valid tokenizer.json")]


def _id_list(v: Any) -> list[int] | None:
    """``v`` as a list of token ids (one int, or a list of ints), or None when it is neither."""
    if _is_int(v):
        return [v]
    if isinstance(v, list) and all(_is_int(t) for t in v):
        return list(v)
    return None


def model_eos_ids(folder: str | None) -> tuple[list[int], list[Problem]]:
    """``eos_token_id`` of the model folder (one id or several): generation_config.json first, then
    config.json. ``[]`` without a folder or an EOS id. (An unreadable config.json is the model loader's to
    report; here it only means no EOS id.)"""
    if not folder:
        return [], []
    for name in EOS_FILES:
        p = Path(folder) / name
        if not p.is_file():
            continue
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            if name == "config.json":
                continue
            return [], [Problem(str(p), f"not readable JSON ({e})", "a JSON object", "fix or remove the file")]
        v = data.get("eos_token_id") if isinstance(data, dict) else None
        if v is None:
            continue
        ids = _id_list(v)
        if ids is None:
            return [], [Problem(f"{p}: eos_token_id", _short(v), "a token id or a list of token ids",
                                "fix the file, or set workload.eos_token_ids=[ID,...]")]
        return ids, []
    return [], []


def stop_ids(work: dict, model: dict) -> tuple[list[int], list[Problem]]:
    """The EOS ids that end a request: ``workload.eos_token_ids`` when set; else the model folder's
    generation_config.json; else ``model.eos_token_id`` when the model config has one (a checkpoint's
    config.json fills it); else the folder's config.json."""
    if work.get("eos_token_ids") is not None:
        ids, problems = list(work["eos_token_ids"]), []
        where = "workload.eos_token_ids"
    else:
        ids, problems = model_eos_ids(model.get("path"))
        if not (model.get("path") and (Path(model["path"]) / EOS_FILES[0]).is_file()) and model.get("eos_token_id"):
            ids = _id_list(model["eos_token_id"]) or []
        where = f"eos_token_id of model '{model.get('name')}'" + (f" ({model['path']})" if model.get("path") else "")
    vocab = model["vocab_size"]
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        problems.append(Problem(where, str(bad), f"ids in [0, {vocab}) (model.vocab_size)",
                                "set workload.eos_token_ids=[ID,...] with ids of the model's vocabulary"))
    return ids, problems


# -------------------------------------------------------------------------------------- the file
def _line_request(obj: Any, where: str, tokenizer, tokenizer_hint: str, limits: Limits,
                  default_max_new: int) -> tuple[RequestSpec | None, list[Problem]]:
    """One parsed line -> its request, or None and every problem of the line."""
    if not isinstance(obj, dict):
        return None, [Problem(where, f"a JSON {type(obj).__name__}: {_short(obj)}",
                              'a JSON object like {"prompt_ids": [1, 2], "max_new_tokens": 8}',
                              "write one object per line")]
    out: list[Problem] = []
    add = out.append
    unknown = sorted(set(obj) - set(PROMPT_KEYS))
    if unknown:
        add(Problem(where, f"unknown key(s) {unknown}", f"only {list(PROMPT_KEYS)}", "drop or rename them"))
    has_text, has_ids = "prompt" in obj, "prompt_ids" in obj
    prompt: list[int] | None = None
    if has_text == has_ids:
        add(Problem(where, "both 'prompt' and 'prompt_ids'" if has_text else "neither 'prompt' nor 'prompt_ids'",
                    "exactly one of them", "keep 'prompt_ids' (token ids) or 'prompt' (text)"))
    elif has_ids:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            add(Problem(f"{where} prompt_ids", _short(ids), "a list of integer token ids", "e.g. [0, 17, 943]"))
        else:
            prompt = ids
    elif not isinstance(obj["prompt"], str):
        add(Problem(f"{where} prompt", _short(obj["prompt"]), "a string", "put the text in quotes, or use prompt_ids"))
    elif tokenizer is None:
        add(Problem(f"{where} prompt", "text, but no tokenizer " + tokenizer_hint,
                    "a tokenizer to encode text: model.path with a tokenizer.json, or workload.tokenizer",
                    "set workload.tokenizer=PATH/tokenizer.json (or model.path), or give prompt_ids"))
    else:
        prompt = tokenizer.encode(obj["prompt"]).ids
    if prompt is not None and not prompt:
        add(Problem(f"{where} prompt", "an empty prompt (no tokens)", "at least one token",
                    "give the request some prompt tokens, or remove the line"))
        prompt = None
    if prompt is not None:
        bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
        if bad:
            src = "prompt_ids" if has_ids else "the tokenizer's ids for 'prompt'"
            add(Problem(f"{where} prompt", f"{len(bad)} id(s) of {src} outside the vocabulary: {_short(bad[:8])}",
                        f"ids in [0, {limits.vocab_size}) (model.vocab_size)",
                        "use the model's tokenizer, or a model whose vocabulary holds these ids"))
            prompt = None
    max_new = obj.get("max_new_tokens", default_max_new)
    if not _is_int(max_new) or max_new < 1:
        add(Problem(f"{where} max_new_tokens", _short(max_new), "an integer >= 1", '"max_new_tokens": 16'))
        max_new = None
    if prompt is not None and max_new is not None:
        total = len(prompt) + max_new + limits.lookahead
        if total > limits.max_context:
            la = f" + speculative look-ahead {limits.lookahead}" if limits.lookahead else ""
            room = limits.max_context - len(prompt) - limits.lookahead
            fix = (f"lower max_new_tokens on this line to {room} or less, or shorten the prompt" if room >= 1 else
                   f"shorten the prompt to at most {limits.max_context - limits.lookahead - 1} tokens")
            add(Problem(where, f"prompt {len(prompt)} + max_new_tokens {max_new}{la} = {total} tokens",
                        f"<= model.max_context ({limits.max_context})", fix))
    sampling, p = parse_params(obj, f"{where} ", limits.vocab_size)
    out += p
    if sampling is not None and sampling.stop and tokenizer is None:
        add(Problem(f"{where} stop", f"{list(sampling.stop)} but no tokenizer " + tokenizer_hint,
                    "a tokenizer to match stop strings on the decoded text",
                    "set workload.tokenizer=PATH/tokenizer.json (or model.path), or use stop_token_ids"))
    if sampling is not None and not sampling.greedy and limits.lookahead:
        add(Problem(f"{where} temperature", f"{sampling.temperature} with speculative decoding",
                    "temperature 0 (speculative rounds accept greedily)",
                    "drop temperature on this line, or set speculative=off"))
    if out:
        return None, out
    has_params = any(obj.get(k) is not None for k in PARAM_KEYS)
    return RequestSpec(tuple(int(t) for t in prompt), int(max_new), sampling if has_params else None), []


def read_prompt_file(path: str | None, tokenizer, tokenizer_hint: str, limits: Limits,
                     default_max_new: int) -> tuple[list[RequestSpec], list[Problem]]:
    """The requests of a prompt file, in line order, and every problem found (all lines are checked).

    ``tokenizer_hint``: says where a tokenizer was looked for, for the message of a text prompt without one."""
    if not path:
        return [], [Problem("workload.path", "null", "a JSON-lines file of requests (workload=prompts)",
                            "workload.path=requests.jsonl")]
    p = Path(path)
    if not p.is_file():
        got = f"'{path}' ({'a directory' if p.is_dir() else 'no such file'})"
        return [], [Problem("workload.path", got, "a JSON-lines file, one request per line", "fix the path")]
    try:
        text = p.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        return [], [Problem("workload.path", f"'{path}' cannot be read as UTF-8 text ({e})",
                            "a UTF-8 JSON-lines file", "fix the file")]
    specs, problems = [], []
    lines = 0
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        lines += 1
        where = f"{path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            problems.append(Problem(where, f"not JSON ({e.msg} at column {e.colno}): {_short(line.strip())}",
                                    "one JSON object per line", "fix the line's JSON (quotes, commas, brackets)"))
            continue
        spec, line_problems = _line_request(obj, where, tokenizer, tokenizer_hint, limits, default_max_new)
        problems += line_problems
        if spec is not None:
            specs.append(spec)
    if lines == 0:
        problems.append(Problem("workload.path", f"'{path}' has no requests (empty file)",
                                "at least one JSON line", 'add lines like {"prompt_ids": [1, 2], "max_new_tokens": 8}'))
    return specs, problems


# ---------------------------------------------------------------------------------- the workload
def _sources(work: dict, model: dict) -> tuple[Any, str, list[int], list[Problem]]:
    """(tokenizer or None, where a tokenizer was looked for, stop ids, problems)."""
    problems: list[Problem] = []
    path, p = tokenizer_file(work, model)
    problems += p
    tokenizer = None
    if path is not None:
        tokenizer, p = load_tokenizer(path)
        problems += p
    hint = (f"(model.path={model.get('path')} has no {TOKENIZER_FILE})" if model.get("path")
            else "(model.path and workload.tokenizer are null)")
    eos, p = stop_ids(work, model)
    return tokenizer, hint, eos, problems + p


def check_workload(work: dict, model: dict, lookahead: int = 0) -> tuple[list[Problem], list[RequestSpec] | None]:
    """Every problem of the workload's sources (prompt file, tokenizer, stop ids), and the prompt file's
    requests (None for a synthetic workload). ``lookahead``: positions speculative decoding reserves past a
    request."""
    tokenizer, hint, _, problems = _sources(work, model)
    kind = WorkloadKind(work.get("kind", WorkloadKind.synthetic))
    if kind == WorkloadKind.synthetic:
        if work.get("path"):
            problems.append(Problem("workload.path", f"'{work['path']}' with workload '{work['name']}' (synthetic)",
                                    "a prompt file only with workload=prompts", "use workload=prompts workload.path=..."))
        return problems, None
    limits = Limits(model["vocab_size"], model["max_context"], lookahead)
    specs, p = read_prompt_file(work.get("path"), tokenizer, hint, limits, work["max_new_tokens"])
    return problems + p, specs


def load_workload(work: dict, model: dict) -> Workload:
    """The requests to serve (synthetic, or the prompt file's), their stop ids and tokenizer.

    Raises
    ------
    ConfigError
        with every problem (startup validation has normally reported them already)."""
    tokenizer, hint, eos, problems = _sources(work, model)
    if WorkloadKind(work.get("kind", WorkloadKind.synthetic)) == WorkloadKind.prompts:
        limits = Limits(model["vocab_size"], model["max_context"])
        specs, p = read_prompt_file(work.get("path"), tokenizer, hint, limits, work["max_new_tokens"])
        problems += p
    else:
        specs = list(synthetic_specs(work, model["vocab_size"]))
    if problems:
        raise ConfigError(capped(problems))
    return Workload(tuple(specs), frozenset(eos), tokenizer)
