"""Every refusal of a tensor-parallel configuration, before anything is allocated or any process group started:
each names what, what it got, what it expected and the fix; all of them at once."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import compose_config
from dependency_injector import providers

import containers
from runtime.app.parallel_checks import parallel_problems, rank_view
from runtime.core.device import DeviceInfo
from runtime.core.errors import ConfigError
from runtime.core.parallel import LaunchEnv

CPU = DeviceInfo("cpu", "cpu", 0, False, None, "cpu")
V4 = ("model=deepseek_v4_flash", "backend=dsv4")
MOE = ("model.mlp=deepseek", "model.intermediate_size=128", "model.moe_intermediate_size=64",
       "model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.n_shared_experts=1",
       "model.first_k_dense_replace=1")


def problems(*overrides: str, world: int | None = None, device: DeviceInfo = CPU, local_rank: int = 0):
    cfg = containers.to_plain(compose_config("device=cpu", *overrides))
    tp = cfg["parallel"]["tp"]
    launch = LaunchEnv(rank=0, world_size=tp if world is None else world, local_rank=local_rank, launched=True)
    return parallel_problems(cfg, launch, device)


def one(found, fragment: str):
    hits = [p for p in found if fragment in str(p)]
    assert len(hits) == 1, f"{fragment!r} in {[str(p) for p in found]}"
    return str(hits[0])


def test_a_valid_tp2_config_has_no_problem():
    assert problems("parallel.tp=2", *MOE) == []
    assert problems("parallel.tp=2", "parallel.moe=ep", *MOE) == []
    for tp in (2, 4, 8, 16):  # DeepSeek-V4-Flash: 64 heads in 8 output groups, 256 experts of width 2048
        assert problems(f"parallel.tp={tp}", *V4) == [] and problems(f"parallel.tp={tp}", "parallel.moe=ep", *V4) == []


def test_world_size_must_equal_tp_and_the_fix_is_the_torchrun_command():
    cfg = containers.to_plain(compose_config("device=cpu", "parallel.tp=2"))
    msg = str(parallel_problems(cfg, LaunchEnv(), CPU)[0])
    assert "one process (started without torchrun)" in msg and "torchrun --nproc-per-node 2 -m runtime parallel.tp=2" in msg
    msg = one(problems("parallel.tp=1", world=2), "WORLD_SIZE=2")
    assert "set parallel.tp=2" in msg


@pytest.mark.parametrize("overrides,fragment,fix", [
    (("parallel.tp=3",), "model.num_heads: got 4, not divisible by parallel.tp=3", "parallel.tp in [1, 2, 4]"),
    (("parallel.tp=2", "model.vocab_size=511"), "model.vocab_size: got 511", "the embedding and LM head"),
    (("parallel.tp=2", *MOE, "model.intermediate_size=127"), "model.intermediate_size: got 127", "dense MLP"),
    (("parallel.tp=2", *MOE, "model.moe_intermediate_size=63"), "model.moe_intermediate_size (parallel.moe=tp)",
     "or parallel.moe=ep"),
    (("parallel.tp=2", *MOE, "parallel.moe=ep", "model.n_routed_experts=3", "model.num_experts_per_tok=1"),
     "model.n_routed_experts (parallel.moe=ep): got 3", "or parallel.moe=tp"),
    (("parallel.tp=2", *MOE, "parallel.moe=ep", "model.moe_intermediate_size=63"), "shared experts' intermediate",
     "parallel.tp in"),
    (("parallel.tp=2", "model=ring_hybrid_tiny"), "linear-attention layers", "use parallel.tp=1 for hybrid models"),
    (("parallel.tp=2", "+dump_dir=/tmp/x"), "+dump_dir", "drop +dump_dir"),
    (("parallel.tp=4", *V4, "model.num_heads=48", "model.v4.o_groups=6"), "model.v4.o_groups: got 6 with "
     "parallel.tp=4; expected o_groups a multiple of tp", "use parallel.tp in [1, 2, 3, 6, 12, 24, 48]"),
    (("parallel.tp=3", *V4), "model.num_heads: got 64, not divisible by parallel.tp=3",
     "parallel.tp in [1, 2, 4, 8, 16, 32, 64]"),
    (("parallel.tp=2", *V4, "model.moe_intermediate_size=2047"),
     "model.moe_intermediate_size (parallel.moe=tp: routed and shared experts): got 2047", "or parallel.moe=ep"),
    (("parallel.tp=4", *V4, "parallel.moe=ep", "model.n_routed_experts=254"),
     "model.n_routed_experts (parallel.moe=ep): got 254", "parallel.tp in [1, 2], or parallel.moe=tp"),
    (("parallel.tp=2", *V4, "parallel.moe=ep", "model.moe_intermediate_size=2047"),
     "the shared expert's intermediate size (model.moe_intermediate_size): got 2047", "split by its width"),
    (("parallel.tp=2", *V4, "model.vocab_size=129281"), "model.vocab_size: got 129281", "split by vocabulary"),
    (("parallel.tp=0",), "parallel.tp: got 0", "set parallel.tp=1"),
])
def test_each_refusal_names_the_fix(overrides, fragment, fix):
    msg = one(problems(*overrides), fragment)
    assert "Fix:" in msg and fix in msg, msg


def test_a_gpu_per_local_rank():
    gpu = DeviceInfo("cuda", "cuda", 0, True, (9, 0), "fake H100", 132)
    found = problems("parallel.tp=2", device=gpu, local_rank=64)
    assert "LOCAL_RANK 64" in one(found, "GPU(s) visible on this node")


def test_every_problem_at_once_and_nothing_built():
    found = problems("parallel.tp=3", "model.vocab_size=512", *MOE, "parallel.moe=ep", "+dump_dir=/tmp/x", world=2)
    text = "\n".join(map(str, found))
    for fragment in ("WORLD_SIZE=2", "model.num_heads", "model.vocab_size", "model.intermediate_size",
                     "model.n_routed_experts", "shared experts", "+dump_dir"):
        assert fragment in text, fragment
    container = containers.Container()
    container.launch.override(providers.Object(LaunchEnv(world_size=3, launched=True)))
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config("device=cpu", "parallel.tp=3"), container=container)
    assert "model.num_heads" in str(e.value) and container.build_log().names == []


def test_backends_see_this_ranks_heads():
    """The attention backend's own rules apply to the heads one rank runs (128 heads at tp=2: 64 per rank)."""
    cfg = containers.to_plain(compose_config("device=cpu", "model=deepseek_v3", "parallel.tp=2"))
    assert rank_view(cfg)["model"]["num_heads"] == 64 and cfg["model"]["num_heads"] == 128


