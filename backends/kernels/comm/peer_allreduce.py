"""The one-shot all-reduce over symmetric (CUDA IPC) buffers, and the ``Collectives`` the container gives the model.

* :class:`SymmetricAllReduce`: this rank's buffer (the ledger's workspace ``allreduce_ipc``, allocated by
  PyTorch's symmetric memory, ``torch.distributed._symmetric_memory``, backend ``CUDA``: cuMem allocations mapped
  into every rank's address space, no multicast object: ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``), the peers'
  buffer and signal-pad addresses, and the launchers of :mod:`backends.kernels.comm.comm_kernels`.
* :func:`make_collectives`: ``parallel.allreduce`` resolved (:func:`runtime.core.parallel.resolve_allreduce`),
  the workspace acquired and exchanged when a kernel mode is chosen: built by the container after the ledger and
  before the model, so the buffer's address is fixed before any CUDA graph captures a kernel that reads it.
* :func:`peer_access_problem`: why the ranks cannot use the kernels (validation reports it with the fix).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from backends.kernels.checks import interpreted
from backends.kernels.sm_count import sm_count
from runtime.core.parallel import PEER_WORLD_SIZES, Collectives, resolve_allreduce
from runtime.core.workspace import WorkspaceLedger, WorkspaceSpec

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WORKSPACE = "allreduce_ipc"
MAX_PROGRAMS = 256  # programs per launch at most (and signal-pad slots per barrier)
BLOCK = 2048  # elements per program and chunk of the plain one-shot kernel
MAX_HIDDEN = 16384  # the fused kernel keeps one row in registers


def workspace_spec(parallel: Mapping) -> WorkspaceSpec:
    """The symmetric buffer: ``parallel.ipc_buffer_bytes`` bytes per rank, rounded up to 2 MiB (cuMem granularity)."""
    n = -(-int(parallel["ipc_buffer_bytes"]) // (2 << 20)) * (2 << 20)
    return WorkspaceSpec(WORKSPACE, n, zero_init=True, shareable=False)


def peer_access_problem(tp: int, device_kind: str, local_world_size: int | None = None) -> str | None:
    """Why ``tp`` ranks cannot run the one-shot kernels (None: they can): CUDA, a power of two up to 8, one node,
    every pair of the first ``tp`` GPUs with peer access, PyTorch's symmetric memory and Triton importable."""
    if device_kind != "cuda":
        return f"device {device_kind}: the one-shot kernels read peer GPUs' memory (CUDA IPC); gloo has none"
    if tp not in PEER_WORLD_SIZES:
        return f"parallel.tp={tp}: the kernels take {list(PEER_WORLD_SIZES)} ranks"
    if local_world_size is not None and local_world_size != tp:
        return f"{local_world_size} of the {tp} ranks on this node: the kernels need every rank on one node"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        return f"missing {e.name}: the kernels need PyTorch's symmetric memory and Triton"
    n = torch.cuda.device_count()
    if n < tp:
        return f"{n} GPU(s) visible for {tp} ranks"
    blocked = [(i, j) for i in range(tp) for j in range(tp) if i != j and not torch.cuda.can_device_access_peer(i, j)]
    if blocked:
        return f"no peer access between GPUs {blocked[:4]} (torch.cuda.can_device_access_peer)"
    return None


def planned_bytes(parallel: Mapping, device_kind: str, local_world_size: int | None = None) -> int:
    """Bytes :func:`make_collectives` will acquire for the workspace (0 when the all-reduce runs as NCCL)."""
    tp = int(parallel["tp"])
    ok = tp > 1 and peer_access_problem(tp, device_kind, local_world_size) is None
    mode = resolve_allreduce(parallel["allreduce"], tp, device_kind, ok)
    return 0 if mode == "nccl" else workspace_spec(parallel).nbytes


def _symmetric_empty(group, nbytes: int) -> torch.Tensor:
    """A zeroed uint8 [nbytes] symmetric-memory tensor on this rank's GPU (collective with the rendezvous)."""
    import torch.distributed._symmetric_memory as symm

    try:  # PyTorch's own cuMem backend (NVSHMEM and NCCL's window backends are not used); fixed once per process
        symm.set_backend("CUDA")
    except RuntimeError:  # already set by an earlier runtime of this process
        pass
    need = 2 * MAX_PROGRAMS * group.size * 4  # uint32 flags [2 * MAX_PROGRAMS, world]
    if symm.get_signal_pad_size() < need:
        symm.set_signal_pad_size(need)
    buf = symm.empty(nbytes, dtype=torch.uint8, device=group.device)
    buf.zero_()
    return buf


