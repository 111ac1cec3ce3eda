"""OpenAI request bodies in, checked values out; OpenAI error objects and response pieces.

Every problem of a body is collected (what, got, expected, fix) and returned as one 400 error object
``{"error": {"message", "type", "param", "code"}}`` whose message lists them all and whose ``param`` is the first
one's field. Unknown fields are refused (a typo must not silently change what is generated), as are ``n`` > 1
and ``best_of`` > 1 (one choice per request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runtime.core.errors import Problem
from runtime.engine.sampling import SamplingParams, parse_params

SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos")
COMMON = ("model", "max_tokens", "stream", "stream_options", "n", "user", "presence_penalty", "frequency_penalty",
          *SAMPLING)
COMPLETION_FIELDS = frozenset((*COMMON, "prompt", "logprobs", "best_of", "echo"))
CHAT_FIELDS = frozenset((*COMMON, "messages", "logprobs", "top_logprobs", "max_completion_tokens"))
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ApiError(Exception):
    """An HTTP error with an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def refuse(problems: list[Problem], status: int = 400, code: str | None = None) -> ApiError:
    """One error object listing every problem; ``param`` names the first problem's field."""
    message = "; ".join(str(p) for p in problems) if len(problems) == 1 else (
        f"{len(problems)} problems: " + " ".join(f"({i}) {p}" for i, p in enumerate(problems, 1)))
    return ApiError(status, message, problems[0].what.split(" ")[0], code)


@dataclass(frozen=True)
class Limits:
    """What a request must fit: ids in ``[0, vocab_size)``, prompt + max_tokens within ``max_context`` and within
    the KV pool (``pool_tokens``: usable pages x page size)."""

    vocab_size: int
    max_context: int
    pool_tokens: int
    page_size: int


@dataclass
class Parsed:
    """A checked request: prompt ids, the most tokens to generate, sampling, and how to answer."""

    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token (None: no logprobs)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _common(body: dict, allowed: frozenset[str], problems: list[Problem]) -> None:
    add = problems.append
    for key in sorted(set(body) - allowed):
        add(Problem(key, "an unknown field", f"OpenAI fields this server supports: {sorted(allowed)}",
                    f"drop '{key}' or fix its spelling"))
    n = body.get("n")
    if n is not None and n != 1:
        add(Problem("n", repr(n), "1 (one choice per request)", "send n separate requests (with different seeds)"))
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        add(Problem("best_of", repr(best_of), "1 or absent", "drop best_of; sample several requests and rank them"))
    if body.get("echo"):
        add(Problem("echo", "true", "false or absent", "prepend the prompt to the returned text yourself"))
    for key in ("presence_penalty", "frequency_penalty"):
        v = body.get(key)
        if v is not None and v != 0:
            add(Problem(key, repr(v), "0 or absent (penalties are not implemented)", f"drop {key}"))
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        add(Problem("stream", repr(stream), "true or false", '"stream": true'))
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}):
        add(Problem("stream_options", repr(opts), 'an object like {"include_usage": true}', "fix stream_options"))


def _max_tokens(body: dict, key: str, default: int, problems: list[Problem]) -> int:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v) or v < 1:
        problems.append(Problem(key, repr(v), "an integer >= 1", f'"{key}": 64'))
        return default
    return v


def _fits(prompt: list[int], max_tokens: int, field: str, limits: Limits, problems: list[Problem]) -> None:
    total = len(prompt) + max_tokens
    if total > limits.max_context:
        room = limits.max_context - len(prompt)
        fix = f"set {field} to {room} or less" if room >= 1 else f"shorten the prompt to {limits.max_context - 1} tokens"
        problems.append(Problem(field, f"prompt {len(prompt)} + {field} {max_tokens} = {total} tokens",
                                f"<= the model's context ({limits.max_context} tokens)", fix))
    elif total > limits.pool_tokens:
        room = limits.pool_tokens - len(prompt)
        fix = (f"set {field} to {room} or less, or " if room >= 1 else "") + "start the server with more kv.num_pages"
        problems.append(Problem(field, f"prompt {len(prompt)} + {field} {max_tokens} = {total} tokens",
                                f"<= what the KV pool holds for one request ({limits.pool_tokens} tokens)", fix))


def _prompt_ids(v: Any, tokenizer: Any, limits: Limits, problems: list[Problem]) -> list[int]:
    add = problems.append
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # one prompt in a batch of one
    if isinstance(v, str):
        if tokenizer is None:
            add(Problem("prompt", "text, but the server has no tokenizer", "token ids (a list of integers)",
                        "send prompt as token ids, or start the server with a model folder that has a tokenizer.json "
                        "(model.path) or workload.tokenizer=PATH"))
            return []
        ids = tokenizer.encode(v).ids
    elif isinstance(v, list) and all(_is_int(t) for t in v):
        ids = list(v)
    elif isinstance(v, list):
        add(Problem("prompt", f"a list of {len(v)} prompts" if all(isinstance(x, (str, list)) for x in v) else repr(v)[:80],
                    "one prompt: a string or a list of token ids", "send one request per prompt"))
        return []
    else:
        add(Problem("prompt", repr(v)[:80], "a string or a list of token ids", '"prompt": "Hello"'))
        return []
    if not ids:
        add(Problem("prompt", "an empty prompt (no tokens)", "at least one token", "send some prompt text or ids"))
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        add(Problem("prompt", f"{len(bad)} token id(s) outside the vocabulary: {bad[:8]}",
                    f"ids in [0, {limits.vocab_size})", "use the model's tokenizer"))
    return ids


