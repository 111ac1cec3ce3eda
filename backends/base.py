"""What an attention backend is: a Protocol, its capabilities as class data, and the typed hooks.

Every hook takes exactly one argument, the batch. Backend-specific switches are constructor config, never
per-call arguments. The runtime decides what to do from ``capabilities`` (data), never from ``isinstance``
or ``hasattr``.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.workspace import WorkspaceInputs, WorkspaceSpec

DRAFT_INSTANCE = "draft{i}"  # the name of speculative draft step i's backend instance (its own workspaces)


class CudaGraphLevel(enum.IntEnum):
    """How much of a forward mode a backend can run inside a captured CUDA graph (vLLM's ordering)."""

    NEVER = 0
    SINGLE_TOKEN_DECODE = 1  # one new token per request
    UNIFORM_BATCH = 2  # every request has the same number of new tokens
    ALWAYS = 3


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do; read by validation, the container and the graph runner.

    Attributes
    ----------
    forward_modes : frozenset of ForwardMode
    cuda_graph : tuple of (ForwardMode, CudaGraphLevel)
        Graph level per mode; a mode not listed is NEVER.
    graph_impls : frozenset of str or None
        The ``backend.impl`` values whose steps run inside a graph (``auto`` counts as its CUDA choice, which must
        be listed); None: every impl, or the backend has no ``impl`` switch. Validation refuses the others.
    mha_chunked_prefill : bool
        Implements :class:`MHAChunkPrefill` (decompressed-KV ragged prefill with prefix chunks).
    sparse : bool
        Attends to top-k selected tokens (DeepSeek sparse attention); may be used with HiSparse.
    builds_own_kv_indices : bool
        ``init_forward_metadata`` builds its own kv indices (from ``req_to_token``). When false, the backend
        reads ``batch.kv_page_table``, which the multi-step draft backend fills for every draft step with one
        shared kv-indices pass; for backends that build their own, that pass is skipped.
    page_sizes : frozenset of int or None
        Page sizes the kernels accept; None means any.
    min_compute_capability : tuple of int or None
        Lowest CUDA compute capability (major, minor); None when the backend also runs on the CPU.
    compute_capabilities : frozenset of (int, int) or None
        The exact GPU families the kernels are built for (e.g. SM100 and SM103 are (10, 0) and (10, 3));
        None means every GPU from ``min_compute_capability`` on.
    dtypes : frozenset of torch.dtype
        Model (query) dtypes the kernels accept.
    kv_dtypes : frozenset of str
        ``kv.dtype`` values the kernels read: "auto" (the model dtype) and/or "fp8_e4m3" (dequantized in the
        kernels with the per-tensor ``kv.scale``).
    fp8_kv_model_dtypes : frozenset of torch.dtype or None
        Model dtypes allowed with an fp8 cache (None: every dtype in ``dtypes``).
    fp8_kv_gpu_major : int or None
        The GPU compute-capability major an fp8 cache needs (None: any the backend runs on).
    devices : frozenset of str
        "cpu" and/or "cuda".
    workspaces : frozenset of str
        Ledger workspaces the backend consumes (``flashinfer_float`` is the shared FlashInfer buffer).
    packages : tuple of str
        Python modules the backend imports (checked at validation, with the install fix).
    install : str
        The install command validation prints when a package is missing.
    model_families : frozenset of str
        The attention the backend computes: "mla" (DeepSeek-V2/V3/V3.2 latent attention, also the full layers
        of hybrid models) and/or "dsv4" (DeepSeek-V4: sliding window + compressed entries + sinks).
    emulation : bool
        ``backend.kernel=emulate`` replaces the kernel call with a torch emulation of its calling contract
        (same layouts, block tables, scales, workspace arguments). It lifts the hardware gate (devices, compute
        capability, packages) and the kernel's dtype restriction, for tests on the CPU and on older GPUs.
    """

    forward_modes: frozenset[ForwardMode]
    cuda_graph: tuple[tuple[ForwardMode, CudaGraphLevel], ...] = ()
    graph_impls: frozenset[str] | None = None
    mha_chunked_prefill: bool = False
    sparse: bool = False
    builds_own_kv_indices: bool = False
    page_sizes: frozenset[int] | None = None
    min_compute_capability: tuple[int, int] | None = None
    dtypes: frozenset[torch.dtype] = field(
        default_factory=lambda: frozenset({torch.bfloat16, torch.float16, torch.float32})
    )
    kv_dtypes: frozenset[str] = frozenset({"auto"})
    fp8_kv_model_dtypes: frozenset[torch.dtype] | None = None
    fp8_kv_gpu_major: int | None = None
    devices: frozenset[str] = frozenset({"cuda"})
    workspaces: frozenset[str] = frozenset()
    packages: tuple[str, ...] = ()
    install: str = "pip install 'mla-runtime[gpu]' (on a CUDA machine)"
    compute_capabilities: frozenset[tuple[int, int]] | None = None
    emulation: bool = False
    model_families: frozenset[str] = frozenset({"mla"})

    def runs_on(self, kind: str, capability: tuple[int, int] | None) -> bool:
        """Whether the real kernels run on a device of this kind ("cpu" / "cuda") and compute capability."""
        if kind not in self.devices:
            return False
        if kind != "cuda" or capability is None:
            return kind == "cpu" or self.min_compute_capability is None
        if self.min_compute_capability is not None and capability < self.min_compute_capability:
            return False
        return self.compute_capabilities is None or capability in self.compute_capabilities

    def graph_level(self, mode: ForwardMode) -> CudaGraphLevel:
        return dict(self.cuda_graph).get(mode, CudaGraphLevel.NEVER)


# ------------------------------------------------------------------ workspaces: sized once, from the config

def max_decode_tokens(kv_cfg: dict, graph_cfg: dict) -> int:
    """The largest decode batch: the request table's rows, or a larger captured graph size (padded)."""
    sizes = graph_cfg["batch_sizes"] if graph_cfg["enabled"] else []
    return max([int(kv_cfg["max_requests"]), *sizes])


def max_q_len(spec_cfg: dict) -> int:
    """Most query tokens per request a decode-kernel call gets: verify / draft extend run ``num_steps + 1``."""
    return int(spec_cfg["num_steps"]) + 1 if spec_cfg["enabled"] else 1


def instances(spec_cfg: dict) -> list[str]:
    """The instance names of a backend that takes workspaces per instance: the target's (""), and with speculation
    one per draft step (:data:`DRAFT_INSTANCE`), as the container builds them."""
    steps = int(spec_cfg["num_steps"]) if spec_cfg["enabled"] else 0
    return ["", *(DRAFT_INSTANCE.format(i=i) for i in range(steps))]


def by_name(*specs: WorkspaceSpec) -> dict[str, WorkspaceSpec]:
    """Ledger name -> spec."""
    return {s.name: s for s in specs}


def no_workspaces(cls: type, inputs: WorkspaceInputs) -> dict[str, WorkspaceSpec]:
    """``workspace_specs`` of a backend that takes nothing from the ledger:
    ``workspace_specs = classmethod(no_workspaces)``."""
    return {}


@runtime_checkable
class AttentionBackend(Protocol):
    """Absorbed-MLA attention over the paged latent KV cache.

    ``q_nope`` is already multiplied by W_UK, so both forwards return the output in the latent space
    ([T, H, kv_lora_rank]); the model applies W_UV.
    """

    capabilities: ClassVar[BackendCapabilities]

    @classmethod
    def config_problems(cls, backend_cfg: dict, model_cfg: dict, device) -> list:
        """Every reason this backend's own config cannot run here (a list of runtime.core.errors.Problem), checked
        by validation before anything is allocated; rules the capabilities cannot express (e.g. a kernel
        variant that needs a newer GPU). ``device`` is a runtime.core.device.DeviceInfo."""
        ...

    @classmethod
    def workspace_specs(cls, inputs: WorkspaceInputs) -> dict[str, WorkspaceSpec]:
        """Ledger name -> spec of every workspace this backend's instances acquire for ``inputs`` (names within
        ``capabilities.workspaces``, per-instance ones suffixed ``:<instance>``; 0 bytes where an impl needs none).
        The one source of their sizes: the container acquires from it, the memory plan adds it up."""
        ...

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Host-side planning for one step, shared by every layer; outside any CUDA graph."""
        ...

    def forward_decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q_nope [B, H, kv_lora_rank], q_pe [B, H, rope] -> [B, H, kv_lora_rank] in q's dtype."""
        ...

    def forward_extend(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        """q_nope [T, H, kv_lora_rank], q_pe [T, H, rope], causal bottom-right over each request's KV
        (prefix + new tokens, already written) -> [T, H, kv_lora_rank] in q's dtype."""
        ...


@runtime_checkable
class MHAChunkPrefill(Protocol):
    """Prefill with decompressed K/V: a causal ragged pass over the new tokens, then one non-causal pass per
    prefix chunk (``batch.prefix_chunks``), merged through their log-sum-exp.

    Shapes: q [T, H, qk_head], k [N, H, qk_head], v [N, H, v_head]; out [T, H, v_head]; lse [T, H] float32
    in whatever base the backend uses (``merge_states`` of the same backend consumes it).
    """

    def init_mha_chunk_metadata(self, batch: ForwardBatch) -> None:
        """Plan the ragged pass and every prefix chunk of ``batch``. One argument, always."""
        ...

    def forward_mha_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_mha_prefix_chunk(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int, layer_id: int, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def merge_states(
        self, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def hook_signature_problems(cls: type, protocol: type) -> list[str]:
    """Every method of ``protocol`` that class ``cls`` lacks or whose parameters differ from the Protocol's.

    This is a *static check of a typed interface* done once at startup (so a wrapper that lacks a hook fails
    then, naming the hook), not a runtime decision about what a backend can do.
    """
    problems = []
    for name, proto_fn in inspect.getmembers(protocol, inspect.isfunction):
        if name.startswith("_"):
            continue
        impl = inspect.getattr_static(cls, name, None)
        if impl is None:
            problems.append(f"{cls.__name__} has no method {name}{inspect.signature(proto_fn)}")
            continue
        want = [p.name for p in inspect.signature(proto_fn).parameters.values()]
        got = [p.name for p in inspect.signature(impl).parameters.values()]
        if len(want) != len(got):
            problems.append(
                f"{cls.__name__}.{name} takes ({', '.join(got)}); the hook Protocol takes ({', '.join(want)})"
            )
    return problems


@runtime_checkable
class GraphHooks(Protocol):
    """CUDA-graph hooks, one set for every graphed forward mode (``batch.mode`` says which: DECODE,
    TARGET_VERIFY, DRAFT_EXTEND). The graph runner (runtime/engine/graph_runner.py) owns static input buffers and
    hands the backend a batch whose tensors are those static buffers (padded to a captured size; padding
    entries use the request table's padding row, write their KV to the padding page, and their outputs are
    dropped). A backend keeps static metadata per mode. One argument each, the batch."""

    def init_graph_state(self, batch: ForwardBatch) -> None:
        """Allocate static metadata for ``batch.mode`` batches up to ``batch.batch_size`` requests (the
        largest size captured for that mode); called once per mode before any capture of it."""
        ...

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Point this step's metadata at the static buffers of ``batch.mode``, for capturing ``batch``'s size."""
        ...

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Refresh the static metadata in place for ``batch`` (host mirrors are valid), before replay."""
        ...


@runtime_checkable
class SparseDecode(Protocol):
    """DeepSeek sparse attention, for the model's sparse layers; a backend whose ``capabilities.sparse`` is true
    implements it (validation checks the methods at startup). Where the selected tokens' KV lives (the paged
    pool, or a HiSparse coordinator's device buffer) is the backend's business: it received it in __init__."""

    def store_sparse_tokens(self, kv_rows: torch.Tensor, index_k: torch.Tensor, layer_id: int,
                            batch: ForwardBatch) -> None:
        """Keep this step's new tokens of sparse layer ``layer_id`` (every forward mode): kv_rows [T, kv_lora +
        rope] their latent rows (already in the paged KV pool at ``batch.out_cache_loc``), index_k [T, Di] their
        indexer keys, both in the model dtype."""
        ...

    def forward_sparse_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, index_q: torch.Tensor,
                              index_weights: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Indexer top-k, then attention over the selected tokens only: q_nope [B, H, kv_lora] (absorbed),
        q_pe [B, H, rope], index_q [B, Hi, Di], index_weights [B, Hi] float32 -> [B, H, kv_lora] in q's dtype."""
        ...

    def forward_sparse_extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, index_q: torch.Tensor,
                              index_weights: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Prefill / chunked prefill (EXTEND): each token's indexer top-k over its causal prefix (cached prefix and
        the chunk's tokens up to itself), then attention over those tokens only: q_nope [T, H, kv_lora], q_pe
        [T, H, rope], index_q [T, Hi, Di], index_weights [T, Hi] float32 -> [T, H, kv_lora] in q's dtype."""
        ...

    def prefill_stats(self) -> dict:
        """Key rows the sparse layers' prefill read so far, per layer: ``tokens``, ``sparse`` (rows read),
        ``dense`` (rows a dense prefill of the same steps reads), ``top_k``."""
        ...


# ------------------------------------------------------------------ which hooks a backend serves (capabilities)

def mha_prefill_hook(backend: Any, prefill: str, backend_cfg: dict) -> MHAChunkPrefill | None:
    """The backend as the MHA chunked-prefill hook when its capabilities declare it, ``attention.prefill`` is
    not ``absorbed`` and the backend's config does not switch ragged prefill off; else None (absorbed path).
    (``attention.prefill=mha_chunked`` with a backend lacking the hook never gets here: validation refuses.)"""
    if prefill == "absorbed" or backend_cfg.get("disable_ragged", False):
        return None
    return backend if type(backend).capabilities.mha_chunked_prefill else None


def decode_graph_hook(backend: Any) -> GraphHooks | None:
    """The backend as its decode-graph hook when its capabilities allow graphed single-token decode."""
    level = type(backend).capabilities.graph_level(ForwardMode.DECODE)
    return backend if level >= CudaGraphLevel.SINGLE_TOKEN_DECODE else None


def sparse_hook(backend: Any) -> SparseDecode | None:
    """The backend as the model's sparse-layer hook when its capabilities say sparse (validation has checked
    the methods); else None."""
    return backend if type(backend).capabilities.sparse else None
