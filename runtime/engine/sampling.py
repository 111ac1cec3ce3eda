"""Per-request sampling: the parameters a request carries, and the sampler that turns a step's logits into tokens.

A request's :class:`SamplingParams` ride in the batch (``Request.sampling``). ``temperature == 0`` is greedy: the
engine's own top-1 choice, exactly as without a sampler. Other requests draw from the logits divided by their
temperature, filtered by ``top_k`` / ``top_p`` / ``min_p``.

Randomness is counter-based: the noise of a request's ``i``-th generated token is a hash of (seed, i, token id),
so a seeded request gets the same tokens whatever it is batched with, on every tensor-parallel rank, on the CPU
and the GPU alike, with no generator state and no host sync; the token is the exponential race (Gumbel-max) over
the filtered probabilities. The filters (top-k, then top-p, then min-p) run in torch on the CPU (one sort of each
row) and with FlashInfer's sort-free ``top_k_renorm_probs`` / ``top_p_renorm_probs`` on CUDA when FlashInfer is
installed (imported on first use; without it, the torch filters). FlashInfer's fused samplers are not used for the
draw: their Philox stream is keyed by the row's place in the batch. An unseeded request gets a seed drawn when it
is created.

Logprobs (``logprobs`` = N) are those of the model's raw distribution (log-softmax of the logits, before
temperature and filters), as OpenAI and vLLM report them: the sampled token's and the top N.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.core.device import to_device
from runtime.core.errors import Problem

MAX_LOGPROBS = 20  # OpenAI's limit on top logprobs
_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (besides ``max_new_tokens``).

    Attributes
    ----------
    temperature : 0 is greedy (the engine's top-1, unchanged); > 0 samples from softmax(logits / temperature)
    top_p : keep the smallest set of most likely tokens whose probability sums to at least top_p (1: all)
    top_k : keep the k most likely tokens (0 or -1: all)
    min_p : keep tokens with probability >= min_p * the most likely token's (0: all)
    seed : the request's random stream (None: one drawn at random when the request is made)
    stop : strings that end the request when they appear in the decoded text (the text is cut before them)
    stop_token_ids : token ids that end the request (kept as its last output token, like EOS ids)
    ignore_eos : the model's EOS ids do not end the request
    logprobs : report the sampled token's logprob and the top ``logprobs`` alternatives (None: none)
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def seeded(self) -> SamplingParams:
        """These parameters with a seed: the given one, or a fresh random one for a sampled request."""
        if self.seed is not None or self.greedy:
            return self
        return SamplingParams(**{**self.__dict__, "seed": random.getrandbits(63)})


GREEDY = SamplingParams()
PARAM_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_params(obj: dict, where: str, vocab_size: int) -> tuple[SamplingParams | None, list[Problem]]:
    """The :data:`PARAM_KEYS` of ``obj`` (absent keys take their defaults; JSON null too) as SamplingParams, or
    None and every problem (``where`` names the source: a prompt file's line, a request field prefix)."""
    out: list[Problem] = []
    v = {k: obj[k] for k in PARAM_KEYS if obj.get(k) is not None}

    def bad(key: str, got: Any, expected: str, fix: str) -> None:
        out.append(Problem(f"{where}{key}", repr(got), expected, fix))

    t = v.get("temperature", 0.0)
    if not _is_num(t) or not 0 <= t <= 100 or math.isnan(t):
        bad("temperature", t, "a number in [0, 100] (0: greedy)", '"temperature": 0.7')
    p = v.get("top_p", 1.0)
    if not _is_num(p) or not 0 < p <= 1:
        bad("top_p", p, "a number in (0, 1]", '"top_p": 0.9')
    k = v.get("top_k", -1)
    if not _is_int(k) or k < -1:
        bad("top_k", k, "an integer >= 1, or 0 / -1 for all tokens", '"top_k": 40')
    m = v.get("min_p", 0.0)
    if not _is_num(m) or not 0 <= m <= 1:
        bad("min_p", m, "a number in [0, 1]", '"min_p": 0.05')
    s = v.get("seed")
    if s is not None and (not _is_int(s) or not -(2**63) <= s < 2**64):
        bad("seed", s, "an integer", '"seed": 1234')
    stop = v.get("stop", ())
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop) or len(stop) > 16:
        bad("stop", v.get("stop"), "a non-empty string or a list of at most 16 of them", '"stop": ["\\n\\n"]')
        stop = ()
    ids = v.get("stop_token_ids", ())
    if not isinstance(ids, (list, tuple)) or not all(_is_int(x) and 0 <= x < vocab_size for x in ids):
        bad("stop_token_ids", ids, f"a list of token ids in [0, {vocab_size})", '"stop_token_ids": [2]')
        ids = ()
    ign = v.get("ignore_eos", False)
    if not isinstance(ign, bool):
        bad("ignore_eos", ign, "true or false", '"ignore_eos": true')
    lp = v.get("logprobs")
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
        bad("logprobs", lp, f"an integer in [0, {MAX_LOGPROBS}] (top alternatives reported)", '"logprobs": 5')
    if out:
        return None, out
    return SamplingParams(float(t), float(p), 0 if k == -1 else int(k), float(m), None if s is None else int(s) % 2**63,
                          tuple(stop), tuple(int(x) for x in ids), ign, lp), []


