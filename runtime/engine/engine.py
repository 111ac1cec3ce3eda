"""The engine loop: continuous batching with chunked prefill, decode, and retraction on KV exhaustion.

Each step the scheduler prefers prefill (new or partly prefilled requests, up to the token budget), and
otherwise decodes every running request. Before a step it counts the pages the step needs; if the pool
cannot hold them it queues new requests, or retracts the most recently started ones (their pages return to
the pool, their generated tokens are kept, and they are prefilled again later). No request is lost.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from backends.base import AttentionBackend, MHAChunkPrefill
from runtime.core.batch import ForwardMode, make_batch
from runtime.core.device import to_device
from runtime.core.errors import PoolExhausted
from runtime.core.kv_pool import TokenSlots
from runtime.core.parallel import CollectiveSample, SingleRank, TPGroup
from runtime.core.prefix_chunks import plan_prefix_chunks
from runtime.engine.graph_runner import GraphRunner
from runtime.engine.oom import OOMGuard
from runtime.engine.progress import Progress
from runtime.engine.sampling import Sampler
from runtime.engine.speculative import SpeculativeDriver
from runtime.engine.step_outputs import PENDING, PendingStep, StepClock, StepOutputs
from runtime.engine.workload import Request, Workload
from runtime.model.dump import AttentionDumper
from runtime.model.mla_model import MLAModel

# graph modes whose forwards run the target model (the one that dumps attention)
TARGET_GRAPH_MODES = ("prefill", "decode", "target_verify")


@dataclass
class StepRecord:
    """One forward (or one speculative round's phase); ``seconds`` (device time between its start and end
    marks) and ``marks`` are filled when the step's outputs are resolved (CUDA events on a GPU,
    perf_counter values on the CPU). ``phase``: prefill | decode, and with speculation draft_prefill |
    draft_bootstrap | draft_decode | target_verify | draft_extend. ``tokens``: tokens the forward
    processed, or for target_verify the tokens the round emitted."""

    mode: ForwardMode
    batch_size: int
    tokens: int
    seconds: float
    marks: tuple = ()
    phase: str = ""
    graphed: bool = False
    collectives: CollectiveSample | None = None  # tensor parallelism: the step's collectives (with sampling)


@dataclass
class RunResult:
    """What one run of the workload produced.

    Attributes
    ----------
    outputs : rid -> generated token ids (the forced ones when the run was forced); a request stopped by an
        EOS id ends with it
    finish_reasons : rid -> "stop" (emitted an EOS id) or "length" (reached its max_new_tokens)
    argmax : rid -> the model's own greedy choice at every generated position
    margins : rid -> top-1 minus top-2 logit at every generated position
    hidden : rid -> [num_generated, hidden] float32 final-normed hidden states that produced each token
    gpu_marks : the steps' marks are CUDA events (the gap between two is GPU time); else host clock values
    """

    outputs: dict[int, list[int]] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    argmax: dict[int, list[int]] = field(default_factory=dict)
    margins: dict[int, list[float]] = field(default_factory=dict)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    hidden_rows: dict[int, list[tuple[torch.Tensor, int]]] = field(default_factory=dict)  # (step rows, row)
    # speculative runs: each generated token's source (prefill | accepted | bonus | correction), up to the last
    # round's tokens (runtime/app/spec_compare.py)
    sources: dict[int, list[str]] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    prompt_tokens: int = 0
    finished: int = 0
    retracted: int = 0
    queued_for_memory: int = 0
    lost: int = 0
    gpu_marks: bool = False
    oom_events: list = field(default_factory=list)  # steps that ran out of device memory (runtime/engine/oom.py)


class StalledError(RuntimeError):
    """No step can run: the pool cannot hold even the oldest running request's next step."""


