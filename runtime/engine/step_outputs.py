"""Step results read back lazily, so the host plans the next step while the GPU still runs this one.

The engine's schedule depends on token values only through stop (EOS) ids, so a step only *enqueues* its
sampling: the chosen tokens go to the device-side last-token table (the next decode's input) and into a
:class:`PendingStep`. Host copies are resolved when their step's event has completed, when too many are
pending, before a request is retracted, and at the end of the run.

Early stop: when a resolved token is an EOS id, its request's output is cut right after it, the request is
marked ``stopped`` and handed to the engine (:meth:`StepOutputs.take_stopped`), which releases it before the
next step. Steps enqueued before the host saw the EOS may have generated more tokens for it; resolving them
drops those (and their greedy choices, margins and hidden states), so nothing past the EOS is reported.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

PENDING = -1  # placeholder in Request.output until the step that produced it is resolved


class StepClock:
    """Brackets a step: CUDA events on a GPU (timed on the device, no sync), wall clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Start copying ``t`` to the host without waiting (pinned memory); valid once a later mark passed.
        On the CPU, ``t`` itself."""
        if not self.cuda:
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def wait(self, mark) -> None:
        """Block the host until the GPU has passed ``mark`` (no-op on the CPU or for None)."""
        if self.cuda and mark is not None:
            mark.synchronize()

    def seconds(self, start, end) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


@dataclass
class PendingStep:
    """Device results of one step, not yet copied to the host.

    Attributes
    ----------
    reqs : requests that sampled a token this step, with ``slots[i]`` the index of that token in
        ``reqs[i].output``
    tokens, choices : [n] int64 host (pinned; being copied until ``end`` passed): fed tokens; greedy choices
    top2 : [n, 2] float32 host (likewise): logits of the two best tokens
    hidden : [n, hidden] host (likewise) final-normed hidden states, or None when not recorded
    record : the StepRecord whose ``seconds`` is filled in when resolved; start/end: StepClock marks
    logprobs : with a request that asked for logprobs: host (likewise) ([n] logprob of each fed token,
        [n, N] top ids or None, [n, N] top logprobs or None, each row's wanted N or None)
    """

    reqs: list
    slots: list[int]
    tokens: torch.Tensor
    choices: torch.Tensor
    top2: torch.Tensor
    hidden: torch.Tensor
    record: object
    start: object
    end: object
    logprobs: tuple | None = None


class StepOutputs:
    """A FIFO of pending steps; ``resolve`` fills outputs, greedy choices, margins, hidden states, times."""

    def __init__(self, clock: StepClock, record_hidden: bool = True, eos_ids: frozenset[int] = frozenset(),
                 max_pending: int = 32):
        self.clock, self.record_hidden, self.max_pending = clock, record_hidden, max_pending
        self.eos_ids = eos_ids
        self._q: deque[PendingStep] = deque()
        self._stopped: list = []  # requests that resolved an EOS id since the last take_stopped

    def take_stopped(self) -> list:
        """Requests that emitted an EOS id since the last call (each once)."""
        out, self._stopped = self._stopped, []
        return out

    def push(self, step: PendingStep, sink) -> None:
        self._q.append(step)
        while len(self._q) > self.max_pending or (self._q and self._ready(self._q[0])):
            self._resolve_one(sink)

    def resolve_all(self, sink) -> None:
        while self._q:
            self._resolve_one(sink)

    def resolve_older(self, sink, keep: int = 1) -> None:
        """Resolve every pending step but the newest ``keep`` (with overlap, the step in flight), so an EOS is
        learned one step after the step that sampled it."""
        while len(self._q) > keep:
            self._resolve_one(sink)

    def _ready(self, step: PendingStep) -> bool:
        return not self.clock.cuda or step.end.query()

    def _resolve_one(self, sink) -> None:
        s = self._q.popleft()
        s.record.seconds = self.clock.seconds(s.start, s.end)
        s.record.marks = (s.start, s.end)
        if not s.reqs:
            return
        self.clock.wait(s.end)  # the step's copies to the host are done (no stream-wide sync)
        tokens, choices = s.tokens.tolist(), s.choices.tolist()
        margins = (s.top2[:, 0] - s.top2[:, 1]).tolist()
        hidden = s.hidden
        lp = _logprob_rows(s.logprobs)
        for i, (r, slot) in enumerate(zip(s.reqs, s.slots)):
            if slot >= len(r.output):  # generated after the request's EOS, by a step enqueued before it was seen
                continue
            r.output[slot] = tokens[i]
            if lp is not None and lp[i] is not None:
                r.logprobs.append(lp[i])
            if r.stop_rule.hit(tokens[i]) if r.stop_rule is not None else tokens[i] in self.eos_ids:
                r.stopped = True
                del r.output[slot + 1 :]
                self._stopped.append(r)
            sink.argmax[r.rid].append(choices[i])
            sink.margins[r.rid].append(margins[i])
            if hidden is not None:
                sink.hidden_rows[r.rid].append((hidden, i))  # rows are gathered once, after the run


def _logprob_rows(logprobs: tuple | None) -> list | None:
    """Per row: (logprob of the fed token, [(id, logprob), ...] of the top N), or None where not asked for."""
    if logprobs is None:
        return None
    chosen, top_ids, top_lps, wanted = logprobs
    chosen = chosen.tolist()
    ids = top_ids.tolist() if top_ids is not None else None
    lps = top_lps.tolist() if top_lps is not None else None
    return [None if n is None else (chosen[i], list(zip(ids[i][:n], lps[i][:n])) if n and ids is not None else [])
            for i, n in enumerate(wanted)]
