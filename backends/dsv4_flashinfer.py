"""``backend=dsv4 backend.impl=flashinfer``: V4 decode through FlashInfer's ``trtllm_batch_decode_sparse_mla_dsv4``.

Where it runs (class data, :data:`DECODE_IMPLS`): SM100 / SM103 (TRT-LLM-gen kernels) and SM120 / SM121 (FlashInfer's
own sparse-MLA path behind the same function); bfloat16; head_dim 512; 8, 16, 32, 64 or 128 heads; sliding window
128 (the kernel's SWA tile is fixed to 128 columns). **It has not run on Blackwell hardware**: the contract was
read from FlashInfer's source and is exercised on the CPU through the emulation
(:mod:`backends.kernels.dsv4.emulated_dsv4`, ``backend.kernel=emulate``).

Argument preparation per decode step and layer (:meth:`FlashInferDecode.decode`), from what the dsv4 backend
already planned for its Triton path (window ring rows, compressed rows and their -1-padded indices):

* ``swa_kv_cache``: the layer's window ring ``[max_requests + 1, 128, 512]`` as it is (page = request row, page
  size = the window); SWA columns = the ring rows of positions ``P, P - 1, ...`` (newest first; the kernel
  attends to the first ``min(seq_len, 128)``), padding 0;
* ``compressed_kv_cache``: CSA: the pool's ``[num_pages, page_size, 512]`` buffer (with HiSparse: the
  coordinator's device buffer ``[max_requests + 1, device_buffer_size, 512]``); HCA: its pool; sliding layers:
  the ring again (no compressed columns are active);
* compressed columns: the selected (CSA) or all (HCA) entries' physical rows, moved to the front, padding 0;
  capacity rounded up to a multiple of 4; ``sparse_topk_lens`` = 128 + the request's entry count;
* ``seq_lens`` = position + 1 (int32), ``bmm1_scale`` = the softmax scale, ``bmm2_scale`` = 1, ``sinks`` float32,
  ``kv_layout="HND"``, ``out`` bf16 ``[B, 1, H, 512]``;
* ``workspace_buffer``: this backend's own zero-initialised ``dsv4_flashinfer_workspace`` from the ledger.

Extend (prefill) stays on the torch path. FlashInfer is imported only by :func:`load_kernel`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from backends.kernels.dsv4.emulated_dsv4 import HEADS, SWA_COLUMNS
from runtime.core.errors import Problem
from runtime.core.workspace import WorkspaceLedger, WorkspaceSpec

WORKSPACE = "dsv4_flashinfer_workspace"


def load_kernel() -> Callable:
    """The real kernel (imports FlashInfer; only built when impl=flashinfer with backend.kernel=real)."""
    from flashinfer.mla import trtllm_batch_decode_sparse_mla_dsv4

    return trtllm_batch_decode_sparse_mla_dsv4


@dataclass(frozen=True)
class DecodeImpl:
    """Where one ``backend.impl`` of the dsv4 backend runs (its decode sets the gate), and what else it runs.

    devices : "cpu" / "cuda"; compute_capabilities : the exact GPU families (None: any CUDA GPU);
    interpreter : runs on the CPU under TRITON_INTERPRET=1; emulation : ``backend.kernel=emulate`` lifts the
    hardware gate; packages : Python modules the real path imports; triton_extend : extend runs through the
    Triton extend kernel (else torch; HiSparse CSA layers always torch: they read the host); triton_indexer : the
    indexer runs through the DSA scoring kernel where the indexer head width allows (else batched torch).
    """

    devices: frozenset[str]
    compute_capabilities: frozenset[tuple[int, int]] | None = None
    interpreter: bool = False
    emulation: bool = False
    packages: tuple[str, ...] = ()
    triton_extend: bool = False
    triton_indexer: bool = False

    def runs_on(self, kind: str, cc: tuple[int, int] | None, interpreted: bool) -> bool:
        if kind == "cpu":
            return "cpu" in self.devices or (self.interpreter and interpreted)
        return "cuda" in self.devices and (self.compute_capabilities is None or cc in self.compute_capabilities)

    def requirement(self) -> str:
        if self.compute_capabilities is None:
            return "a CUDA GPU" + (" (or TRITON_INTERPRET=1 on the CPU)" if self.interpreter else "")
        return "a GPU of compute capability " + " / ".join(f"{a}.{b}" for a, b in sorted(self.compute_capabilities))


# SM100 / SM103 (B200, GB200 / B300, GB300) and SM120 / SM121 (RTX PRO 6000 Blackwell, DGX Spark)
BLACKWELL = frozenset({(10, 0), (10, 3), (12, 0), (12, 1)})
DECODE_IMPLS: dict[str, DecodeImpl] = {
    "torch": DecodeImpl(frozenset({"cpu", "cuda"})),
    "triton": DecodeImpl(frozenset({"cuda"}), interpreter=True, triton_extend=True, triton_indexer=True),
    "flashinfer": DecodeImpl(frozenset({"cuda"}), BLACKWELL, emulation=True, packages=("flashinfer",)),
}


def flashinfer_problems(backend_cfg: dict, model_cfg: dict, device, interpreted: bool) -> list[Problem]:
    """impl=flashinfer: the GPU (unless emulated), then the kernel's shape and dtype contract, all listed."""
    out, impl = [], DECODE_IMPLS["flashinfer"]
    kernel = str(backend_cfg.get("kernel", "real"))
    if kernel not in ("real", "emulate"):
        out.append(Problem("backend.kernel", repr(kernel), "real or emulate", "set backend.kernel=real"))
    cc = device.compute_capability
    if kernel != "emulate" and not impl.runs_on(device.kind, cc, interpreted):
        found = f"GPU {device.name} (compute capability {cc[0]}.{cc[1]})" if device.kind == "cuda" and cc \
            else f"device {device.kind}"
        here = [n for n, i in DECODE_IMPLS.items() if i.runs_on(device.kind, cc, interpreted)]
        out.append(Problem("backend.impl=flashinfer", found,
                           f"{impl.requirement()} (FlashInfer's trtllm_batch_decode_sparse_mla_dsv4)",
                           f"use backend.impl={' or '.join(here)} (they run here), or backend.kernel=emulate "
                           "(a torch emulation of the kernel's contract, for tests)"))
    v4 = model_cfg.get("v4") or {}
    if str(model_cfg["dtype"]) != "bfloat16":
        out.append(Problem("backend.impl=flashinfer", f"model.dtype={model_cfg['dtype']}",
                           "bfloat16 (the kernel's bf16 path; fp8 KV is not wired)", "set model.dtype=bfloat16"))
    if v4.get("head_dim") != 512:
        out.append(Problem("backend.impl=flashinfer", f"model.v4.head_dim={v4.get('head_dim')}", "512",
                           "use backend.impl=triton or torch"))
    if model_cfg["num_heads"] not in HEADS:
        out.append(Problem("backend.impl=flashinfer", f"model.num_heads={model_cfg['num_heads']}",
                           f"one of {list(HEADS)}", "use backend.impl=triton or torch"))
    if v4.get("sliding_window") != SWA_COLUMNS:
        out.append(Problem("backend.impl=flashinfer", f"model.v4.sliding_window={v4.get('sliding_window')}",
                           f"{SWA_COLUMNS} (the kernel's SWA tile is fixed)", "use backend.impl=triton or torch"))
    if int(backend_cfg.get("workspace_bytes", 1)) < 1:
        out.append(Problem("backend.workspace_bytes", str(backend_cfg.get("workspace_bytes")), ">= 1",
                           "set backend.workspace_bytes=134217728"))
    return out