class Engine:
    """Runs the `workload` config over the injected model.

    Parameters
    ----------
    model : MLAModel
    backend : AttentionBackend
    mha_prefill : MHAChunkPrefill or None
        Planned before an EXTEND step when the model takes the MHA chunked-prefix path.
    graphs : GraphRunner
        Replays captured graphs (per mode) for the batch sizes it holds; other steps run eagerly.
    token_slots : TokenSlots
    request_states : list
        Per-request state pools indexed by request row (``reset(rows)``), e.g. linear-attention states;
        each admitted request's row is reset.
    workload : dict
        The resolved `workload` config (scheduler limits).
    requests : Workload
        The requests to serve and the EOS ids that stop them early.
    device : torch.device
    spec : SpeculativeDriver or None
        Speculative decoding: decode steps become rounds of draft, verify and draft extend.
    overlap : bool
        ``engine.overlap`` resolved: schedule, plan and launch step N+1 before reading step N's results back
        (see :meth:`run`); off: read every step back before scheduling the next.
    dumper : AttentionDumper or None
        The target model's dumper: a graphed step whose mode it still wants to dump runs eagerly, so the
        dump holds that step's values (a replay would not run the dump's Python code).
    group : SingleRank or TPGroup
        The tensor-parallel group; each step record takes the collectives it issued (or replayed).
    oom : OOMGuard or None
        A step raising ``torch.OutOfMemoryError`` is reported through it and its requests retracted; None: raised.
    sampler : Sampler or None
        Draws the tokens of requests that sample (``Request.sampling``); None: one for ``device``. Greedy
        requests take the top-1 choice without it.

    Tensor parallelism: every rank runs this same loop on the same workload and schedules the same steps (the
    schedule is a function of the config, the workload and the sampled tokens, and the tokens are the same on
    every rank because the greedy choice is taken on the all-gathered top 2 of each rank's vocabulary slice, or
    sampled from the all-gathered logits); nothing is broadcast per step.
    """

    def __init__(
        self,
        model: MLAModel,
        backend: AttentionBackend,
        mha_prefill: MHAChunkPrefill | None,
        graphs: GraphRunner,
        token_slots: TokenSlots,
        request_states: list,
        workload: dict,
        requests: Workload,
        device: torch.device,
        spec: SpeculativeDriver | None = None,
        overlap: bool = False,
        dumper: AttentionDumper | None = None,
        group: SingleRank | TPGroup | None = None,
        sampler: Sampler | None = None,
        oom: OOMGuard | None = None,
    ):
        self.model, self.backend, self.mha_prefill, self.graphs = model, backend, mha_prefill, graphs
        self.slots, self.workload, self.requests, self.device = token_slots, dict(workload), requests, device
        self.oom = oom  # an out-of-memory step halves this engine's copy of the scheduler limits
        self.request_states = request_states
        self.spec = spec
        self._lookahead = spec.lookahead if spec is not None else 0
        self.clock = StepClock(device)
        self.overlap, self.dumper = overlap, dumper
        self.group = group if group is not None else SingleRank(device)
        self._fence = None  # event after the previous step's metadata copies (see _forward)
        self.sampler = sampler if sampler is not None else Sampler(device)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admitted, in admission order

    # -------------------------------------------------------------------------------------------- run
    def run(self, forced: dict[int, list[int]] | None = None, progress: bool = False,
            record_hidden: bool = True) -> RunResult:
        """Run every request to completion. ``forced`` (rid -> tokens) feeds those tokens instead of the
        greedy choice (the parity check replays the candidate's tokens), recording the greedy choice too; a
        request then generates exactly its forced tokens.
        ``record_hidden``: keep each generated token's final hidden state (the parity check compares them;
        a benchmark turns it off so no step copies [B, hidden] to the host).

        No step waits for the previous one: decode inputs come from the device-side last-token table and
        results are copied back lazily (runtime/engine/step_outputs.py). A request whose resolved token is an
        EOS id is released as soon as the host sees that token; what steps already enqueued generated for it
        past the EOS is dropped.

        Overlap (``engine.overlap``): the host schedules, plans and launches step N+1 while the GPU runs step
        N. What the scheduler knows about step N then: its lengths (every request grew by its new tokens),
        its slots, and that its tokens sit in the device last-token table (step N+1's input ids are gathered
        there on the device); not the token values. Before scheduling, every step but the newest is read
        back (the metadata fence has already waited for those), so an EOS sampled at step N is seen when
        step N+2 is scheduled: the request also ran in step N+1, whose token is dropped, and is released
        then. Without overlap every step is read back before the next is scheduled (the host waits for the
        GPU each step) and nothing runs extra; the emitted tokens are the same."""
        requests = self.requests.requests()
        if forced is not None:
            for r in requests:
                r.max_new_tokens = len(forced[r.rid])
        self.begin(requests, forced, record_hidden)
        with Progress(sum(r.max_new_tokens for r in requests), enabled=progress) as bar:
            while self.step(bar):
                pass
        return self.end(requests)

    # ------------------------------------------------------------------------------------ step-wise
    def begin(self, requests: list[Request], forced: dict[int, list[int]] | None = None,
              record_hidden: bool = True) -> RunResult:
        """Start a run with ``requests`` waiting in order; :meth:`step` advances it, :meth:`admit` adds requests
        (a server's arrivals), :meth:`abort` drops one. Returns the RunResult the steps fill."""
        if forced is not None and self.spec is not None:
            raise ValueError("Engine.run(forced=...) replays given tokens through plain greedy decoding; this engine "
                             "speculates. Fix: build the replay engine with speculative.enabled=false.")
        self._res = RunResult(gpu_marks=self.clock.cuda)
        self._waiting, self._running, self._forced = deque(), [], forced
        self._outputs = StepOutputs(self.clock, record_hidden, self.requests.eos_ids)
        self._timed: list[tuple[StepRecord, object, object]] = []  # speculative phases awaiting their times
        self.admit(requests)
        self.graphs.capture()
        self.group.stats.take()  # graph warm-ups are no step's
        return self._res

    def admit(self, requests: list[Request]) -> None:
        """Queue ``requests`` (after those waiting); they join a batch at a coming step."""
        res = self._res
        for r in requests:
            res.prompt_tokens += len(r.prompt)
            res.argmax[r.rid], res.margins[r.rid], res.hidden_rows[r.rid] = [], [], []
            self._waiting.append(r)

    def abort(self, r: Request) -> None:
        """Drop ``r``: out of the queue, or its KV pages and request row returned now; it ends as stopped.
        Results of steps already enqueued for it are dropped when they resolve."""
        if r in self._waiting:
            self._waiting.remove(r)
        elif r.row is not None:
            self.slots.release(r.row)
            self._running.remove(r)
            r.row = None
        r.stopped = True

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running) requests."""
        return len(self._waiting), len(self._running)

    def step(self, bar: Progress | None = None) -> bool:
        """One scheduler iteration: a prefill or decode step (or a speculative round). False when no request
        was waiting or running (nothing ran)."""
        waiting, running, res, forced = self._waiting, self._running, self._res, self._forced
        bar = bar if bar is not None else Progress(0, enabled=False)
        if self.overlap:  # an EOS is learned one step late, never later
            self._outputs.resolve_older(res, keep=1)
            self._release_stopped(running, res)
        if not (waiting or running):
            return False
        step = self._prefill_step(waiting, running, res)
        if step is None and self.spec is not None:
            decoding, locs = self._reserve_decoding(waiting, running, res, self.spec.round_span)
            if decoding:
                try:
                    self._spec_round(decoding, locs, running, res, bar)
                except torch.OutOfMemoryError as e:
                    return self._out_of_memory(e, decoding, None)
                return True
            step = self._unblock(waiting, running, res)
        elif step is None:
            step = self._decode_step(waiting, running, res)
        if step is None:
            raise StalledError(self._stall_message(waiting, running))
        reqs, batch, ids, sample_rows, req_rows = step
        phase = "prefill" if batch.mode == ForwardMode.EXTEND else "decode"
        record = StepRecord(batch.mode, batch.batch_size, batch.num_tokens, 0.0, phase=phase)
        res.steps.append(record)
        start = self.clock.mark()
        try:
            h, record.graphed = self._forward(ids, batch)
            sel = h if sample_rows is None else h[sample_rows]
            pending = self._sample(reqs, req_rows, sel, forced, record, start)
        except torch.OutOfMemoryError as e:  # a corner the memory plan missed: retract the step, back off
            res.steps.pop()
            return self._out_of_memory(e, [r for r in running if r.row in batch.req_pool_indices_cpu.tolist()], batch)
        record.collectives = self.group.stats.take()
        if self.spec is not None and batch.mode == ForwardMode.EXTEND:
            starting = [r for r in reqs if len(r.output) + 1 < r.max_new_tokens]
            self.spec.after_prefill(ids, batch, [r.row for r in starting], [r.cached for r in starting],
                                    self.slots.req_to_token_pool.last_token, self._spec_forward)
        self._finish_step(reqs, running, res)
        self._outputs.push(pending, res)
        if not self.overlap:
            self._outputs.resolve_all(res)
        self._release_stopped(running, res)
        bar.advance(len(reqs))
        return True

    def flush(self) -> None:
        """Resolve every pending step (outputs complete; stopped requests released)."""
        self._outputs.resolve_all(self._res)
        self._release_stopped(self._running, self._res)

    def end(self, requests: list[Request]) -> RunResult:
        """Resolve what is pending and finish the RunResult of ``requests`` (outputs, reasons, hidden states)."""
        res = self._res
        self.flush()
        self._resolve_times(wait=True)
        hidden_dim = self.model.spec.hidden_size
        res.hidden = {rid: (torch.stack([t[i] for t, i in v]) if v else torch.empty(0, hidden_dim))
                      for rid, v in res.hidden_rows.items()}
        res.hidden_rows = {}
        res.outputs = {r.rid: list(r.output) for r in requests}
        res.finish_reasons = {r.rid: "stop" if r.stopped else "length" for r in requests}
        res.lost = sum(1 for r in requests if not r.done)
        return res

    def _sample(self, reqs: list[Request], req_rows: torch.Tensor, sel: torch.Tensor, forced, record,
                start) -> PendingStep:
        """Greedy choice for each sampling request (``sel`` [n, hidden], ``req_rows`` [n] their request rows
        on the device); the fed token goes to the last-token table on the device."""
        sampling = forced is None and self.sampler.needed([r.sampling for r in reqs])  # else greedy: no full logits
        logits = self.model.logits(sel) if sampling else None
        top2 = torch.topk(logits, 2, dim=-1) if sampling else torch.return_types.topk(self.model.top2(sel))
        choices = top2.indices[:, 0]
        tokens, drawn = choices, None
        if forced is not None:
            tokens = torch.tensor([forced[r.rid][len(r.output)] for r in reqs], dtype=torch.int64)
            tokens = to_device(tokens, self.device)
        elif sampling:  # sampled tokens, logprobs (sampling.py)
            drawn = self.sampler.sample(logits, [r.sampling for r in reqs], [len(r.output) for r in reqs], choices)
            tokens = drawn.tokens
        if reqs:
            self.slots.req_to_token_pool.last_token[req_rows] = tokens
        slots = [len(r.output) for r in reqs]
        host = self.clock.to_host
        hidden = host(sel.float()) if self._outputs.record_hidden else None
        choices_host = host(choices)  # unforced: the fed tokens are the choices (one copy serves both)
        tokens_host = choices_host if tokens is choices else host(tokens)
        logprobs = None
        if drawn is not None and drawn.logprob is not None:
            top = (None, None) if drawn.top_ids is None else (host(drawn.top_ids), host(drawn.top_logprobs))
            logprobs = (host(drawn.logprob), *top, drawn.wanted)
        return PendingStep(reqs, slots, tokens_host, choices_host, host(top2.values.float()), hidden, record,
                           start, self.clock.mark(), logprobs)

    def _forward(self, ids: torch.Tensor, batch) -> tuple[torch.Tensor, bool]:
        """A prefill or plain decode step of the target model (the MHA chunked-prefix plan for EXTEND);
        returns (hidden states, whether a graph replayed it)."""
        mode = "prefill" if batch.mode == ForwardMode.EXTEND else "decode"
        return self._launch(mode, self.model.forward, self.backend, ids, batch, self.mha_prefill)

    def _launch(self, mode: str, fn, planner, ids: torch.Tensor, batch,
                mha_prefill: MHAChunkPrefill | None = None) -> tuple[torch.Tensor, bool]:
        """Plan one forward's metadata, then launch it: the graph of ``mode`` when one is captured for the
        batch, else ``planner.init_forward_metadata(batch)`` and ``fn(ids, batch)``. Returns (output, graphed).

        The metadata fence: planning may stage data in host buffers that an earlier plan's asynchronous
        copy still reads (FlashInfer copies its plan through one pinned buffer). So before planning step
        N+1 the host waits for the event recorded right after step N's metadata copies, that is, until the
        GPU has *started* step N: planning N+1 still overlaps step N's kernels, and the host never runs more
        than one step ahead."""
        self.clock.wait(self._fence)
        graphs = self.graphs.get(mode)
        graphed = graphs is not None and graphs.can_run(batch) and not self._dump_wants(mode, batch)
        if graphed:
            graphs.prepare(ids, batch)  # copies inputs, the backend's hook refreshes static metadata
        else:
            planner.init_forward_metadata(batch)
            if batch.mode == ForwardMode.EXTEND and mha_prefill is not None:
                batch.prefix_chunks = plan_prefix_chunks(
                    batch, self.slots.req_to_token_pool, self.workload["mha_prefix_chunk_tokens"]
                )
                mha_prefill.init_mha_chunk_metadata(batch)
        self._fence = self.clock.mark()
        return (graphs.replay() if graphed else fn(ids, batch)), graphed

    def _dump_wants(self, mode: str, batch) -> bool:
        """The target model's dumper still wants this batch's mode: run it eagerly (dumps run Python code
        that a replay skips; graph capture never dumps, see GraphRunner)."""
        return self.dumper is not None and mode in TARGET_GRAPH_MODES and self.dumper.wants(batch.mode.value)

    # ------------------------------------------------------------------------------ speculative
    def _spec_forward(self, phase: str, fn, planner, ids: torch.Tensor, batch) -> torch.Tensor:
        """One forward of a speculative phase (graph mode ``phase``), timed as its own StepRecord."""
        record = StepRecord(batch.mode, batch.batch_size, batch.num_tokens, 0.0, phase=phase)
        self._res.steps.append(record)
        start = self.clock.mark()
        out, record.graphed = self._launch(phase, fn, planner, ids, batch)
        record.collectives = self.group.stats.take()
        self._timed.append((record, start, self.clock.mark()))
        return out

    def _spec_round(self, decoding: list[Request], locs: list[int], running: list[Request], res: RunResult,
                    bar) -> None:
        """One speculative round; the host waits for the verify results (the next round's lengths depend on
        them) while the draft extend runs. A request whose prefill token turns out to be an EOS id (resolved
        here, after the round was launched) is released and gets nothing of the round; one whose round
        emits an EOS id keeps the tokens up to it."""
        rows, lens = [r.row for r in decoding], [r.cached for r in decoding]
        host, verified = self.spec.round(rows, lens, locs, self.slots.req_to_token_pool.last_token,
                                         self._spec_forward, self._outputs.record_hidden, self.clock)
        self._outputs.resolve_all(res)  # earlier (prefill) tokens first: outputs stay in order
        self._release_stopped(running, res)
        self.clock.wait(verified)
        rr = self.spec.resolve(host, [0 if r.stopped else r.max_new_tokens - len(r.output) for r in decoding],
                               self.requests.eos_ids)
        verify = next(s for s in reversed(res.steps) if s.phase == "target_verify")
        verify.tokens = sum(len(t) for t in rr.tokens)  # a round's decode tokens are the ones it emitted
        for r, toks, margins, i in zip(decoding, rr.tokens, rr.margins, range(len(decoding))):
            if r.stopped:  # released above
                continue
            r.stopped = rr.stopped[i]
            r.output.extend(toks)
            src = res.sources.setdefault(r.rid, [])  # tokens resolved since the last round came from prefill steps
            src += ["prefill"] * (len(res.argmax[r.rid]) - len(src)) + rr.sources[i]
            res.argmax[r.rid].extend(toks)
            res.margins[r.rid].extend(margins)
            if rr.hidden is not None:
                res.hidden_rows[r.rid].extend((rr.hidden[i], j) for j in range(len(toks)))
            r.cached += len(toks)  # the target's KV now covers L + n + 1 positions
            if r.done:
                self.slots.release(r.row)
                running.remove(r)
                r.row = None
                res.finished += 1
            else:
                self.slots.truncate(r.row, r.cached + 1)  # the draft's KV covers one more (t_L')
        bar.advance(sum(len(t) for t in rr.tokens))
        self._resolve_times(wait=False)

    def _resolve_times(self, wait: bool) -> None:
        """Fill the seconds of speculative phases whose end mark passed (all of them when ``wait``)."""
        keep = []
        for record, start, end in self._timed:
            if wait or not self.clock.cuda or end.query():
                record.seconds, record.marks = self.clock.seconds(start, end), (start, end)
            else:
                keep.append((record, start, end))
        self._timed = keep

    # --------------------------------------------------------------------------------- scheduling
    def _prefill_step(self, waiting: deque[Request], running: list[Request], res: RunResult):
        """Chunks of prefill for partly prefilled requests, then new ones, within the token budget."""
        budget = self.workload["max_tokens_per_batch"]
        chosen: list[tuple[Request, int]] = []
        pages_free = self.slots.pages.available
        blocked = False  # a partly prefilled request cannot grow: admit nobody new
        for r in [r for r in running if not r.decoding]:
            n = min(len(r.tokens) - r.cached, self.workload["chunked_prefill_size"], budget)
            need = self.slots.pages_needed(r.row, r.cached + n + self._tail(r, n))
            if n <= 0 or need > pages_free:
                blocked = True
                break
            chosen.append((r, n))
            budget, pages_free = budget - n, pages_free - need
        while not blocked and waiting and budget > 0 and len(running) < self.workload["max_running_requests"]:
            r = waiting[0]
            n = min(len(r.tokens), self.workload["chunked_prefill_size"], budget)
            need = -(-(n + self._tail(r, n)) // self.slots.page_size)
            if need > pages_free or self.slots.req_to_token_pool.available == 0:
                res.queued_for_memory += 1
                break
            waiting.popleft()
            r.row, r.cached, r.decoding = self.slots.open(), 0, False
            for states in self.request_states:
                states.reset([r.row])
            running.append(r)
            chosen.append((r, n))
            budget, pages_free = budget - n, pages_free - need
        if not chosen:
            return None
        reqs = [r for r, _ in chosen]
        tails = [self._tail(r, n) for r, n in chosen]
        locs = self.slots.reserve_many([(r.row, r.cached, r.cached + n + t) for (r, n), t in zip(chosen, tails)])
        if any(tails):  # drop the look-ahead slots: this step writes only the chunk's tokens
            spans = [n + t for (_, n), t in zip(chosen, tails)]
            starts = [0, *itertools.accumulate(spans)]
            locs = [x for (_, n), s0 in zip(chosen, starts) for x in locs[s0 : s0 + n]]
        # a request that prefills has no pending output (a retraction resolves them first)
        ids = torch.tensor([t for r, n in chosen for t in r.tokens[r.cached : r.cached + n]],
                           dtype=torch.int64)
        batch = make_batch(
            ForwardMode.EXTEND, [r.row for r in reqs], [r.cached for r in reqs], [n for _, n in chosen], locs,
            self.device,
        )
        for r, n in chosen:
            r.cached += n
        # sample only for requests whose whole sequence is now cached: their last new token's row of h
        done = [(int(batch.qo_indptr_cpu[i + 1]) - 1, r) for i, r in enumerate(reqs) if r.cached == len(r.tokens)]
        rows = torch.tensor([[row for row, _ in done], [r.row for _, r in done]], dtype=torch.int64)
        sample_rows, req_rows = to_device(rows, self.device)
        return [r for _, r in done], batch, to_device(ids, self.device), sample_rows, req_rows

    def _tail(self, r: Request, n: int) -> int:
        """Look-ahead slots a prefill chunk of ``n`` tokens reserves: with speculation, a request whose
        chunk completes its sequence also needs the slot of the token it samples (the draft sees it).
        (A waiting request has ``cached == 0``.)"""
        return self._lookahead if r.cached + n == len(r.tokens) else 0

    def _reserve_decoding(self, waiting: deque[Request], running: list[Request], res: RunResult,
                          span) -> tuple[list[Request], list[int] | None]:
        """Reserve ``span(row, cached)`` for every decoding request, retracting the most recently started
        requests while the pool cannot hold them; ([], None) when no decoding request is left (or the only
        running request cannot grow)."""
        decoding = [r for r in running if r.decoding]
        while decoding:
            try:  # reserve_many checks everything first: on exhaustion nothing was taken
                return decoding, self.slots.reserve_many([span(r.row, r.cached) for r in decoding])
            except PoolExhausted:
                if len(running) == 1:
                    return [], None
                self._retract(running[-1], waiting, running, res)
                decoding = [r for r in running if r.decoding]
        return [], None

    def _unblock(self, waiting: deque[Request], running: list[Request], res: RunResult):
        """No request can decode: partly prefilled requests hold pages none can grow; free one, prefill."""
        prefilling = [r for r in running if not r.decoding]
        if prefilling and len(running) > 1:
            self._retract(running[-1], waiting, running, res)
            return self._prefill_step(waiting, running, res)
        return None

    def _decode_step(self, waiting: deque[Request], running: list[Request], res: RunResult):
        decoding, locs = self._reserve_decoding(waiting, running, res, lambda row, n: (row, n, n + 1))
        if not decoding:
            return self._unblock(waiting, running, res)
        batch = make_batch(
            ForwardMode.DECODE, [r.row for r in decoding], [r.cached for r in decoding], [1] * len(decoding),
            locs, self.device,
        )
        for r in decoding:
            r.cached += 1
        ids = self.slots.req_to_token_pool.last_token[batch.req_pool_indices]  # on the device: no host copy
        return decoding, batch, ids, None, batch.req_pool_indices  # every request samples: all rows of h

    def _retract(self, r: Request, waiting: deque[Request], running: list[Request], res: RunResult) -> None:
        """Return every page of ``r`` and queue it first; its generated tokens are kept. Pending outputs are
        resolved first (the re-prefill needs ``r``'s tokens, and a request that already stopped is released
        instead), so a waiting request never has a pending token."""
        self._outputs.resolve_all(res)
        self._release_stopped(running, res)
        if r.stopped:
            return
        self.slots.release(r.row)
        running.remove(r)
        r.row, r.cached, r.decoding = None, 0, False
        r.retractions += 1
        res.retracted += 1
        waiting.appendleft(r)

    def _out_of_memory(self, error, reqs: list[Request], batch) -> bool:
        """Report the failed step through the guard (it raises when retracting cannot help), retract its requests
        (the earliest started ends first in the queue) and go on (runtime/engine/oom.py)."""
        if self.oom is None:
            raise error
        self._res.oom_events.append(self.oom.handle(error, len(self._res.steps), batch, self.workload, len(reqs)))
        for r in reversed(reqs):
            self._retract(r, self._waiting, self._running, self._res)
        return True

    def _finish_step(self, reqs: list[Request], running: list[Request], res: RunResult) -> None:
        """Host bookkeeping that needs no token value: a placeholder output per sampled request, and the
        release of every request that reached its length."""
        for r in reqs:
            r.output.append(PENDING)
            r.decoding = True
            if r.done:
                self.slots.release(r.row)
                running.remove(r)
                r.row = None
                res.finished += 1

    def _release_stopped(self, running: list[Request], res: RunResult) -> None:
        """Release every running request that resolved outputs showed has emitted an EOS id: its pages and
        request row return now, and no later step includes it. (One that already finished by length was
        released then.)"""
        for r in self._outputs.take_stopped():
            if r.row is not None:
                self.slots.release(r.row)
                running.remove(r)
                r.row = None
                res.finished += 1

    def _stall_message(self, waiting, running) -> str:
        return (
            f"the engine cannot make progress: {len(running)} running, {len(waiting)} waiting, "
            f"{self.slots.pages.available} of {self.slots.pages.capacity} KV pages free. "
            "Fix: raise kv.num_pages, or lower workload.max_running_requests / workload.chunked_prefill_size."
        )
