"""The requests of a run: seeded synthetic ones from the `workload` config, or those of a prompt file
(runtime/engine/prompts.py), with the token ids that stop a request early."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.core.config import LengthDist
from runtime.engine.sampling import SamplingParams
from runtime.engine.stops import StopRule


def sample_lengths(dist: dict, n: int, rng: np.random.Generator) -> list[int]:
    """n lengths from a length config (dist fixed | uniform | normal), clamped to [min, max]."""
    kind = LengthDist(str(dist["dist"]))
    if kind == LengthDist.fixed:
        raw = np.full(n, dist["mean"])
    elif kind == LengthDist.uniform:
        raw = rng.integers(dist["min"], dist["max"] + 1, size=n)
    else:
        raw = np.rint(rng.normal(dist["mean"], dist["std"], size=n))
    return [int(v) for v in np.clip(raw, dist["min"], dist["max"])]


@dataclass
class Request:
    """One request's tokens and its place in the KV cache.

    ``tokens`` is prompt + generated; ``cached`` counts the tokens whose KV is in the pool. A retracted
    request keeps its generated tokens and is prefilled again from scratch.
    """

    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    row: int | None = None
    cached: int = 0
    decoding: bool = False  # prefill done: each step feeds the newest token
    retractions: int = 0
    stopped: bool = False  # emitted a stop (EOS) token: ``output`` ends with it
    sampling: SamplingParams | None = None  # None: greedy (runtime/engine/sampling.py)
    stop_rule: StopRule | None = None  # None: the workload's EOS ids stop it (runtime/engine/stops.py)
    logprobs: list = field(default_factory=list)  # with sampling.logprobs: (logprob, [(id, logprob), ...]) per token

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return self.stopped or len(self.output) >= self.max_new_tokens


@dataclass(frozen=True)
class RequestSpec:
    """One request as given: prompt token ids, the most tokens to generate, and how it samples and stops."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams | None = None


@dataclass(frozen=True)
class Workload:
    """What the engine serves: the requests in input order (request ``i`` gets rid ``i``), the token ids that
    stop a request early, and the tokenizer that decodes outputs (None without one).

    Attributes
    ----------
    specs : the requests, in input order
    eos_ids : a generated token in this set ends its request (kept as its last output token)
    tokenizer : a ``tokenizers.Tokenizer`` or None
    """

    specs: tuple[RequestSpec, ...]
    eos_ids: frozenset[int] = frozenset()
    tokenizer: Any = None

    def requests(self) -> list[Request]:
        """Fresh engine requests (every run starts from these). A request with sampling parameters gets its stop
        rule; a sampled one without a seed gets seed ``i`` (so every run, and every tensor-parallel rank, draws
        the same tokens)."""
        out = []
        for i, s in enumerate(self.specs):
            r = Request(rid=i, prompt=list(s.prompt), max_new_tokens=s.max_new_tokens)
            if s.sampling is not None:
                p = s.sampling
                r.sampling = p if p.seed is not None or p.greedy else SamplingParams(**{**p.__dict__, "seed": i})
                r.stop_rule = StopRule(p, self.eos_ids, self.tokenizer)
            out.append(r)
        return out

    def decode(self, ids: list[int]) -> str | None:
        """The text of ``ids`` (special tokens dropped), or None without a tokenizer."""
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))


def synthetic_specs(workload: dict, vocab_size: int) -> tuple[RequestSpec, ...]:
    """``num_requests`` seeded random prompts, lengths drawn from ``prompt_len`` / ``output_len``."""
    rng = np.random.default_rng(workload["seed"])
    n = workload["num_requests"]
    prompt_lens = sample_lengths(workload["prompt_len"], n, rng)
    output_lens = sample_lengths(workload["output_len"], n, rng)
    return tuple(RequestSpec(tuple(int(t) for t in rng.integers(0, vocab_size, size=p)), o)
                 for p, o in zip(prompt_lens, output_lens))


def make_requests(workload: dict, vocab_size: int) -> list[Request]:
    """The synthetic requests of a `workload` config."""
    return Workload(synthetic_specs(workload, vocab_size)).requests()