# ------------------------------------------------------------------------------------- counter-based noise
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 values in [0, 2^32); products wrap and are masked back."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] float32 in (0, 1): a pure function of (seed, position, token id), on ``seeds``' device.

    Parameters
    ----------
    seeds : [n] int64 in [0, 2^63)
    positions : [n] int64 (the index of the token being generated in the request's output)
    """
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _mix32(_mix32(lo ^ _mix32(hi + 0x9E3779B9)) ^ (positions & _M32))  # [n]
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    h = _mix32(key[:, None] ^ _mix32(ids * 0x27D4EB2F & _M32)[None, :])
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor) -> torch.Tensor:
    """softmax(logits / temperature) with each row's filters applied in the usual order (FlashInfer's and vLLM's):
    top-k, then top-p over the renormalized top-k set, then min-p (relative to the top token, so renormalizing
    does not move it); filtered tokens get probability 0 (rows are not renormalized: the draw does not need it).
    The top token always stays. logits [n, V] float32; temperature, top_p, min_p [n] float32 (> 0, (0, 1],
    [0, 1]); top_k [n] int64 (0: all). Returns [n, V] float32."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    order = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    k = torch.where(top_k > 0, top_k, probs.shape[-1])[:, None]
    sorted_p = torch.where(rank < k, order.values, torch.zeros_like(order.values))
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # probability of the better tokens
    keep = (rank < k) & (before < top_p[:, None]) & (order.values >= min_p[:, None] * order.values[:, :1])
    keep[:, 0] = True
    kept = torch.where(keep, order.values, torch.zeros_like(order.values))
    return torch.empty_like(probs).scatter_(-1, order.indices, kept)


def race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn from ``probs`` [n, V] (unnormalized, zeros never drawn) with the counter-based
    noise: the exponential race argmax(p_i / E_i), E_i = -log(u_i), i.e. Gumbel-max on log p. [n] int64."""
    u = uniform_noise(seeds, positions, probs.shape[-1])
    return torch.argmax(torch.log(probs) - torch.log(-torch.log(u)), dim=-1)


@dataclass
class Drawn:
    """One step's sampling results for its sampling rows, on the device.

    Attributes
    ----------
    tokens : [n] int64 tokens to feed (greedy rows: the engine's top-1 choice)
    logprob : [n] float32 logprob of each fed token (None when no row asked for logprobs)
    top_ids, top_logprobs : [n, N] int64 / float32, N the largest ``logprobs`` of the step (None likewise)
    """

    tokens: torch.Tensor
    logprob: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    wanted: list[int | None] = field(default_factory=list)  # each row's ``logprobs`` (None: not reported)


class Sampler:
    """Draws each sampling request's token from its row of logits.

    Parameters
    ----------
    device : torch.device
    use_flashinfer : filter with FlashInfer's renorm kernels (default: on CUDA); where FlashInfer cannot be
        imported the torch filters run instead and ``fallback_reason`` says why
    """

    def __init__(self, device: torch.device, use_flashinfer: bool | None = None):
        self.device = device
        self.use_flashinfer = device.type == "cuda" if use_flashinfer is None else use_flashinfer
        self.fallback_reason: str | None = None

    def needed(self, params: list[SamplingParams | None]) -> bool:
        """Whether any row samples or wants logprobs (else the greedy choice is the token, nothing to do)."""
        return any(p is not None and (not p.greedy or p.logprobs is not None) for p in params)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams | None], positions: list[int],
               greedy: torch.Tensor) -> Drawn:
        """Tokens for the rows of ``logits`` [n, V] (any float dtype); ``params[i]`` None or greedy rows take
        ``greedy[i]`` ([n] int64, the engine's top-1). ``positions[i]``: the index of the token in its request's
        output. No host sync: the per-row parameters go to the device with one non-blocking copy."""
        ps = [p or GREEDY for p in params]
        tokens = greedy
        rows = [i for i, p in enumerate(ps) if not p.greedy]
        if rows:
            index = None if len(rows) == len(ps) else to_device(torch.tensor(rows, dtype=torch.int64), self.device)
            sel = logits if index is None else logits[index]
            drawn = self._draw(sel.float(), [ps[i] for i in rows], [positions[i] for i in rows])
            if index is None:
                tokens = drawn
            else:
                tokens = greedy.clone()
                tokens[index] = drawn
        out = Drawn(tokens, wanted=[p.logprobs for p in ps])
        n_top = max((p.logprobs for p in ps if p.logprobs is not None), default=None)
        if n_top is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            out.logprob = lp.gather(1, tokens[:, None]).squeeze(1)
            if n_top > 0:
                top = torch.topk(lp, n_top, dim=-1)
                out.top_ids, out.top_logprobs = top.indices, top.values
        return out

    def _columns(self, ps: list[SamplingParams], positions: list[int]) -> dict[str, torch.Tensor]:
        host = torch.tensor([[p.temperature, p.top_p, p.min_p, float(p.top_k)] for p in ps], dtype=torch.float64)
        ints = torch.tensor([[p.seed or 0, pos] for p, pos in zip(ps, positions)], dtype=torch.int64)
        host, ints = to_device(host, self.device), to_device(ints, self.device)
        return {"temperature": host[:, 0].float(), "top_p": host[:, 1].float(), "min_p": host[:, 2].float(),
                "top_k": host[:, 3].long(), "seed": ints[:, 0], "position": ints[:, 1]}

    def _draw(self, logits: torch.Tensor, ps: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        c = self._columns(ps, positions)
        probs = None
        if self.use_flashinfer and self.fallback_reason is None:
            try:
                probs = self._probs_flashinfer(logits, ps, c)
            except (ImportError, AttributeError, TypeError) as e:  # no FlashInfer, or one without these kernels
                self.fallback_reason = f"{type(e).__name__}: {e}"
        if probs is None:
            probs = filter_probs(logits, c["temperature"], c["top_k"], c["top_p"], c["min_p"])
        return race(probs, c["seed"], c["position"])

    @staticmethod
    def _probs_flashinfer(logits: torch.Tensor, ps: list[SamplingParams], c: dict[str, torch.Tensor]) -> torch.Tensor:
        """The filters of :func:`filter_probs` with FlashInfer's sort-free renorm kernels (per-row top-k / top-p
        tensors): the sort over the vocabulary is the costly part of the torch path on a large vocabulary. The
        draw stays the counter-based race (FlashInfer's own samplers key their Philox stream by the row's place in
        the batch, which would make a seeded request depend on its batch)."""
        from flashinfer.sampling import top_k_renorm_probs, top_p_renorm_probs

        probs = torch.softmax(logits / c["temperature"][:, None], dim=-1)
        if any(p.top_k > 0 for p in ps):
            top_k = torch.where(c["top_k"] > 0, c["top_k"].clamp_max(logits.shape[-1]), logits.shape[-1])
            top_k = top_k.to(torch.int32)
            probs = top_k_renorm_probs(probs, top_k)
        if any(p.top_p < 1 for p in ps):
            probs = top_p_renorm_probs(probs, c["top_p"])
        if any(p.min_p > 0 for p in ps):
            floor = probs.max(dim=-1, keepdim=True).values * c["min_p"][:, None]
            probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
        return probs
