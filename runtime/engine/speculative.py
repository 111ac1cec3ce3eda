"""EAGLE-style chain speculation (topk = 1) with greedy acceptance: lossless against plain greedy decoding.

Invariants between rounds, for a decoding request whose target KV covers positions ``[0, L)``:

* the pending token ``t_L`` (position L) is in the device last-token table (as in plain decoding);
* the draft model's KV covers ``[0, L + 1)`` (it has already seen ``t_L``), and its guess for position
  ``L + 1`` is in the device draft-token table: that is draft token ``d_1``;
* the request owns KV slots for positions ``[0, L + 1)`` (the request table is shared by both models;
  each has its own KV pool).

One round, ``k = num_steps``:

1. **draft decode** (``k - 1`` steps, one graph): inputs ``d_1 .. d_{k-1}`` at positions ``L+1 .. L+k-1``
   give ``d_2 .. d_k``. Every step's metadata is planned before the first runs (one backend per step).
2. **target verify** (TARGET_VERIFY, ``k + 1`` tokens per request): inputs ``t_L, d_1 .. d_k`` at positions
   ``L .. L+k``; the target's greedy tokens ``g_0 .. g_k``. Accepted: the longest prefix with
   ``d_{i+1} == g_i``, say ``n`` drafts; the round emits ``g_0 .. g_n`` (``n + 1`` tokens), exactly what
   plain greedy decoding would emit, because every emitted ``g_i`` was computed from the true sequence.
3. **draft extend** (DRAFT_EXTEND, ``k + 1`` tokens per request, uniform so it can be graphed): inputs
   ``g_0 .. g_k`` at positions ``L+1 .. L+k+1``. Causal attention makes rows ``0..n`` exact whatever the
   rejected tokens after them; row ``n`` gives the next round's ``d_1``, and the draft KV of
   ``L+1 .. L+n+1`` is refreshed.

The round needs slots for positions ``L+1 .. L+k+1``; after acceptance the request keeps ``L' + 1 = L + n + 2``
of them and the rest go back to the allocator. The host reads the accepted counts once per round (while the
draft extend runs on the GPU): the next round's lengths depend on them.

After a request's prefill samples ``t_L``, ``after_prefill`` runs the draft model over the same chunk and
then one DRAFT_EXTEND token (``t_L`` at position L) to reach the invariant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backends.multi_step_draft import MultiStepDraftBackend
from runtime.core.batch import ForwardBatch, ForwardMode, make_batch
from runtime.core.kv_pool import TokenSlots
from runtime.engine.graph_runner import GraphRunner
from runtime.engine.step_outputs import StepClock
from runtime.model.mla_model import MLAModel


class DraftSteps:
    """The draft decode steps of a round as one callable (graphed as one graph).

    ``__call__(ids, batch)``: ids [B] int64 (``d_1``), batch = step 0 (DECODE at position L+1) whose
    metadata the draft backend planned for every step -> tokens [B, num_steps] int64 (``d_1 .. d_k``).
    """

    def __init__(self, draft: MLAModel, backend: MultiStepDraftBackend):
        self.draft, self.backend = draft, backend

    def __call__(self, ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        tokens = [ids]
        for j in range(self.backend.num_decode_steps):
            step = self.backend.select_step(j)
            h = self.draft.forward(tokens[-1], step)
            tokens.append(torch.argmax(self.draft.logits(h), dim=-1))
        return torch.stack(tokens, dim=1)


@dataclass
class SpecStats:
    rounds: int = 0
    request_rounds: int = 0  # sum over rounds of the batch size
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens emitted by rounds (accepted + one bonus per request-round, capped by length)
    accept_hist: list[int] = field(default_factory=list)  # count of request-rounds with n accepted, n=0..k

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per request per round (1 = nothing accepted, num_steps + 1 = everything)."""
        return self.emitted / self.request_rounds if self.request_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class RoundResult:
    """Host values of one round, per request: the emitted tokens (greedy choices), their top-2 logit
    margins, (if recorded) the hidden-state rows that produced them, whether the request emitted an EOS
    id (its tokens then end with it), and each token's source: ``accepted`` (a draft the target confirmed),
    ``bonus`` (the position after k accepted drafts) or ``correction`` (the target's choice where a draft was
    rejected)."""

    tokens: list[list[int]]
    margins: list[list[float]]
    hidden: torch.Tensor | None  # [B, k + 1, hidden] host, or None
    accepted: list[int]
    stopped: list[bool]
    sources: list[list[str]]


