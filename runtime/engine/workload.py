"""Seeded synthetic requests from the `workload` config."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.core.config import LengthDist


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
    stop_tokens: frozenset[int] = frozenset()  # generating one of these finishes the request (EOS)
    stop_at: int | None = None  # index in ``output`` of the stop token, once its step was read back

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        """Reached its length, or generated a stop token that the host has read back (with overlap, one step
        after the step that produced it: the step in between ran for it too, and its token is dropped)."""
        return self.stop_at is not None or len(self.output) >= self.max_new_tokens

    @property
    def final_output(self) -> list[int]:
        """The generated tokens up to and including the stop token (tokens of steps after it are dropped)."""
        return list(self.output if self.stop_at is None else self.output[: self.stop_at + 1])


def make_requests(workload: dict, vocab_size: int) -> list[Request]:
    rng = np.random.default_rng(workload["seed"])
    n = workload["num_requests"]
    prompt_lens = sample_lengths(workload["prompt_len"], n, rng)
    output_lens = sample_lengths(workload["output_len"], n, rng)
    return [
        Request(rid=i, prompt=[int(t) for t in rng.integers(0, vocab_size, size=p)], max_new_tokens=o)
        for i, (p, o) in enumerate(zip(prompt_lens, output_lens))
    ]
