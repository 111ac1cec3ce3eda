"""The parity verdict: flips beyond near-ties are allowed only for 16-bit models with discrete routing, and only
up to the budget."""

from types import SimpleNamespace

import torch

from runtime.app.parity import ROUTING_FLIPS_MIN, compare


def _runs(n_tokens: int, flips: int, margin: float = 1.0):
    out = {0: list(range(n_tokens))}
    ref_argmax = {0: [t + 1 if i < flips else t for i, t in enumerate(out[0])]}
    hidden = torch.ones(n_tokens, 4)
    cand = SimpleNamespace(outputs=out, argmax=out, hidden={0: hidden}, lost=0)  # greedy: its tokens are its choices
    ref = SimpleNamespace(argmax=ref_argmax, margins={0: [margin] * n_tokens}, hidden={0: hidden.clone()})
    return cand, ref


def test_flips_beyond_near_ties_fail_without_discrete_routing():
    cand, ref = _runs(40, 1)
    assert not compare(cand, ref, "bfloat16").ok


def test_discrete_routing_in_bf16_allows_the_budget_and_no_more():
    cand, ref = _runs(40, ROUTING_FLIPS_MIN)
    rep = compare(cand, ref, "bfloat16", discrete_routing=True)
    assert rep.ok and rep.routing_flip_budget == ROUTING_FLIPS_MIN and rep.mismatches == ROUTING_FLIPS_MIN
    cand, ref = _runs(40, ROUTING_FLIPS_MIN + 1)
    assert not compare(cand, ref, "bfloat16", discrete_routing=True).ok


def test_float32_gets_no_budget_even_with_routing():
    cand, ref = _runs(40, 1)
    rep = compare(cand, ref, "float32", discrete_routing=True)
    assert not rep.ok and rep.routing_flip_budget == 0


def test_near_ties_still_pass_everywhere():
    cand, ref = _runs(40, 3, margin=0.0)
    assert compare(cand, ref, "float32").ok
