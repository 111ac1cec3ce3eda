"""The parity verdict: flips beyond near-ties are allowed only for 16-bit models with discrete routing, and only
up to the budget."""

from types import SimpleNamespace

import torch

from runtime.app.parity import ROUTING_FLIPS_MIN, TOLERANCE_W8A8, compare


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


def _scaled(n_tokens: int, errs: list[float]):
    """One request whose candidate hidden states are off by ``errs[i]`` (relative) at position i."""
    cand, ref = _runs(n_tokens, 0)
    cand.hidden = {0: ref.hidden[0] * (1 + torch.tensor(errs))[:, None]}
    return cand, ref


def test_w8a8_activations_get_their_measured_bound_only_in_16_bits():
    cand, ref = _scaled(4, [0.07] * 4)  # between the 16-bit tolerance (5e-2) and W8A8's (1e-1)
    assert not compare(cand, ref, "bfloat16").ok
    rep = compare(cand, ref, "bfloat16", w8a8=True)
    assert rep.ok and rep.tolerance == TOLERANCE_W8A8["bfloat16"] and rep.activations.startswith("e4m3")
    assert not compare(*_scaled(4, [0.3] * 4), "bfloat16", w8a8=True).ok  # a wrong block or expert still fails
    rep = compare(cand, ref, "float32", w8a8=True)  # float32 never quantizes: its own tolerance
    assert not rep.ok and rep.activations == "float32"


def test_the_report_names_the_worst_request_and_position():
    cand, ref = _scaled(5, [0.0, 0.0, 0.2, 0.0, 0.0])
    cand2, ref2 = _scaled(5, [0.01] * 5)
    cand.outputs[1], cand.argmax[1], cand.hidden[1] = cand2.outputs[0], cand2.argmax[0], cand2.hidden[0]
    ref.argmax[1], ref.margins[1], ref.hidden[1] = ref2.argmax[0], ref2.margins[0], ref2.hidden[0]
    rep = compare(cand, ref, "bfloat16")
    assert (rep.worst_request, rep.worst_position) == (0, 2)
    assert abs(rep.worst_position_rel_err - 0.2) < 1e-6
    assert abs(rep.max_rel_err - 0.2 / 5 ** 0.5) < 1e-6  # the request's norm over its positions
    assert abs(rep.median_rel_err - 0.01) < 1e-6  # of two requests, torch's median takes the lower
