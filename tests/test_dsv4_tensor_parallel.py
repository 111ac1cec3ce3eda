"""DeepSeek-V4 under tensor parallelism, end to end on the CPU: ``torchrun --nproc-per-node 2 -m runtime
parallel.tp=2 backend=dsv4`` over gloo serves a tiny random transformers V4 model (tests/dsv4_harness.py: CSA, HCA
and sliding layers, hash and bias-corrected routing, mHC, YaRN compress rope; 6 experts and a vocabulary of 98 so
both divide by 2) and must generate transformers' greedy tokens and those of the same workload at tp=1: with
``parallel.moe=tp`` and ``ep``, with HiSparse offloading the CSA entries (each rank its own coordinator, which must
agree) on a tiny pool that retracts, with one output group shared by both ranks, and from DeepSeek's release
format (fp8 / fp4 slices read per rank). The tp=2 runs of all cases share one torchrun launch (the ``tp2`` fixture:
its startup costs more than a run), each test asserting on its own run's report.

Float64 on every side: the ranks' partial sums are added in another order than one rank's matmuls, so logits
differ in the last bits; a flip would need a near-tie, which the references refuse (margin > 1e-6)."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from dsv4_harness import greedy_reference, saved_reference
from hf_models import prompt_overrides
from tp_launch import assert_same_tokens, run_tp2_scenarios, tp1

pytestmark = pytest.mark.usefixtures("one_thread", "no_indexer_ties")

pytest.importorskip("transformers")

PROMPT_LENS, NEW = (1, 4, 7, 12, 19), 8
TP = {"n_routed_experts": 6, "vocab_size": 98}
FLOAT64 = ("backend=dsv4", "model.dtype=float64", "backend.compute_dtype=float64", "device=cpu")
HISPARSE = ("hisparse.enabled=true", "hisparse.top_k=3", "hisparse.device_buffer_size=4",
            "hisparse.host_to_device_ratio=1.0", "kv.page_size=4", "kv.num_pages=10")


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return saved_reference(tmp_path_factory.mktemp("v4_tp"), 0, PROMPT_LENS, NEW, 1e-6, **TP)


@pytest.fixture(scope="module")
def v4_one_group(tmp_path_factory):
    return saved_reference(tmp_path_factory.mktemp("v4_tp_g1"), 1, PROMPT_LENS, NEW, 1e-6, o_groups=1, **TP)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A release-format folder, two prompts and transformers' greedy tokens (its dequantization of the stored
    tensors): (folder, prompts, tokens)."""
    from dsv4_release import write_release

    folder = tmp_path_factory.mktemp("v4_tp_release") / "release"
    _, ref = write_release(folder, **TP)
    ref = ref.to(torch.float64)
    ref.generation_config.eos_token_id, ref.generation_config.pad_token_id = None, 0
    prompts = [[5, 17, 3, 60, 8], [41, 2, 2, 90, 33, 7, 12, 71, 19]]
    return folder, prompts, greedy_reference(ref, prompts, 6, 1e-6)


def _args(ref, new: int = NEW) -> tuple[str, ...]:
    folder, prompts, _ = ref
    return ("model=hf", f"model.path={folder}", *FLOAT64, *prompt_overrides(folder, prompts, new))


def _outputs(got: dict, n: int) -> list:
    return [got[i] for i in range(n)]


@pytest.fixture(scope="module")
def tp2(one_thread, v4, v4_one_group, release, tmp_path_factory):
    """Every tp=2 run of this module, in one torchrun launch: ``tp2.result(name)`` -> (report, outputs by rid)."""
    return run_tp2_scenarios(tmp_path_factory.mktemp("tp2"), {
        "moe_tp": (*_args(v4), "parallel.moe=tp", "check=off"),
        "moe_ep": (*_args(v4), "parallel.moe=ep", "check=off"),
        "one_group": (*_args(v4_one_group), "parallel.moe=tp", "check=off"),
        "hisparse": (*_args(v4), *HISPARSE, "parallel.moe=ep", "check=off"),
        # stored weights are refused (the fp8 blocks are split), so they are dequantized at load
        "release": (*_args(release, 6), "parallel.moe=tp", "check=off", "model.weights=dequantize"),
    })


@pytest.mark.parametrize("moe", ["tp", "ep"])
def test_tp2_equals_tp1_and_transformers(moe, v4, tp2):
    rep, got = tp2.result(f"moe_{moe}")
    want, margins = tp1(*_args(v4))
    assert_same_tokens(got, want, margins)
    assert _outputs(got, len(PROMPT_LENS)) == v4[2]
    par = rep["parallel"]
    assert (par["tp"], par["moe"], par["backend"]) == (2, moe, "gloo")
    # per decode step: the embedding, 4 layers x (attention + MoE) all-reduces, the logits' all-gather
    assert par["collectives"]["decode"]["count_per_step"] == 10
    full = tp1_weight_bytes(v4)
    assert all(m["weights_bytes"] < full for m in par["memory_per_rank"])  # heads, experts, vocabulary split


def test_one_output_group_split_over_the_ranks(v4_one_group, tp2):
    """``o_groups=1``: tp is a multiple of the groups, so both ranks hold the group's o_a_proj block, each only the
    input columns of its own heads, and their partial group outputs go through o_b_proj before the all-reduce."""
    _, got = tp2.result("one_group")
    assert _outputs(got, len(PROMPT_LENS)) == v4_one_group[2]


def tp1_weight_bytes(ref) -> int:
    from containers import build

    return build(compose_config(*_args(ref), "check=off")).container.model().weight_bytes


def test_hisparse_tp2_ranks_agree_and_equal_transformers(v4, tp2):
    """Every rank offloads the same CSA entries (they are replicated) and makes the same swap-in decisions: the
    run compares the coordinators' digests at the end and fails on any difference."""
    rep, got = tp2.result("hisparse")
    assert _outputs(got, len(PROMPT_LENS)) == v4[2]
    assert rep["hisparse"]["swap_ins"] > 0 and rep["requests"]["retracted"] > 0 and rep["requests"]["lost"] == 0


def test_release_format_tp2_equals_transformers(release, tp2):
    """fp8 attention / shared-expert matrices cut inside their 128 x 128 scale blocks and fp4 experts cut along
    their intermediate dim (moe=tp), each rank reading its slices; transformers' model holds its own
    dequantization of the same stored tensors."""
    _, got = tp2.result("release")
    assert _outputs(got, len(release[1])) == release[2]
