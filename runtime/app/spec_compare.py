"""Speculative decoding against plain decoding of the same config, token by token and mode by mode (issue 51).

Greedy speculation is lossless in exact arithmetic: every token it emits is the target's greedy choice on the true
sequence, computed by the target-verify forward (an extend over ``k + 1`` tokens) where plain decoding computes it
by a decode forward. In 16-bit arithmetic the two forwards round differently, so where they disagree it is either
a near-tie (both choices within the dtype's tie margin) or a sign that one path is less accurate (or wrong).

The baseline here is the same config without speculation, **fed the speculative run's tokens** (``Engine.run(
forced=...)``), so both runs see the same sequences at every position and their choices compare one to one (a
free-running baseline diverges after its first flip and says nothing after it). Each emitted token of the
speculative run has a source (see :data:`SOURCES`); the comparison and the hidden-state errors against the float32
reference are reported per source, which is how a verify-path defect shows (e.g. only the bonus token, or only
tokens after a rejection, being off).
"""

from __future__ import annotations

import torch

from runtime.engine.engine import RunResult

#: where an emitted token came from: the prefill step, a plain decode step, a speculative round's accepted draft
#: positions, its last position when every draft was accepted (bonus), or its last position after a rejection
SOURCES = ("prefill", "decode", "accepted", "bonus", "correction")


def sources_of(res: RunResult, rid: int) -> list[str]:
    """Per generated position of ``rid``: the speculative run's recorded sources (positions after its last round
    came from prefill steps), else (a plain run) the prefill token first and decode after it."""
    n = len(res.outputs[rid])
    recorded = res.sources.get(rid)
    if recorded is not None or res.sources:
        recorded = recorded or []
        return (recorded + ["prefill"] * (n - len(recorded)))[:n]
    return ["prefill"] * min(n, 1) + ["decode"] * max(n - 1, 0)


def _empty() -> dict:
    return {"positions": 0, "equal": 0, "near_ties": 0, "other": 0}


def tokens_vs_baseline(spec: RunResult, forced_baseline: RunResult, tie_margin: float) -> dict:
    """The speculative run's tokens against the plain run's greedy choices on the same sequences.

    Returns ``{"positions", "equal", "near_ties", "other", "by_source": {source: the same four}}``: a position
    where the choices differ is a near-tie when the plain run's top-1 / top-2 logit margin there is within
    ``tie_margin``, else ``other``."""
    total, by = _empty(), {}
    for rid, tokens in spec.outputs.items():
        choices, margins = forced_baseline.argmax.get(rid, []), forced_baseline.margins.get(rid, [])
        for pos, (tok, src) in enumerate(zip(tokens, sources_of(spec, rid))):
            if pos >= len(choices):
                break
            kind = "equal" if tok == choices[pos] else "near_ties" if margins[pos] <= tie_margin else "other"
            for d in (total, by.setdefault(src, _empty())):
                d["positions"] += 1
                d[kind] += 1
    return {**total, "by_source": by}


def hidden_errors_by_source(run: RunResult, reference: RunResult, sources_from: RunResult | None = None) -> dict:
    """Per source: the relative error of each generated position's final hidden state against the reference
    (``||a_i - b_i|| / ||b_i||``), its max and mean, and the positions counted. ``sources_from``: the run whose
    sources label the positions (the speculative run, when ``run`` is the forced plain run over its tokens)."""
    label = sources_from or run
    errs: dict[str, list[float]] = {}
    for rid in run.outputs:
        a, b = run.hidden.get(rid), reference.hidden.get(rid)
        if a is None or b is None or not b.numel():
            continue
        n = min(a.shape[0], b.shape[0])
        rel = (torch.linalg.vector_norm((a[:n] - b[:n]).double(), dim=-1)
               / torch.linalg.vector_norm(b[:n].double(), dim=-1).clamp_min(1e-30))
        rel = torch.nan_to_num(rel, nan=float("inf"))  # NaN never passes
        for src, e in zip(sources_of(label, rid), rel.tolist()):
            errs.setdefault(src, []).append(e)
    return {src: {"positions": len(v), "max_rel_err": max(v), "mean_rel_err": sum(v) / len(v)}
            for src, v in errs.items()}


def speculative_parity(spec: RunResult, forced_baseline: RunResult, reference: RunResult | None,
                       tie_margin: float) -> dict:
    """The report's ``speculative.vs_baseline`` entry: tokens against the plain run (per source) and, with a
    reference run (both fed the speculative tokens), each mode's hidden-state error per source: ``target_verify``
    (the speculative run) and ``decode`` (the plain run over the same tokens)."""
    out = {"tokens": tokens_vs_baseline(spec, forced_baseline, tie_margin), "tie_margin": tie_margin}
    if reference is not None:
        out["hidden_err"] = {"target_verify": hidden_errors_by_source(spec, reference),
                             "decode": hidden_errors_by_source(forced_baseline, reference, sources_from=spec)}
    return out


def summary_line(entry: dict) -> str:
    """One line for the console: the token agreement and, where measured, the worst error of each mode."""
    t = entry["tokens"]
    line = (f"speculative vs plain decoding (same tokens): {t['equal']}/{t['positions']} equal, "
            f"{t['near_ties']} near-ties, {t['other']} other")
    if "hidden_err" in entry:
        worst = {mode: max((v["max_rel_err"] for v in by.values()), default=0.0)
                 for mode, by in entry["hidden_err"].items()}
        line += "; max rel err vs reference: " + ", ".join(f"{m} {e:.2e}" for m, e in worst.items())
    return line