def _params(body: dict, logprobs: int | None, limits: Limits, problems: list[Problem]) -> SamplingParams:
    sub = {k: body[k] for k in SAMPLING if k in body}
    sub["logprobs"] = logprobs
    params, p = parse_params(sub, "", limits.vocab_size)
    problems += p
    return params or SamplingParams()


def _body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise refuse([Problem("body", f"JSON {type(body).__name__}", "a JSON object", "send a JSON object")])
    return body


def parse_completion(body: Any, tokenizer: Any, limits: Limits) -> Parsed:
    """A /v1/completions body, checked; raises ApiError (400) with every problem."""
    body = _body(body)
    problems: list[Problem] = []
    _common(body, COMPLETION_FIELDS, problems)
    prompt = _prompt_ids(body.get("prompt"), tokenizer, limits, problems) if "prompt" in body else []
    if "prompt" not in body:
        problems.append(Problem("prompt", "nothing", "a string or a list of token ids", '"prompt": "Hello"'))
    lp = body.get("logprobs")
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= 20):
        problems.append(Problem("logprobs", repr(lp), "an integer in [0, 20]", '"logprobs": 5'))
        lp = None
    max_tokens = _max_tokens(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, problems)
    params = _params(body, lp, limits, problems)
    if prompt and not problems:
        _fits(prompt, max_tokens, "max_tokens", limits, problems)
    if problems:
        raise refuse(problems)
    return Parsed(prompt, max_tokens, params, bool(body.get("stream")), _usage_opt(body), lp)


def _usage_opt(body: dict) -> bool:
    opts = body.get("stream_options") or {}
    return bool(opts.get("include_usage"))


def parse_chat(body: Any, render, tokenizer: Any, limits: Limits) -> Parsed:
    """A /v1/chat/completions body, checked; ``render(messages)`` is the chat template (it raises ApiError when
    the model has none). Without max_tokens a reply may take the rest of the context (and of the pool)."""
    body = _body(body)
    problems: list[Problem] = []
    _common(body, CHAT_FIELDS, problems)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        problems.append(Problem("messages", repr(messages)[:80], "a non-empty list of {role, content} objects",
                                '"messages": [{"role": "user", "content": "Hi"}]'))
        messages = []
    clean = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):  # content parts: the text ones, joined
            if all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str) for c in content):
                content = "".join(c["text"] for c in content)
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, (str, type(None))):
            problems.append(Problem(f"messages[{i}]", repr(m)[:80], "an object with a string role and text content",
                                    '{"role": "user", "content": "Hi"}'))
            continue
        clean.append({**m, "content": content or ""})
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        problems.append(Problem("logprobs", repr(lp), "true or false", '"logprobs": true, "top_logprobs": 3'))
    if top is not None and (not _is_int(top) or not 0 <= top <= 20 or not lp):
        problems.append(Problem("top_logprobs", repr(top), "an integer in [0, 20], with logprobs true",
                                '"logprobs": true, "top_logprobs": 3'))
    logprobs = (top or 0) if lp is True else None
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, key, 0, problems)
    params = _params(body, logprobs, limits, problems)
    prompt: list[int] = []
    if problems:
        raise refuse(problems)
    if tokenizer is None:
        raise refuse([Problem("messages", "a chat request, but the server has no tokenizer",
                              "a model folder with tokenizer.json and a chat_template",
                              "start the server with model.path (a Hugging Face folder) or workload.tokenizer=FOLDER")])
    prompt = tokenizer.encode(render(clean), add_special_tokens=False).ids
    if not prompt:
        problems.append(Problem("messages", "an empty rendered prompt", "at least one token", "send some content"))
    if max_tokens == 0:  # the rest of the context and of the pool
        max_tokens = max(1, min(limits.max_context, limits.pool_tokens) - len(prompt))
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        problems.append(Problem("messages", f"rendered ids outside the vocabulary: {bad[:8]}",
                                f"ids in [0, {limits.vocab_size})", "use the model's own tokenizer"))
    if prompt and not problems:
        _fits(prompt, max_tokens, key, limits, problems)
    if problems:
        raise refuse(problems)
    return Parsed(prompt, max_tokens, params, bool(body.get("stream")), _usage_opt(body), logprobs)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def token_str(tokenizer: Any, t: int) -> str:
    """How a token is shown in logprobs: the tokenizer's token string, else ``token_id:N``."""
    if tokenizer is None:
        return f"token_id:{t}"
    s = tokenizer.id_to_token(t)
    return s if s is not None else f"token_id:{t}"


def completion_logprobs(entries: list, tokenizer: Any, offset: int = 0) -> dict:
    """OpenAI legacy logprobs: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    tokens, lps, tops, offsets = [], [], [], []
    for (lp, top), t in entries:
        s = token_str(tokenizer, t)
        tokens.append(s)
        lps.append(_finite(lp))
        tops.append({token_str(tokenizer, i): _finite(v) for i, v in top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries: list, tokenizer: Any) -> dict:
    """OpenAI chat logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def one(t: int, lp: float) -> dict:
        s = token_str(tokenizer, t)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode("utf-8"))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for (lp, top), t in entries]}


def _finite(v: float) -> float:
    return v if math.isfinite(v) else -9999.0
