"""Tensor parallelism end to end on the CPU: ``torchrun --nproc-per-node 2 -m runtime parallel.tp=2`` over gloo must
generate exactly the tokens of the same workload at tp=1 (float32: the ranks' partial sums are added in another
order than one rank's matmul, so logits differ in the last bits; a flip would need a near-tie, and the failure
message gives the tp=1 margin at the first differing position).

Cases: the synthetic preset (tiny_mla with a small seeded MoE stack, experts split by moe=ep, and the parity
reference rerun under tp); a tiny transformers DeepSeek-V3 checkpoint (q LoRA, YaRN, grouped noaux_tc routing,
a shared expert) with moe=tp and moe=ep, also against transformers' own greedy tokens; DeepSeek sparse attention
with HiSparse (every rank's coordinator must make the same swap-in decisions); speculative decoding. The tp=2 runs
of all cases share one torchrun launch (the ``tp2`` fixture: its startup costs more than a run), each test asserting
on its own run's report.
"""

from __future__ import annotations

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_config
from hf_models import YARN, Case, make_case, prompt_overrides
from tp_launch import assert_same_tokens, run_tp2_scenarios, tp1

from containers import build
from runtime.app.parallel_report import disagreements
from runtime.core.parallel import SingleRank

SYNTH_MOE = ("model.mlp=deepseek", "model.intermediate_size=128", "model.moe_intermediate_size=64",
             "model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.n_shared_experts=1",
             "model.first_k_dense_replace=1", "model.scoring_func=sigmoid", "model.topk_method=noaux_tc",
             "model.norm_topk_prob=true", "model.n_group=2", "model.topk_group=1")
# a V3 checkpoint with an even head count (the shared cases of hf_models have 3, 5 and 7 heads)
V3_TP = Case("v3_tp_even_heads", "deepseek_v3", dict(
    q_lora_rank=32, num_attention_heads=4, num_key_value_heads=4, rope_parameters=YARN, rope_interleave=True,
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    routed_scaling_factor=2.5, norm_topk_prob=True), seed=11, prompt_lens=(1, 5, 16, 17, 30))


SYNTH_ARGS = ("device=cpu", *SYNTH_MOE)
SPECULATIVE = ("+deploy=cpu_speculative", "speculative.baseline=false")


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    return make_case(V3_TP, tmp_path_factory.mktemp("v3_tp"))


def checkpoint_args(ref) -> tuple[str, ...]:
    return ("model=hf", f"model.path={ref.folder}", "model.dtype=float32", "device=cpu",
            *prompt_overrides(ref.folder, ref.prompts, V3_TP.new_tokens))


@pytest.fixture(scope="module")
def tp2(request, tmp_path_factory):
    """Every tp=2 run of this module, in one torchrun launch: ``tp2.result(name)`` -> (report, outputs by rid)."""
    scenarios = {"synthetic_ep": (*SYNTH_ARGS, "parallel.moe=ep"),  # with the parity reference, itself under tp=2
                 "hisparse": ("+deploy=cpu_dsa_hisparse", "check=off"),
                 "speculative": (*SPECULATIVE, "check=off")}
    if importlib.util.find_spec("transformers") is not None:  # else the checkpoint cases skip
        ref = request.getfixturevalue("v3_checkpoint")
        for moe in ("tp", "ep"):
            scenarios[f"checkpoint_{moe}"] = (*checkpoint_args(ref), f"parallel.moe={moe}", "check=off")
    return run_tp2_scenarios(tmp_path_factory.mktemp("tp2"), scenarios)


