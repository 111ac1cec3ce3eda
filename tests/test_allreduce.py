"""``parallel.allreduce`` on the CPU: each mode composes; oneshot / fused are refused where they cannot run (gloo,
no peer access, tp not a power of two) with the reason and ``parallel.allreduce=nccl`` as the fix, all problems at
once; auto falls back to NCCL there; the routing by message size; the vocabulary-parallel greedy top 2; and the
kernels' arithmetic and peer-pointer reads in Triton's interpreter (one process plays every rank: the barriers,
inline PTX, do not run there). The 2-GPU checks are tests/test_allreduce_gpu.py."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import compose_config

import containers
from runtime.app.parallel_checks import parallel_problems
from runtime.core.device import DeviceInfo
from runtime.core.errors import ConfigError
from runtime.core.parallel import FUSED, MULTICAST_OFF, ONESHOT, Collectives, LaunchEnv, SingleRank, resolve_allreduce
from runtime.model.deepseek.ops import TorchOps
from runtime.model.layers import vocab_parallel_top2

ROOT = Path(__file__).resolve().parents[1]
CPU = DeviceInfo("cpu", "cpu", 0, False, None, "cpu")
MODES = ("auto", "nccl", "oneshot", "fused")


def problems(*overrides: str, local_world: int | None = None):
    cfg = containers.to_plain(compose_config("device=cpu", *overrides))
    tp = cfg["parallel"]["tp"]
    return parallel_problems(cfg, LaunchEnv(0, tp, 0, True, local_world), CPU)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_composes_and_one_rank_accepts_it(mode):
    cfg = containers.to_plain(compose_config(f"parallel.allreduce={mode}"))
    assert cfg["parallel"]["allreduce"] == mode
    assert problems(f"parallel.allreduce={mode}") == []


def test_a_typo_in_the_mode_fails_at_compose_time():
    with pytest.raises(Exception, match="allreduce"):
        compose_config("parallel.allreduce=one_shot")


@pytest.mark.parametrize("mode", ["oneshot", "fused"])
def test_kernel_modes_are_refused_on_gloo_with_nccl_as_the_fix(mode):
    found = [str(p) for p in problems("parallel.tp=2", f"parallel.allreduce={mode}")]
    hits = [p for p in found if f"parallel.allreduce={mode}" in p]
    assert len(hits) == 1, found
    assert "gloo" in hits[0] and "parallel.allreduce=nccl" in hits[0]


def test_auto_and_nccl_are_accepted_on_gloo():
    assert problems("parallel.tp=2", "parallel.allreduce=auto") == []
    assert problems("parallel.tp=2", "parallel.allreduce=nccl") == []


def test_every_problem_at_once_including_the_sizes():
    found = [str(p) for p in problems("parallel.tp=2", "parallel.allreduce=fused", "parallel.ipc_buffer_bytes=0",
                                      "parallel.oneshot_max_bytes=-1", "parallel.fused_max_bytes=-2")]
    assert sum("parallel.allreduce=fused" in p for p in found) == 1
    assert sum("parallel.fused_max_bytes" in p and "default 32768" in p for p in found) == 1
    assert sum("parallel.ipc_buffer_bytes" in p for p in found) == 1
    assert sum("parallel.oneshot_max_bytes" in p for p in found) == 1


def test_build_refuses_before_anything_is_allocated():
    """One process asked for tp=2 + fused on the CPU: the world size and the all-reduce, in one error."""
    with pytest.raises(ConfigError) as e:
        containers.build(compose_config("device=cpu", "parallel.tp=2", "parallel.allreduce=fused"))
    msg = str(e.value)
    assert "WORLD_SIZE" in msg and "parallel.allreduce=nccl" in msg


def test_peer_access_reasons(monkeypatch):
    from backends.kernels.comm import peer_allreduce as pa

    assert "gloo" in pa.peer_access_problem(2, "cpu")
    assert "[2, 4, 8]" in pa.peer_access_problem(3, "cuda")
    assert "one node" in pa.peer_access_problem(4, "cuda", local_world_size=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: False)
    assert "no peer access" in pa.peer_access_problem(2, "cuda")
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)
    assert pa.peer_access_problem(2, "cuda") is None
    assert pa.planned_bytes({"tp": 2, "allreduce": "auto", "ipc_buffer_bytes": 3 << 20}, "cuda") == 4 << 20
    assert pa.planned_bytes({"tp": 2, "allreduce": "nccl", "ipc_buffer_bytes": 3 << 20}, "cuda") == 0


def test_resolve():
    assert resolve_allreduce("auto", 2, "cpu", False) == "nccl"
    assert resolve_allreduce("auto", 2, "cuda", True) == "fused"
    assert resolve_allreduce("auto", 2, "cuda", False) == "nccl"
    assert resolve_allreduce("auto", 6, "cuda", True) == "nccl"
    assert resolve_allreduce("fused", 1, "cuda", True) == "nccl"
    assert resolve_allreduce("oneshot", 2, "cuda", True) == "oneshot"


def test_multicast_is_switched_off_in_the_environment():
    env = {"NCCL_NVLS_ENABLE": "1"}
    from runtime.core.parallel import multicast_off

    multicast_off(env)
    assert env == MULTICAST_OFF == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    text = (ROOT / "scripts" / "tp_device.sh").read_text()
    assert "NCCL_NVLS_ENABLE=0" in text and "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in text
    for name in ("comm_kernels.py", "peer_allreduce.py"):  # the code, docstrings and comments left out
        tree = ast.parse((ROOT / "backends" / "kernels" / "comm" / name).read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                body.pop(0)
        code = ast.unparse(tree)
        assert not any(w in code for w in ("multimem", "ulticast", "multimem_all_reduce", "NVLS")), name


# ------------------------------------------------------------------------------------------ routing (fakes)
class FakeGroup(SingleRank):
    """Two 'ranks' that are this process: all_reduce doubles (the sum of two equal inputs)."""

    size, backend = 2, "fake"

    def all_reduce(self, x):
        self.stats.run("all_reduce", x, x.numel() * x.element_size(), lambda: x.mul_(2))
        return x


class FakePeer:
    max_bytes = 4096

    def fits(self, x):
        return x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def all_reduce(self, x):
        return x * 2

    def all_reduce_add_rms_norm(self, partial, residual, weight, eps):
        return TorchOps().add_rms_norm(residual, partial * 2, weight, eps)


@pytest.mark.parametrize("mode,small,middle,large", [("nccl", "all_reduce", "all_reduce", "all_reduce"),
                                                     ("oneshot", ONESHOT, ONESHOT, "all_reduce"),
                                                     ("fused", FUSED, FUSED, "all_reduce"),
                                                     ("auto", FUSED, ONESHOT, "all_reduce")])
def test_routing_by_size_gives_the_same_sums(mode, small, middle, large):
    """auto: the fused kernel up to fused_max_bytes (512 B here), the one-shot kernel and the norm up to
    oneshot_max_bytes (2 KiB), NCCL above; fused: the fused kernel wherever the buffer takes the message."""
    g = FakeGroup(torch.device("cpu"))
    c = Collectives(g, None if mode == "nccl" else FakePeer(), mode, oneshot_max_bytes=2048, fused_max_bytes=512)
    ops, w = TorchOps(), torch.randn(16)
    for rows, op in ((4, small), (16, middle), (80, large)):  # 4 x 16 x 4 bytes = 256 B, 1 KiB; 5 KiB: above the buffer
        x, p = torch.randn(rows, 16), torch.randn(rows, 16)
        want = ops.add_rms_norm(x, p * 2, w, 1e-6)
        got = c.reduce_add_rms_norm(x, p.clone(), w, 1e-6, ops)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert g.stats.take().ops[-1][0] == op
    assert c.reduce_add_rms_norm(x, None, w, 1e-6, ops)[0] is x  # no partial: the norm alone, no collective
    assert g.stats.take().count == 0
    y = torch.randn(8)
    assert torch.equal(c.all_reduce(y.clone()), y * 2)
    assert g.stats.take().ops[0][0] == ("all_reduce" if mode == "nccl" else ONESHOT)


def test_vocab_parallel_top2_equals_the_full_vocabulary():
    """Two 'ranks' of a 10-token vocabulary (each its slice): the gathered top 2 of each rank's slice equals the
    top 2 over the full logits."""
    torch.manual_seed(0)
    full = torch.randn(5, 10)

    class Gather:
        size = 2

        def all_gather(self, x, dim=-1):
            return torch.cat([parts[0], parts[1]], dim=dim)

    parts = [None, None]
    out = []
    for r in range(2):  # both ranks' contributions first, then each rank's answer
        local = full[:, 5 * r:5 * r + 5]
        v, i = torch.topk(local, 2, dim=-1)
        parts[r] = torch.cat([v, (i + 5 * r).float()], dim=-1)
    for r in range(2):
        out.append(vocab_parallel_top2(full[:, 5 * r:5 * r + 5], 5 * r, Gather()))
    want = torch.topk(full, 2, dim=-1)
    for v, i in out:
        assert torch.equal(v, want.values) and torch.equal(i, want.indices)
    v, i = vocab_parallel_top2(full, 0, SingleRank(torch.device("cpu")))
    assert torch.equal(i, want.indices)


# ------------------------------------------------------------------------------------------ kernels, interpreted
_INTERPRETED = r'''
import sys, torch
from types import SimpleNamespace
from backends.kernels.comm.peer_allreduce import SymmetricAllReduce
torch.manual_seed(0)
world, bad = int(sys.argv[1]), []
for dt in (torch.float32, torch.bfloat16):
    for t, d in ((1, 64), (3, 100), (17, 64)):
        parts = [torch.randn(t, d).to(dt) for _ in range(world)]
        bufs = [torch.zeros(1 << 16, dtype=torch.uint8) for _ in range(world)]
        table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        for r in range(1, world):  # the other ranks' copies (rank 0's kernel copies its own)
            bufs[r][: parts[r].numel() * parts[r].element_size()].copy_(parts[r].reshape(-1).view(torch.uint8))
        ar = SymmetricAllReduce(SimpleNamespace(rank=0, size=world), bufs[0], table, torch.zeros_like(table),
                                sync=False)
        exact = sum(p.float() for p in parts)
        # the interpreter rounds float32 -> bfloat16 by truncation: one bfloat16 step of slack there
        tol = 0.0 if dt == torch.float32 else 2.0 ** -7
        out = ar.all_reduce(parts[0])
        if not torch.allclose(out.float(), exact.to(dt).float(), rtol=tol, atol=tol * 4):
            bad.append(("oneshot", dt, t, d))
        res, w = torch.randn(t, d).to(dt), (torch.rand(d) + 0.5).to(dt)
        r_out, y = ar.all_reduce_add_rms_norm(parts[0], res, w, 1e-6)
        r_ref = res + exact.to(dt)
        xf = r_ref.float()
        y_ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt) * w
        if not torch.allclose(r_out.float(), r_ref.float(), rtol=tol, atol=tol * 8):
            bad.append(("fused residual", dt, t, d))
        if not torch.allclose(y.float(), y_ref.float(), rtol=2 * tol, atol=tol * 16 + 1e-6):
            bad.append(("fused norm", dt, t, d))
        if not torch.equal(bufs[0][: parts[0].numel() * parts[0].element_size()],
                           parts[0].reshape(-1).view(torch.uint8)):
            bad.append(("copy-in", dt, t, d))
print("BAD", bad)
sys.exit(1 if bad else 0)
'''


@pytest.mark.parametrize("world", [2, 4])
def test_kernels_sum_peer_buffers_in_the_interpreter(world):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _INTERPRETED, str(world)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]


def test_collectives_of_one_rank_are_the_group_itself():
    rt = containers.build(compose_config("device=cpu", "check=off", "parallel.allreduce=fused"))
    c = rt.container.collectives()
    assert (c.mode, c.peer, c.size) == ("nccl", None, 1)
    assert rt.container.workspace_ledger().report()["allreduce_ipc"] == 0
    assert "collectives" in rt.build_order and rt.build_order.index("collectives") < rt.build_order.index("model")
