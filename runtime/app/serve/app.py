"""The OpenAI-compatible HTTP API over a :class:`~runtime.engine.live.LiveEngine` (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming as server-sent events in OpenAI's
chunk format, ending with ``data: [DONE]``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Bodies are
checked in full before the engine sees them (runtime/app/serve/protocol.py); a client that disconnects aborts its
request, whose KV pages return at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from runtime.app.serve.chat import ChatTemplate
from runtime.app.serve.metrics import Metrics
from runtime.app.serve.protocol import (
    ApiError,
    Limits,
    Parsed,
    chat_logprobs,
    completion_logprobs,
    parse_chat,
    parse_completion,
    usage,
)
from runtime.engine.live import Event, LiveEngine, QueueFull

RETRY_AFTER_S = 1


@dataclass
class ServeState:
    """What the handlers use: the live engine, the tokenizer (or None), the chat template, limits, metrics."""

    live: LiveEngine
    tokenizer: Any
    chat: ChatTemplate
    limits: Limits
    metrics: Metrics
    model_name: str
    api_key: str | None = None


def create_app(state: ServeState) -> FastAPI:
    """The routes. Handlers read the state from ``request.app.state``, never from a closure: FastAPI keeps every
    endpoint function in a module-level cache, so a closure over ``state`` kept the engine (and its GPU memory)
    alive after the server closed (tests and benches that start servers one after another ran out of memory)."""
    app = FastAPI(title="mla-runtime", docs_url=None, redoc_url=None)
    app.state.serve = state

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        _state(request).metrics.reject(e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.get("/health")
    async def health(request: Request):
        alive = _state(request).live.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        return PlainTextResponse(_state(request).metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        st = _state(request)
        _authorize(request, st)
        return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": 0,
                                            "owned_by": "mla-runtime", "max_model_len": st.limits.max_context,
                                            "vocab_size": st.limits.vocab_size}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        st = _state(request)
        _authorize(request, st)
        body = await _json(request)
        _check_model(body, st)
        parsed = parse_completion(body, st.tokenizer, st.limits)
        return await _serve(request, st, parsed, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        st = _state(request)
        _authorize(request, st)
        body = await _json(request)
        _check_model(body, st)
        parsed = parse_chat(body, st.chat.render, st.tokenizer, st.limits)
        return await _serve(request, st, parsed, chat=True)

    return app


def _state(request: Request) -> ServeState:
    return request.app.state.serve


def _authorize(request: Request, state: ServeState) -> None:
    """With ``serve.api_key``, every /v1 request carries ``Authorization: Bearer KEY``."""
    if state.api_key and request.headers.get("authorization", "") != f"Bearer {state.api_key}":
        raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY' with the server's "
                       "serve.api_key", None, "invalid_api_key", kind="authentication_error")


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except ValueError as e:
        raise ApiError(400, f"body: got not JSON ({e}); expected one JSON object. Fix: send valid JSON", "body") from e


def _check_model(body: Any, state: ServeState) -> None:
    if isinstance(body, dict) and body.get("model") not in (None, state.model_name):
        raise ApiError(404, f"model: got {body['model']!r}; expected {state.model_name!r} (GET /v1/models). "
                       f"Fix: send \"model\": \"{state.model_name}\"", "model", "model_not_found")


def _submit(state: ServeState, parsed: Parsed) -> tuple[Any, asyncio.Queue]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(ev: Event) -> None:  # engine thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, ev)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass

    try:
        handle = state.live.submit(parsed.prompt, parsed.max_tokens, parsed.params, sink)
    except QueueFull as e:
        raise ApiError(503, f"the server is busy: {e} (serve.max_queued_requests). Fix: retry after "
                       f"{RETRY_AFTER_S} s", None, "server_busy", kind="server_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from e
    return handle, queue


async def _serve(request: Request, state: ServeState, parsed: Parsed, chat: bool):
    handle, queue = _submit(state, parsed)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if parsed.stream:
        return StreamingResponse(_stream(state, parsed, handle, queue, rid, created, chat),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    ids, text, logprobs = [], [], []
    done = False
    gone = asyncio.create_task(_disconnected(request))
    try:
        while True:
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():  # the client went away: the finally clause aborts the request
                get.cancel()
                return Response(status_code=499)
            ev = get.result()
            if ev.kind == "error":
                done = True
                raise ApiError(500, ev.message, None, "engine_error", kind="server_error")
            ids += ev.token_ids
            text.append(ev.text)
            logprobs += list(zip(ev.logprobs, ev.token_ids))
            if ev.kind == "done":
                done = True
                return _final(state, parsed, rid, created, chat, ids, "".join(text), logprobs, ev.finish_reason)
    finally:
        gone.cancel()
        if not done:
            state.live.abort(handle)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _final(state, parsed: Parsed, rid, created, chat, ids, text, logprobs, reason) -> dict:
    lp = _logprobs(state, parsed, chat, logprobs)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": lp, "finish_reason": reason}
              if chat else {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason})
    choice["token_ids"] = ids
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": state.model_name, "choices": [choice], "usage": usage(len(parsed.prompt), len(ids))}


def _logprobs(state, parsed: Parsed, chat: bool, entries: list, offset: int = 0) -> dict | None:
    if parsed.logprobs is None:
        return None
    return chat_logprobs(entries, state.tokenizer) if chat else completion_logprobs(entries, state.tokenizer, offset)


async def _stream(state: ServeState, parsed: Parsed, handle, queue: asyncio.Queue, rid: str, created: int, chat: bool):
    """Server-sent events; the generator is closed when the client disconnects, which aborts the request."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    done = False
    sent = offset = 0

    def chunk(delta_text: str, ids: list[int], entries: list, reason: str | None, first: bool = False) -> str:
        lp = _logprobs(state, parsed, chat, entries, offset)
        if chat:
            delta = {"role": "assistant", "content": delta_text} if first else {"content": delta_text}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": delta_text, "logprobs": lp, "finish_reason": reason}
        choice["token_ids"] = ids
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [choice]}
        if reason is not None:
            body["usage"] = usage(len(parsed.prompt), sent)
        return f"data: {json.dumps(body)}\n\n"

    try:
        first = True
        while True:
            ev = await queue.get()
            if ev.kind == "error":
                done = True
                err = ApiError(500, ev.message, None, "engine_error", kind="server_error").body()
                yield f"data: {json.dumps(err)}\n\n"
                break
            sent += len(ev.token_ids)
            reason = ev.finish_reason if ev.kind == "done" else None
            entries = list(zip(ev.logprobs, ev.token_ids))
            if ev.text or ev.token_ids or reason is not None or first:
                yield chunk(ev.text, ev.token_ids, entries, reason, first)
                first = False
            offset += len(ev.text)
            if ev.kind == "done":
                done = True
                if parsed.include_usage:
                    tail = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [],
                            "usage": usage(len(parsed.prompt), sent)}
                    yield f"data: {json.dumps(tail)}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            state.live.abort(handle)
