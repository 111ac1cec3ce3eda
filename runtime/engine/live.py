"""The engine as a service: requests arrive while it runs, join the batch at the next step, and stream back.

:class:`LiveEngine` owns one :class:`~runtime.engine.engine.Engine` and drives it from its own thread with the
engine's step-wise interface (``begin`` / ``admit`` / ``step`` / ``abort``): the same scheduler as a batch run,
so chunked prefill, retraction on KV exhaustion and the overlap scheduler behave as they do offline. Other threads
(an HTTP server's event loop) call :meth:`LiveEngine.submit` and :meth:`LiveEngine.abort`; both only queue work
for the engine thread, which applies it before its next step. After every step the engine thread hands each
request's newly resolved tokens (with their text delta and logprobs) to the request's ``sink``, and a final
:class:`Event` when it ends. A finished or aborted request's KV pages and request row return at once.

A step that raises (a bug, a device error) fails the requests in flight with an ``error`` event, returns every
page, and the engine goes on serving new requests.
"""

from __future__ import annotations

import itertools
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.engine.engine import Engine
from runtime.engine.sampling import SamplingParams
from runtime.engine.step_outputs import PENDING
from runtime.engine.stops import StopRule, TextStream
from runtime.engine.workload import Request

KEEP_STEP_RECORDS = 512  # a long-lived engine keeps only its newest step records


class QueueFull(RuntimeError):
    """``max_queued`` requests are already waiting for the engine."""


@dataclass
class Event:
    """What a request's sink receives: ``kind`` "tokens" (new ``token_ids``, their ``text`` delta and
    ``logprobs`` entries), "done" (``finish_reason`` "stop" | "length"; ``text`` holds any text held back until
    now) or "error" (``message``)."""

    kind: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    message: str = ""


class Observer(Protocol):
    """Receives the timings the server's metrics need (called on the engine thread)."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float, n: int) -> None: ...

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int, seconds: float) -> None: ...

    def aborted(self, completion_tokens: int) -> None: ...

    def step(self, phase: str, requests: int, tokens: int) -> None: ...

    def step_time(self, phase: str, seconds: float) -> None: ...


@dataclass
class LiveRequest:
    """A request in the service: the engine's Request, where its events go, and what was sent so far."""

    request: Request
    sink: Callable[[Event], None]
    text: TextStream | None
    arrived: float
    sent: int = 0  # tokens handed to the sink
    sent_text: int = 0  # characters of text handed to the sink
    last_token_at: float | None = None
    aborted: bool = False

    @property
    def completion_tokens(self) -> int:
        return self.sent