class SpeculativeDriver:
    """Runs draft, verify and draft-extend forwards for a batch of decoding requests.

    Parameters
    ----------
    target, draft : MLAModel
        ``draft`` shares the target's embedding, first layers and LM head, with its own KV pool.
    target_backend : the target's attention object (planned for TARGET_VERIFY)
    draft_backend : MultiStepDraftBackend
    draft_steps : DraftSteps
    graphs : GraphRunner (modes draft_decode, target_verify, draft_extend)
    token_slots : TokenSlots
    num_steps : speculative.num_steps (k)
    max_requests : rows of the request table (the draft-token table has one more, the padding row)
    device : torch.device
    """

    def __init__(self, target: MLAModel, draft: MLAModel, target_backend, draft_backend: MultiStepDraftBackend,
                 draft_steps: DraftSteps, graphs: GraphRunner, token_slots: TokenSlots, num_steps: int,
                 max_requests: int, device: torch.device):
        self.target, self.draft = target, draft
        self.target_backend, self.draft_backend, self.draft_steps = target_backend, draft_backend, draft_steps
        self.graphs, self.slots, self.k, self.device = graphs, token_slots, int(num_steps), device
        self.draft_token = torch.zeros(max_requests + 1, dtype=torch.int64, device=device)
        self.stats = SpecStats(accept_hist=[0] * (self.k + 1))

    @property
    def lookahead(self) -> int:
        """Slots a request needs past its target length L at the end of prefill (position L, for t_L)."""
        return 1

    def round_span(self, row: int, cached: int) -> tuple[int, int, int]:
        """The reservation of one round: positions L+1 .. L+k+1."""
        return (row, cached + 1, cached + self.k + 2)

    # ------------------------------------------------------------------------------------ prefill
    def after_prefill(self, ids: torch.Tensor, batch: ForwardBatch, new_rows: list[int], new_lens: list[int],
                      last_token: torch.Tensor, run_forward) -> None:
        """Draft KV for the prefill chunk, then ``t_L`` through the draft for requests that start decoding.

        ``new_rows`` / ``new_lens``: rows and target lengths L of those requests (their slot L is reserved);
        ``run_forward(phase, fn, planner, ids, batch)`` runs one forward with the engine's fence and timing."""
        run_forward("draft_prefill", self.draft.forward, self.draft_backend, ids, batch)
        if not new_rows:
            return
        locs = [s for row, n in zip(new_rows, new_lens) for s in self.slots.slots_of(row, n, n + 1)]
        boot = make_batch(ForwardMode.DRAFT_EXTEND, new_rows, new_lens, [1] * len(new_rows), locs, self.device)
        h = run_forward("draft_bootstrap", self.draft.forward, self.draft_backend, last_token[boot.req_pool_indices],
                        boot)
        self.draft_token[boot.req_pool_indices] = torch.argmax(self.draft.logits(h), dim=-1)

    # -------------------------------------------------------------------------------------- round
    def round(self, rows: list[int], lens: list[int], round_slots: list[int], last_token: torch.Tensor,
              run_forward, record_hidden: bool, clock: StepClock):
        """One speculative round for requests in ``rows`` with target lengths ``lens`` (L). ``round_slots``:
        the slots of positions L+1 .. L+k+1 of every request, request after request (just reserved).
        ``run_forward(phase, fn, planner, ids, batch)`` runs one forward (graph replay or plan + ``fn``).

        Returns (host, verified): the verify's results being copied to pinned host memory (greedy tokens
        [B, k+1], accepted counts [B], top-2 margins [B, k+1], hidden [B, k+1, hidden] or None), valid once
        the host waited for the mark ``verified``; :meth:`resolve` reads them. The draft extend is enqueued
        after the mark, so the GPU runs it while the host waits."""
        to_host = clock.to_host
        k, b = self.k, len(rows)
        per = k + 1
        # 1. draft decode steps (positions L+1 .. L+k-1)
        first = [round_slots[i * per] for i in range(b)]
        step0 = make_batch(ForwardMode.DECODE, rows, [n + 1 for n in lens], [1] * b, first, self.device)
        d1 = self.draft_token[step0.req_pool_indices]
        if self.draft_backend.num_decode_steps:
            drafts = run_forward("draft_decode", self.draft_steps, self.draft_backend, d1, step0)
        else:
            drafts = d1[:, None]
        # 2. target verify (positions L .. L+k)
        vlocs = []
        for i, (row, n) in enumerate(zip(rows, lens)):
            vlocs += self.slots.slots_of(row, n, n + 1) + round_slots[i * per : i * per + k]
        verify = make_batch(ForwardMode.TARGET_VERIFY, rows, lens, [per] * b, vlocs, self.device)
        vids = torch.cat([last_token[verify.req_pool_indices][:, None], drafts], dim=1).reshape(-1)
        h = run_forward("target_verify", self.target.forward, self.target_backend, vids, verify)
        top2 = torch.topk(self.target.logits(h), 2, dim=-1)
        greedy = top2.indices[:, 0].view(b, per)
        match = (drafts == greedy[:, :k]).to(torch.int64)
        accepted = torch.cumprod(match, dim=1).sum(dim=1)  # [B] n
        ar = torch.arange(b, device=greedy.device)
        last_token[verify.req_pool_indices] = greedy[ar, accepted]
        host = (to_host(greedy), to_host(accepted), to_host((top2.values[:, 0] - top2.values[:, 1]).view(b, per)),
                to_host(h.float().view(b, per, -1)) if record_hidden else None)
        verified = clock.mark()
        # 3. draft extend (positions L+1 .. L+k+1), next round's d_1 from row n
        ext = make_batch(ForwardMode.DRAFT_EXTEND, rows, [n + 1 for n in lens], [per] * b, round_slots, self.device)
        hd = run_forward("draft_extend", self.draft.forward, self.draft_backend, greedy.reshape(-1), ext)
        rows_n = hd.view(b, per, -1)[ar, accepted]
        self.draft_token[ext.req_pool_indices] = torch.argmax(self.draft.logits(rows_n), dim=-1)
        return host, verified

    def resolve(self, host, remaining: list[int], eos_ids: frozenset[int] = frozenset()) -> RoundResult:
        """Host values of a round (its copies are complete): per request the emitted tokens, capped by the
        tokens it still needs (``remaining``) and cut right after the first EOS id, and statistics. A request
        with ``remaining`` 0 (released while the round ran) gets nothing and is left out of the statistics."""
        greedy, accepted, margins, hidden = host
        g, n_acc, m = greedy.tolist(), accepted.tolist(), margins.tolist()
        tokens, marg, stopped, sources = [], [], [], []
        st = self.stats
        st.rounds += 1
        for i, n in enumerate(n_acc):
            if remaining[i] == 0:
                tokens.append([])
                marg.append([])
                stopped.append(False)
                sources.append([])
                continue
            emit = min(n + 1, remaining[i])
            eos = next((j for j, t in enumerate(g[i][:emit]) if t in eos_ids), None)
            stopped.append(eos is not None)
            if eos is not None:
                emit = eos + 1
            tokens.append(g[i][:emit])
            marg.append(m[i][:emit])
            sources.append((["accepted"] * n + ["bonus" if n == self.k else "correction"])[:emit])
            st.request_rounds += 1
            st.drafted += self.k
            st.accepted += n
            st.emitted += emit
            st.accept_hist[n] += 1
        return RoundResult(tokens, marg, hidden, n_acc, stopped, sources)