def _front(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, K] int32 rows, -1 padding -> (the valid ones moved to the front, padding 0; their count [B])."""
    valid = idx >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return torch.where(valid.gather(1, order), idx.gather(1, order), 0), valid.sum(dim=1)


def workspace_spec(backend_cfg: dict) -> WorkspaceSpec:
    """The kernel's own zero-initialised workspace (uint8 [backend.workspace_bytes]), unshared."""
    return WorkspaceSpec(WORKSPACE, int(backend_cfg["workspace_bytes"]), zero_init=True, shareable=False)


class FlashInferDecode:
    """Prepares the arguments of ``trtllm_batch_decode_sparse_mla_dsv4`` and calls the injected ``kernel``."""

    def __init__(self, kernel: Callable, ledger: WorkspaceLedger, config: dict):
        self.kernel = kernel
        self.workspace = ledger.acquire(workspace_spec(config), "dsv4")

    def decode(self, q: torch.Tensor, ring: torch.Tensor, win_idx: torch.Tensor, cmp_pages: torch.Tensor,
               cmp_idx: torch.Tensor, sinks: torch.Tensor, sm_scale: float, positions: torch.Tensor) -> torch.Tensor:
        """q [B, H, 512]; ring [rows, 128, 512] (the new rows already written); win_idx [B, 128] int32 ring
        rows of positions P - 127 .. P (-1 before 0); cmp_pages [pages, page_size, 512]; cmp_idx [B, K] int32
        rows of ``cmp_pages`` viewed flat (-1 padding) -> [B, H, 512] in q's dtype."""
        b, h, d = q.shape
        swa = win_idx.flip(1)  # newest first: the kernel attends to the first min(seq_len, 128) columns
        swa = torch.where(swa >= 0, swa, 0)
        cmp, count = _front(cmp_idx)
        width = -(-cmp.shape[1] // 4) * 4
        cmp = torch.nn.functional.pad(cmp, (0, width - cmp.shape[1]))
        out = torch.empty(b, 1, h, d, dtype=torch.bfloat16, device=q.device)
        self.kernel(
            query=q.view(b, 1, h, d), swa_kv_cache=ring, workspace_buffer=self.workspace,
            sparse_indices=torch.cat([swa, cmp], dim=1).to(torch.int32).contiguous(), compressed_kv_cache=cmp_pages,
            sparse_topk_lens=(SWA_COLUMNS + count).to(torch.int32), seq_lens=(positions + 1).to(torch.int32),
            out=out, bmm1_scale=float(sm_scale), bmm2_scale=1.0, sinks=sinks.float().contiguous(), kv_layout="HND",
        )
        return out.view(b, h, d).to(q.dtype)