def test_dsv4_every_problem_at_once_and_its_backend_sees_this_ranks_heads_and_groups():
    """V4 at tp=4 with 48 heads in 6 output groups and 6 experts under moe=ep: heads divide, but a rank would hold
    neither whole groups nor one group's share, nor whole experts; the validation of the whole config lists them
    together. Each rank's view: its heads and groups (the V4 checks of heads / groups and the backends' head rules
    apply to it)."""
    view = rank_view(containers.to_plain(compose_config("device=cpu", *V4, "parallel.tp=4")))["model"]
    assert (view["num_heads"], view["v4"]["o_groups"]) == (16, 2)
    view = rank_view(containers.to_plain(compose_config("device=cpu", *V4, "parallel.tp=16")))["model"]
    assert (view["num_heads"], view["v4"]["o_groups"]) == (4, 1)  # two ranks share each group
    bad = (*V4, "parallel.tp=4", "model.num_heads=48", "model.v4.o_groups=6")
    unchanged = rank_view(containers.to_plain(compose_config("device=cpu", *bad)))["model"]
    assert (unchanged["num_heads"], unchanged["v4"]["o_groups"]) == (48, 6)  # the split is refused: whole view
    found = problems(*bad, "parallel.moe=ep", "model.n_routed_experts=6", "model.num_experts_per_tok=4", world=2)
    text = "\n".join(map(str, found))
    for fragment in ("WORLD_SIZE=2", "model.v4.o_groups: got 6", "model.n_routed_experts (parallel.moe=ep): got 6"):
        assert fragment in text, fragment
    assert "model.num_heads" not in text and len(found) == 3
    container = containers.Container()
    container.launch.override(providers.Object(LaunchEnv(world_size=4, launched=True)))
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config("device=cpu", *bad), container=container)
    assert "model.v4.o_groups" in str(e.value) and container.build_log().names == []


def test_cli_refuses_tp2_without_torchrun(tmp_path):
    p = subprocess.run([sys.executable, "-m", "runtime", "device=cpu", "parallel.tp=2", f"hydra.run.dir={tmp_path}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "torchrun --nproc-per-node 2 -m runtime parallel.tp=2" in p.stderr, p.stderr