class LiveEngine:
    """Serve requests as they arrive on ``engine``, from a thread of its own.

    Parameters
    ----------
    engine : an Engine built for this process (its ``requests`` workload is not used: arrivals are)
    tokenizer : a ``tokenizers.Tokenizer`` for text deltas and stop strings, or None (token ids only)
    eos_ids : the token ids that end a request (unless it sets ``ignore_eos``)
    max_queued : requests waiting for a first step at most; :meth:`submit` raises QueueFull beyond
    observer : receives first-token, inter-token and end-to-end timings (None: none)
    """

    def __init__(self, engine: Engine, tokenizer: Any, eos_ids: frozenset[int], max_queued: int,
                 observer: Observer | None = None):
        self.engine, self.tokenizer, self.eos_ids, self.max_queued = engine, tokenizer, eos_ids, max_queued
        self.observer = observer
        self._rids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._inbox: list[LiveRequest] = []
        self._aborts: list[LiveRequest] = []
        self._live: dict[int, LiveRequest] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._res = None  # the engine's RunResult of this service (Engine.begin)
        self._unflushed = False  # a step ran since the last flush
        self._untimed: deque = deque()  # step records the observer saw whose device time is not resolved yet
        self.steps = 0
        self.errors = 0

    # ------------------------------------------------------------------------------------- any thread
    def start(self) -> None:
        self._res = self.engine.begin([], record_hidden=False)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, prompt: list[int], max_new_tokens: int, params: SamplingParams,
               sink: Callable[[Event], None]) -> LiveRequest:
        """Queue one request (its parameters already checked); raises QueueFull when ``max_queued`` wait."""
        params = params.seeded()
        r = Request(rid=next(self._rids), prompt=list(prompt), max_new_tokens=max_new_tokens, sampling=params)
        r.stop_rule = StopRule(params, self.eos_ids, self.tokenizer)
        text = None
        if self.tokenizer is not None:
            text = r.stop_rule.text if r.stop_rule.text is not None else TextStream(self.tokenizer)
        live = LiveRequest(r, sink, text, time.perf_counter())
        with self._wake:
            if len(self._inbox) + self.engine.load[0] >= self.max_queued:
                raise QueueFull(f"{self.max_queued} requests are waiting")
            self._inbox.append(live)
            self._wake.notify()
        return live

    def abort(self, live: LiveRequest) -> None:
        """Drop a request (its client went away); nothing more is sent to its sink."""
        with self._wake:
            live.aborted = True
            self._aborts.append(live)
            self._wake.notify()

    @property
    def alive(self) -> bool:
        """The engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def queued(self) -> int:
        return len(self._inbox) + self.engine.load[0]

    @property
    def running(self) -> int:
        return self.engine.load[1]

    @property
    def pages(self) -> tuple[int, int]:
        """(free, capacity) KV pages."""
        p = self.engine.slots.pages
        return p.available, p.capacity

    # ------------------------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stop or self._inbox or self._aborts or any(self.engine.load) or self._unflushed):
                    self._wake.wait(0.5)
                if self._stop:
                    return
                arrivals, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            for live in arrivals:
                self._live[live.request.rid] = live
            self.engine.admit([a.request for a in arrivals])
            for live in aborts:  # (one that already ended is no longer live)
                if self._live.pop(live.request.rid, None) is not None:
                    self.engine.abort(live.request)
                    self._forget(live.request)
                    if self.observer is not None:
                        self.observer.aborted(live.sent)
            try:
                if any(self.engine.load):
                    before = len(self._res.steps)
                    self.engine.step()
                    self.steps += 1
                    if self.observer is not None:  # the forwards this step launched (a speculative round: several)
                        for rec in self._res.steps[before:]:
                            self.observer.step(rec.phase, rec.batch_size, rec.tokens)
                            self._untimed.append(rec)
                    self._unflushed = True  # with overlap, the newest step's tokens may still be pending
                    if self._first_pending():  # read it back now: a first token waits for no decode launch
                        self.engine.flush()
                else:
                    self.engine.flush()
                    self._unflushed = False
                self._emit()
            except Exception as e:  # noqa: BLE001  (a failed step must not stop the service)
                self._fail_all(e)

    def _first_pending(self) -> bool:
        """A live request's first token was sampled and is not read back yet, and no prompt waits for a prefill.
        With overlap the engine reads a step back only after launching the next one; after a prefill that would
        add the next decode step's planning and launch to the time to first token, so the loop reads it back at
        once (that launch then follows the prefill's kernels: one decode step's planning not overlapped, once per
        prefill). While prompts wait, the next step is their prefill, whose host work overlapping this one's
        kernels is worth more (eager prefills are launch-bound): the first tokens then go out after it."""
        if self._inbox or self.engine.load[0]:
            return False
        return any(not live.sent and live.request.output for live in self._live.values())

    def _emit(self) -> None:
        """Send every live request its resolved tokens; finish those that are done."""
        now = time.perf_counter()
        while self._untimed and self._untimed[0].marks:  # resolved (its outputs read): its device time is known
            rec = self._untimed.popleft()
            self.observer.step_time(rec.phase, rec.seconds)
        for rid, live in list(self._live.items()):
            r = live.request
            out = r.output
            upto = out.index(PENDING) if PENDING in out else len(out)
            if upto > live.sent:
                self._send_tokens(live, out[live.sent : upto], now)
            if r.done and upto == len(out):
                del self._live[rid]
                self._finish(live, now)
        res = self._res
        if len(res.steps) > 2 * KEEP_STEP_RECORDS:
            del res.steps[:-KEEP_STEP_RECORDS]

    def _send_tokens(self, live: LiveRequest, ids: list[int], now: float) -> None:
        r = live.request
        first = live.sent
        live.sent += len(ids)
        if live.text is not None and live.text is not (r.stop_rule.text if r.stop_rule else None):
            for t in ids:
                live.text.push(t)
        text = ""
        if live.text is not None:
            ready = live.text.ready()
            text, live.sent_text = ready[live.sent_text :], len(ready)
        logprobs = r.logprobs[first : live.sent] if r.sampling is not None and r.sampling.logprobs is not None else []
        if self.observer is not None:
            if live.last_token_at is None:
                self.observer.first_token(now - live.arrived)
            elif len(ids):
                self.observer.inter_token((now - live.last_token_at) / len(ids), len(ids))
        live.last_token_at = now
        live.sink(Event("tokens", list(ids), text, list(logprobs)))

    def _finish(self, live: LiveRequest, now: float) -> None:
        r = live.request
        reason = "stop" if r.stopped else "length"
        tail = ""
        if live.text is not None:
            final = live.text.ready(final=True)
            tail, live.sent_text = final[live.sent_text :], len(final)
        self._forget(r)
        if self.observer is not None:
            self.observer.finished(reason, len(r.prompt), live.sent, now - live.arrived)
        live.sink(Event("done", text=tail, finish_reason=reason))

    def _forget(self, r: Request) -> None:
        """Drop the run result's per-request lists (a long-lived engine would keep them forever)."""
        res = self._res
        for d in (res.argmax, res.margins, res.hidden_rows):
            d.pop(r.rid, None)

    def _fail_all(self, e: Exception) -> None:
        """A step raised: every request in flight gets an error event; the engine starts over, pool empty."""
        self.errors += 1
        message = f"the engine failed a step: {type(e).__name__}: {e}"
        traceback.print_exc()
        now = time.perf_counter()
        for live in list(self._live.values()):
            self.engine.abort(live.request)
            if self.observer is not None:
                self.observer.finished("error", len(live.request.prompt), live.sent, now - live.arrived)
            live.sink(Event("error", message=message))
        self._live.clear()
        self._untimed.clear()  # the failed run's steps are never resolved
        self._res = self.engine.begin([], record_hidden=False)