def test_synthetic_moe_ep_tp2_equals_tp1_and_report(tp2):
    rep, got = tp2.result("synthetic_ep")
    want, margins = tp1(*SYNTH_ARGS)
    assert_same_tokens(got, want, margins)
    assert rep["parity"]["ok"] and rep["parity"]["tokens_equal"]
    par = rep["parallel"]
    assert (par["tp"], par["moe"], par["world_size"], par["backend"]) == (2, "ep", 2, "gloo")
    assert len(par["memory_per_rank"]) == 2
    # experts are split: each rank holds fewer weight bytes than the whole model
    full = build(compose_config(*SYNTH_ARGS, "check=off")).container.model().weight_bytes
    assert all(m["weights_bytes"] < full for m in par["memory_per_rank"])
    dec = par["collectives"]["decode"]
    # per step: the embedding, 2 layers x (attention + MLP/MoE) all-reduces, the logits' all-gather
    assert dec["count_per_step"] == 6 and dec["eager_steps"] == dec["steps"] > 0 and dec["ms_per_eager_step"] > 0
    assert dec["bytes_per_step"] > 0 and par["collective_totals"]["count"] > 0


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_checkpoint_moe_tp2_equals_tp1_and_transformers(moe, v3_checkpoint, tp2):
    ref = v3_checkpoint
    _, got = tp2.result(f"checkpoint_{moe}")
    want, margins = tp1(*checkpoint_args(ref))
    assert_same_tokens(got, want, margins)
    assert [got[i] for i in range(len(ref.prompts))] == ref.tokens  # and transformers' greedy tokens


def test_hisparse_ranks_agree_and_equal_tp1(tp2):
    rep, got = tp2.result("hisparse")
    want, margins = tp1("+deploy=cpu_dsa_hisparse")
    assert_same_tokens(got, want, margins)
    assert rep["hisparse"]["swap_ins"] > 0  # the buffer evicted and swapped in, and every rank agreed


def test_speculative_tp2_equals_tp1(tp2):
    """EAGLE chain speculation: the draft model shares the target's sharded weights and its group."""
    rep, got = tp2.result("speculative")
    want, margins = tp1(*SPECULATIVE)
    assert_same_tokens(got, want, margins)
    assert rep["speculative"]["rounds"] > 0 and rep["parallel"]["collectives"]["target_verify"]["count_per_step"] > 0


def test_tp1_run_is_unchanged_by_the_parallel_code():
    """The same preset with the group of one rank: no collective issued, the report says tp 1."""
    rt = build(compose_config("device=cpu", *SYNTH_MOE, "check=off"))
    res = rt.engine.run()
    assert rt.container.tp_group().size == 1 and rt.build_order[0] == "tp_group"
    assert all(s.collectives.count == 0 for s in res.steps)


class SplitBrain(SingleRank):
    """A group of two ranks whose second rank reports a changed copy of what it gathers."""

    size = 2

    def __init__(self, change):
        super().__init__(torch.device("cpu"))
        self.change = change

    def gather_objects(self, obj) -> list:
        return [obj, self.change(copy.deepcopy(obj))]


def test_ranks_that_disagree_fail_the_run_loudly():
    rt = build(compose_config("device=cpu", "check=off"))
    res = rt.engine.run()

    def flip(outputs):
        outputs[1] = (outputs[1][0], [t + 1 for t in outputs[1][1]])
        return outputs

    stub = SimpleNamespace(container=SimpleNamespace(tp_group=lambda: SplitBrain(flip),
                                                     hisparse_coordinator=lambda: None))
    found = disagreements(stub, res)
    assert len(found) == 1 and "rank 1 generated different tokens than rank 0 for 1 request(s), first request 1" \
        in found[0]
    assert disagreements(SimpleNamespace(container=SimpleNamespace(
        tp_group=lambda: SplitBrain(lambda o: o), hisparse_coordinator=lambda: None)), res) == []


def test_hisparse_coordinators_that_disagree_are_reported():
    rt = build(compose_config("+deploy=cpu_dsa_hisparse", "check=off"))
    rt.engine.run()
    c = rt.container.hisparse_coordinator()
    assert c.disagreement() is None  # one rank agrees with itself
    c.group = SplitBrain(lambda d: (d[0] + 1, *d[1:]))  # the other rank counted one more hit
    assert "ranks [1] made different HiSparse swap-in decisions" in c.disagreement()