class SymmetricAllReduce:
    """The one-shot all-reduce and the fused all-reduce + residual add + RMSNorm of :mod:`comm_kernels` (see there).

    Parameters
    ----------
    group : TPGroup
        The ranks (one node, peer access: validation checked); the buffer is exchanged over its process group.
    buffer : torch.Tensor
        uint8 [max_bytes], this rank's symmetric buffer (the workspace ``allreduce_ipc``).
    buffers, pads : torch.Tensor or None
        int64 [world] buffer and signal-pad addresses on the device; None: exchanged here (the rendezvous, a
        collective). The single-process tests pass their own (``sync=False``).
    sync : bool
        Run the barriers (False only in Triton's interpreter tests, which fill the peers' buffers themselves).
    """

    def __init__(self, group, buffer: torch.Tensor, buffers: torch.Tensor | None = None,
                 pads: torch.Tensor | None = None, sync: bool = True):
        from backends.kernels.comm import comm_kernels  # imports triton: only where the kernels run

        self.k, self.rank, self.world, self.device = comm_kernels, group.rank, group.size, buffer.device
        self.max_bytes, self.buffer, self.sync = buffer.numel(), buffer, sync
        if buffers is None:
            buffers, pads, self.handle = self._rendezvous(group, buffer)
        self.buffers, self.pads = buffers, pads
        self.max_programs = MAX_PROGRAMS
        self.sms = sm_count(self.device, 8)

    @staticmethod
    def _rendezvous(group, buffer: torch.Tensor):
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm

        name = dist.group.WORLD.group_name
        if not symm.is_symm_mem_enabled_for_group(name):
            symm.enable_symm_mem_for_group(name)
        handle = symm.rendezvous(buffer, dist.group.WORLD)
        shift = buffer.data_ptr() - handle.buffer_ptrs[group.rank]  # the tensor's place in its allocation
        bufs = torch.tensor([p + shift for p in handle.buffer_ptrs], dtype=torch.int64, device=buffer.device)
        pads = torch.tensor(list(handle.signal_pad_ptrs), dtype=torch.int64, device=buffer.device)
        return bufs, pads, handle

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_contiguous() and x.dtype in DTYPES and x.numel() * x.element_size() <= self.max_bytes
                and x.device == self.device)

    def _grid(self, units: int) -> int:
        return max(1, min(units, self.sms, self.max_programs))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of ``x`` (contiguous, :data:`DTYPES`), a new tensor of its shape."""
        out = torch.empty_like(x)
        n = x.numel()
        if n:
            grid = self._grid(-(-n // BLOCK))
            self.k.oneshot_kernel[(grid,)](x, out, self.buffers, self.pads, n, RANK=self.rank, WORLD=self.world,
                                      BLOCK=BLOCK, MAX_PROGRAMS=self.max_programs, SYNC=self.sync,
                                      num_warps=4 if interpreted(self.k.oneshot_kernel) else 8)
        return out

    def all_reduce_add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """partial, residual [T, D] contiguous (one dtype), weight [D] -> (residual + sum over the ranks of partial,
        RMSNorm of that * weight), both new [T, D] tensors."""
        t, d = partial.shape
        if d > MAX_HIDDEN or not residual.is_contiguous():
            raise ValueError(f"fused all-reduce + RMSNorm: got hidden {d}, residual contiguous "
                             f"{residual.is_contiguous()}; expected hidden <= {MAX_HIDDEN} and a contiguous residual. "
                             "Fix: parallel.allreduce=oneshot")
        res_out, y = torch.empty_like(residual), torch.empty_like(residual)
        if t:
            block = 1 << (d - 1).bit_length()
            self.k.fused_add_rms_norm_kernel[(self._grid(t),)](
                partial, residual, weight, res_out, y, t, d, float(eps), self.buffers, self.pads, RANK=self.rank,
                WORLD=self.world, BLOCK_D=block, MAX_PROGRAMS=self.max_programs, SYNC=self.sync,
                num_warps=4 if interpreted(self.k.fused_add_rms_norm_kernel) else min(16, max(4, block // 512)))
        return res_out, y


def make_collectives(group, ledger: WorkspaceLedger, parallel: Mapping,
                     local_world_size: int | None = None) -> Collectives:
    """The model's collectives: NCCL / gloo only (``parallel.allreduce`` nccl, one rank, or auto where the kernels
    cannot run), else the one-shot kernels over the workspace ``allreduce_ipc`` (acquired here: a collective)."""
    kind = group.device.type
    ok = group.size > 1 and peer_access_problem(group.size, kind, local_world_size) is None
    mode = resolve_allreduce(parallel["allreduce"], group.size, kind, ok)
    if mode == "nccl":
        return Collectives(group, None, "nccl")
    buffer = ledger.acquire(workspace_spec(parallel), "allreduce",
                            allocate=lambda n: _symmetric_empty(group, n))
    peer = SymmetricAllReduce(group, buffer)
    auto = str(parallel["allreduce"]) == "auto"
    return Collectives(group, peer, "auto" if auto else mode, int(parallel["oneshot_max_bytes"]),
                       int(parallel["fused_max_bytes"]))
