"""One rank of tests/test_allreduce_gpu.py (``torchrun --nproc-per-node N tests/allreduce_worker.py``): the one-shot
and fused kernels against NCCL's sums, eagerly and replayed in CUDA graphs, bf16 and float32, 1..512 tokens of
7168 (and an odd width), then a burst of back-to-back calls of mixed sizes (a barrier that lost a flag would hang:
the test's timeout catches it). Prints ``ALLREDUCE_GPU_OK`` on rank 0 when every rank agrees, else the failures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.core.parallel import MULTICAST_OFF  # noqa: E402

os.environ.update(MULTICAST_OFF)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from backends.kernels.comm.peer_allreduce import make_collectives  # noqa: E402
from backends.kernels.decoder import decoder_ops  # noqa: E402
from runtime.core.parallel import LaunchEnv, make_group  # noqa: E402
from runtime.core.workspace import WorkspaceLedger  # noqa: E402

TOKENS = (1, 3, 17, 64, 512)


def nccl_sum(x: torch.Tensor) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y)
    return y


def close(got: torch.Tensor, want: torch.Tensor, dt: torch.dtype, world: int) -> bool:
    if world == 2 and got.shape == want.shape and torch.equal(got, want):
        return True  # two ranks: one rounding of a + b either way
    tol = 1e-5 if dt == torch.float32 else 2 ** -7
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def main() -> int:
    launch = LaunchEnv.from_environ()
    group = make_group(launch.world_size, "cuda", 0, launch)
    dev, rank, world = group.device, group.rank, group.size
    coll = make_collectives(group, WorkspaceLedger(dev), {"tp": world, "allreduce": "fused",
                                                          "oneshot_max_bytes": 1 << 30, "fused_max_bytes": 1 << 30,
                                                          "ipc_buffer_bytes": 16 << 20}, launch.local_world_size)
    peer, bad = coll.peer, []
    assert peer is not None, "the kernels did not build"
    for dt in (torch.bfloat16, torch.float32):
        for t in TOKENS:
            for d in (7168, 1000):
                g = torch.Generator(device=dev).manual_seed(1000 * t + d + rank)
                part = torch.randn(t, d, device=dev, generator=g).to(dt)
                g.manual_seed(7 * t + d)  # the same residual and weight on every rank
                res = torch.randn(t, d, device=dev, generator=g).to(dt)
                w = (torch.rand(d, device=dev, generator=g) + 0.5).to(dt)
                want = nccl_sum(part)
                if not close(peer.all_reduce(part), want, dt, world):
                    bad.append(f"oneshot {dt} {t}x{d}")
                r_want, y_want = decoder_ops.add_rms_norm(res, want, w, 1e-6)
                r_got, y_got = peer.all_reduce_add_rms_norm(part, res, w, 1e-6)
                if not (close(r_got, r_want, dt, world) and close(y_got, y_want, dt, 1 << 9)):
                    bad.append(f"fused {dt} {t}x{d}: residual {(r_got.float() - r_want.float()).abs().max():.3g} "
                               f"norm {(y_got.float() - y_want.float()).abs().max():.3g}")
    # CUDA graphs: capture both kernels on static tensors, replay with fresh data
    for dt in (torch.bfloat16, torch.float32):
        for t in (1, 17, 64):
            part = torch.zeros(t, 7168, device=dev, dtype=dt)
            res, w = torch.zeros_like(part), torch.ones(7168, device=dev, dtype=dt)
            s = torch.cuda.Stream(dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                peer.all_reduce(part)
                peer.all_reduce_add_rms_norm(part, res, w, 1e-6)
            torch.cuda.current_stream(dev).wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            dist.barrier()
            with torch.cuda.graph(graph):
                out = peer.all_reduce(part)
                r_out, y_out = peer.all_reduce_add_rms_norm(part, res, w, 1e-6)
            for i in range(3):
                g = torch.Generator(device=dev).manual_seed(i * 100 + t + rank)
                part.copy_(torch.randn(t, 7168, device=dev, generator=g).to(dt))
                res.copy_(torch.randn(t, 7168, device=dev, generator=torch.Generator(device=dev).manual_seed(i)))
                graph.replay()
                want = nccl_sum(part)
                r_want, y_want = decoder_ops.add_rms_norm(res, want, w, 1e-6)
                if not (close(out, want, dt, world) and close(r_out, r_want, dt, world)
                        and close(y_out, y_want, dt, 1 << 9)):
                    bad.append(f"graph replay {i} {dt} {t} tokens")
    # a burst of back-to-back calls of mixed sizes and kernels (no host sync in between)
    xs = [torch.full((t, 7168), float(rank + 1), device=dev, dtype=torch.bfloat16) for t in (1, 64, 3, 512, 17)]
    outs = []
    for i in range(200):
        x = xs[i % len(xs)]
        outs.append(peer.all_reduce(x) if i % 2 else peer.all_reduce_add_rms_norm(x, x, xs[0][0], 1e-6)[0])
    total = world * (world + 1) / 2
    for i, o in enumerate(outs):
        want = total if i % 2 else total + (rank + 1)
        if not torch.all(o.float() == want):
            bad.append(f"burst call {i}: got {o.float().unique()[:4].tolist()}, want {want}")
            break
    torch.cuda.synchronize(dev)
    every = group.gather_objects(bad)
    if rank == 0:
        flat = [f"rank {r}: {b}" for r, bs in enumerate(every) for b in bs]
        print("\n".join(flat) if flat else "ALLREDUCE_GPU_OK")
    dist.destroy_process_group()
    return 1 if any(every) else 0


if __name__ == "__main__":
    sys.exit(main())
