"""FlashInfer MLA: absorbed decode/extend over the paged latent cache, and the MHA chunked-prefix prefill.

Kernels (FlashInfer 0.6.18, read from its source):

* absorbed MLA: ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (fa3 on Hopper, fa2 elsewhere). One
  ``plan`` per forward batch, shared by every layer; ``run`` per layer reads ``ckv``/``kpe`` as strided views
  of the pool's ``[num_pages, page_size, 576]`` buffer (the kernel takes page and row strides and needs
  only the last dimension contiguous, so the pool layout stays as it is). Any page size works: the kernel
  divides token positions by ``page_size`` (``uint_fastdiv``), nothing is specialised on it.
* MHA chunked-prefix prefill: ``flashinfer.prefill.BatchPrefillWithRaggedKVCacheWrapper`` (qk 192 / vo 128):
  one causal wrapper over the new tokens and one non-causal wrapper per prefix chunk, merged with
  ``flashinfer.cascade.merge_state``. FlashInfer's log-sum-exp is base 2 (``m + log2(d)`` with the scores
  pre-multiplied by ``log2(e)``) and ``merge_state`` uses ``exp2``: the lse this backend returns is base 2 and
  only its own ``merge_states`` may consume it. A request whose chunk range is empty gets output 0 and
  lse -inf from both fa2 and fa3 (no NaN), which ``merge_state`` weighs to 0. ``merge_state`` launches
  one block of (head_dim / vec) x num_heads threads per token, over CUDA's 1024 for 128 heads of 128 dims
  ("invalid argument"); ``merge_states`` therefore runs it on a zero-copy [T * G, H / G, D] view.
* kv indices: a padded [B, W] page table gathered from ``req_to_token`` on the device (see ``_kv_pages``);
  plans read only the host mirrors (``seq_lens_cpu``, ``qo_indptr_cpu``), so no plan syncs the device.

Workspaces: the float workspace is the shared ``flashinfer_float`` buffer (split-KV partials, scratch for
one ``run`` at a time, so every wrapper shares it). Each wrapper keeps its plan in an *int* workspace that
must outlive the plan, so each gets its own, acquired from the ledger by name. FlashInfer's wrapper
constructors always allocate their own 8 MiB int workspace (and an 8 MiB pinned host mirror) first; this
module replaces the device buffer right after construction (``reset_workspace_buffer`` for the ragged
wrapper; the MLA wrapper has no public setter, so its attribute is assigned), and the constructor's buffer
goes back to torch's caching allocator.

FlashInfer is imported inside ``__init__``: the module imports on machines without it, and validation
reports the missing package with its install fix.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from backends.base import BackendCapabilities, CudaGraphLevel, by_name
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.errors import ConfigError, Problem
from runtime.core.kv_pool import MLAKVPool, ReqToTokenPool
from runtime.core.model_spec import ModelSpec
from runtime.core.workspace import WorkspaceInputs, WorkspaceLedger, WorkspaceSpec

FLOAT_WORKSPACE = "flashinfer_float"
# FlashInfer's wrappers size their pinned host mirror at 8 MiB and copy the plan through it, so the int
# workspace we hand them must not be larger (the MLA plan uses about 0.8 MiB of it).
INT_WORKSPACE_BYTES = 8 << 20
KERNELS = ("auto", "fa3", "fa2")


def float_workspace_spec(workspace_cfg: dict) -> WorkspaceSpec:
    """The shared FlashInfer float workspace (uint8 [workspace.flashinfer_bytes]); shareable across
    FlashInfer-based backends, no zero init (FlashInfer writes before it reads)."""
    return WorkspaceSpec(FLOAT_WORKSPACE, int(workspace_cfg["flashinfer_bytes"]), zero_init=False, shareable=True)


def precompile(float_workspace: torch.Tensor, mla_kernels=("auto",), ragged_kernels=("auto",),
               dtype: torch.dtype = torch.bfloat16) -> None:
    """Build FlashInfer's JIT modules for these kernels concurrently (first use costs 15-75 s per module).

    Plans throwaway wrappers on one-token problems (each builds its module inside ``plan``) and runs one
    ``merge_state``, in threads, so the builds overlap. For tests and benchmarks; the backend itself needs
    no warm-up call (its first plan builds what it uses).

    Parameters
    ----------
    float_workspace : torch.Tensor
        uint8 CUDA buffer (the ``flashinfer_float`` workspace); only planned against, never run on.
    mla_kernels : iterable of "auto" | "fa3" | "fa2"
        Absorbed-MLA modules to build.
    ragged_kernels : iterable of "auto" | "fa3" | "fa2"
        Ragged prefill modules (qk 192 / vo 128) to build; when any, the merge module too.
    dtype : torch.dtype
        bf16 or fp16, the KV/query dtype.
    """
    from concurrent.futures import ThreadPoolExecutor

    from flashinfer.cascade import merge_state
    from flashinfer.mla import BatchMLAPagedAttentionWrapper
    from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper
    from flashinfer.utils import determine_mla_backend

    dev = float_workspace.device
    # "auto" resolves as the wrappers resolve it (fa3 on Hopper, fa2 elsewhere; qk 192 / vo 128 has fa3
    # prefill kernels): two threads must never build the same module
    def resolve(kernels) -> list[str]:
        return list(dict.fromkeys(determine_mla_backend(dev) if k == "auto" else k for k in kernels))

    one = torch.tensor([0, 1], dtype=torch.int32)

    def mla(kernel: str) -> None:
        w = BatchMLAPagedAttentionWrapper(float_workspace, backend=kernel)
        kv_len = torch.ones(1, dtype=torch.int32)
        w.plan(one, one, torch.zeros(1, dtype=torch.int32, device=dev), kv_len, 16, 512, 64, 1, False, 1.0,
               dtype, dtype)

    def prefill(kernel: str) -> None:
        w = BatchPrefillWithRaggedKVCacheWrapper(float_workspace, "NHD", backend=kernel)
        w.plan(one, one, 16, 16, 192, head_dim_vo=128, causal=True, q_data_type=dtype, kv_data_type=dtype)

    def merge() -> None:
        v, s = torch.zeros(1, 16, 128, dtype=dtype, device=dev), torch.zeros(1, 16, device=dev)
        merge_state(v, s, v, s)

    jobs = [(mla, k) for k in resolve(mla_kernels)] + [(prefill, k) for k in resolve(ragged_kernels)]
    if ragged_kernels:
        jobs.append((lambda _: merge(), None))
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for f in [pool.submit(fn, arg) for fn, arg in jobs]:
            f.result()
    torch.cuda.synchronize(dev)


def merge_head_groups(num_heads: int, head_dim: int, element_size: int) -> int:
    """Smallest G dividing ``num_heads`` such that FlashInfer's merge_state block for ``num_heads / G``
    heads, (head_dim / vec) x (num_heads / G) threads with vec = max(16 / element_size, head_dim / 32), fits
    in 1024 threads."""
    lanes = head_dim // max(16 // element_size, head_dim // 32)
    max_heads = max(1, 1024 // lanes)
    return next(g for g in range(1, num_heads + 1) if num_heads % g == 0 and num_heads // g <= max_heads)


def _pinned(host: torch.Tensor) -> torch.Tensor:
    """A pinned copy of a small host array (see ``_plan_mla``)."""
    return host if host.is_pinned() else host.pin_memory()


def _stride1(x: torch.Tensor) -> torch.Tensor:
    """FlashInfer reads row and head strides but assumes the last dimension is contiguous."""
    return x if x.stride(-1) == 1 else x.contiguous()


class FlashInferMLABackend:
    """Absorbed MLA and the MHA chunked-prefix prefill with FlashInfer kernels.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
        ``req_to_token`` [max_requests, max_context] int32 on the device (slot = page * page_size + offset).
    kv_pool : MLAKVPool
        Per layer ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` in bf16 or fp16.
    model : ModelSpec
        ``kv_lora_rank`` must be 512 and ``qk_rope_head_dim`` 64 (FlashInfer's MLA kernels are built for
        DeepSeek's latent shape); ``sm_scale`` is used by both paths.
    float_workspace : torch.Tensor
        uint8 [workspace.flashinfer_bytes], the shared ``flashinfer_float`` buffer from the ledger.
    ledger : WorkspaceLedger
        Source of every int workspace (``flashinfer_int:*``) and of the CUDA-graph metadata buffer.
    config : dict
        The `backend` config: ``name``, ``kernel`` ("auto" | "fa3" | "fa2", the wrappers' ``backend=``),
        ``disable_ragged`` (true: no ragged wrappers are built; the container gives the model no MHA hook).
    instance : str
        Distinguishes several instances of this backend (the draft steps of speculative decoding) in the
        ledger: their int workspaces and graph metadata are named ``...:<instance>:...``.
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        forward_modes=frozenset(ForwardMode),  # verify / draft extend: causal MLA plans like extend
        # graph wrappers take a fixed qo_indptr buffer: uniform query lengths per request replay safely
        cuda_graph=((ForwardMode.DECODE, CudaGraphLevel.SINGLE_TOKEN_DECODE),
                    (ForwardMode.TARGET_VERIFY, CudaGraphLevel.UNIFORM_BATCH),
                    (ForwardMode.DRAFT_EXTEND, CudaGraphLevel.UNIFORM_BATCH)),
        mha_chunked_prefill=True,
        builds_own_kv_indices=True,
        page_sizes=None,
        min_compute_capability=(8, 0),  # fa2; kernel=fa3 needs 9.x and is checked at construction
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        kv_dtypes=frozenset({"auto", "fp8_e4m3"}),
        # FlashInfer 0.6.18 BatchMLAPagedAttentionWrapper.plan: fp8 e4m3 KV only with fa2/fa3 on SM90, bf16 q
        fp8_kv_model_dtypes=frozenset({torch.bfloat16}),
        fp8_kv_gpu_major=9,
        devices=frozenset({"cuda"}),
        workspaces=frozenset({FLOAT_WORKSPACE}),
        packages=("flashinfer",),
    )

    @classmethod
    def workspace_specs(cls, inputs: WorkspaceInputs) -> dict[str, WorkspaceSpec]:
        """The shared float workspace (:func:`float_workspace_spec`). The per-wrapper int workspaces and graph
        metadata (``flashinfer_int:*``, ``flashinfer_graph_meta:*``) are acquired as wrappers are made: not listed."""
        return by_name(float_workspace_spec(inputs.cfg["workspace"]))

    @classmethod
    def config_problems(cls, backend_cfg: dict, model_cfg: dict, device) -> list[Problem]:
        """Kernel name, latent shape, and fa3 only on Hopper: checked before anything is allocated."""
        name, kernel = backend_cfg.get("name", "flashinfer_mla"), backend_cfg.get("kernel", "auto")
        problems = []
        if kernel not in KERNELS:
            problems.append(Problem(f"backend '{name}' kernel", repr(kernel), f"one of {list(KERNELS)}",
                                    "set backend.kernel=auto"))
        if (model_cfg["kv_lora_rank"], model_cfg["qk_rope_head_dim"]) != (512, 64):
            problems.append(Problem(
                f"backend '{name}' latent shape",
                f"kv_lora_rank={model_cfg['kv_lora_rank']}, qk_rope_head_dim={model_cfg['qk_rope_head_dim']}",
                "kv_lora_rank=512, qk_rope_head_dim=64 (FlashInfer's MLA kernels are built for these)",
                "use a DeepSeek-shaped model config, or backend=triton_mla / torch_mla"))
        cc = device.compute_capability
        if kernel == "fa3" and cc is not None and cc[0] != 9:
            problems.append(Problem(
                f"backend '{name}' kernel=fa3", f"GPU {device.name} (compute capability {cc[0]}.{cc[1]})",
                "compute capability 9.x (Hopper: FlashInfer's fa3 kernels are SM90a only)",
                "set backend.kernel=auto (picks fa3 on Hopper, fa2 elsewhere) or backend.kernel=fa2"))
        return problems

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: MLAKVPool,
        model: ModelSpec,
        float_workspace: torch.Tensor,
        ledger: WorkspaceLedger,
        config: dict,
        instance: str = "",
    ):
        self.name = str(config.get("name", "flashinfer_mla"))
        self.instance = instance
        self.consumer = f"{self.name}:{instance}" if instance else self.name
        self.kernel = str(config.get("kernel", "auto"))
        self.disable_ragged = bool(config.get("disable_ragged", False))
        self._check(kv_pool, model, float_workspace)

        import flashinfer  # noqa: F401  (inside __init__: the module must import without FlashInfer)
        from flashinfer.cascade import merge_state
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
        from flashinfer.prefill import BatchPrefillWithRaggedKVCacheWrapper

        self._MLAWrapper, self._RaggedWrapper, self._merge_state = (
            BatchMLAPagedAttentionWrapper, BatchPrefillWithRaggedKVCacheWrapper, merge_state,
        )
        self.req_to_token_pool, self.kv_pool, self.model = req_to_token_pool, kv_pool, model
        self.ledger, self.float_workspace = ledger, float_workspace
        self.device = float_workspace.device
        self.page_size = kv_pool.page_size
        self.dtype = kv_pool.dtype
        self.kv_dtype = kv_pool.cache_dtype  # float8_e4m3fn with an fp8 cache (dequantized by ckv/kpe_scale)
        self._kv_scales = dict(ckv_scale=kv_pool.scale, kpe_scale=kv_pool.scale) if kv_pool.quantized else {}
        self.num_heads = model.num_heads
        # column of the first token of every page in a request-table row, for the page-table gather
        self._page_cols = torch.arange(0, req_to_token_pool.max_context, self.page_size, device=self.device)

        # absorbed MLA, eager: one wrapper, planned once per batch
        self._mla = self._new_mla_wrapper(self._int_workspace("mla"))
        # MHA chunked-prefix prefill: the causal pass over new tokens now, chunk wrappers on demand
        self._ragged = None if self.disable_ragged else self._new_ragged_wrapper(self._int_workspace("ragged"))
        self._chunk_wrappers: list[Any] = []
        self._num_chunks = 0

        # CUDA graphs (GraphHooks): per graphed mode, filled by init_graph_state
        self._graph_max_bs: dict[ForwardMode, int] = {}
        self._graph_bufs: dict[ForwardMode, dict[str, torch.Tensor]] = {}
        self._graph_int_ws: torch.Tensor | None = None
        self._graph_pinned: torch.Tensor | None = None
        self._graph_wrappers: dict[tuple[ForwardMode, int], Any] = {}
        self._graph_active = False  # set by the graph hooks, cleared by init_forward_metadata
        self._graph_wrapper: Any = None

    # ------------------------------------------------------------------------------------- construction
    def _check(self, kv_pool: MLAKVPool, model: ModelSpec, float_workspace: torch.Tensor) -> None:
        """Every reason this backend cannot run with these collaborators, raised together."""
        problems = []
        if self.kernel not in KERNELS:
            problems.append(Problem(f"backend '{self.name}' kernel", repr(self.kernel), f"one of {list(KERNELS)}",
                                    "set backend.kernel=auto"))
        if (model.kv_lora_rank, model.qk_rope_head_dim) != (512, 64):
            problems.append(Problem(
                f"backend '{self.name}' latent shape",
                f"kv_lora_rank={model.kv_lora_rank}, qk_rope_head_dim={model.qk_rope_head_dim}",
                "kv_lora_rank=512, qk_rope_head_dim=64 (FlashInfer's MLA kernels are built for these)",
                "use a DeepSeek-shaped model config, or backend=triton_mla / torch_mla"))
        if kv_pool.dtype not in self.capabilities.dtypes:
            problems.append(Problem(f"backend '{self.name}' KV dtype", str(kv_pool.dtype), "bfloat16 or float16",
                                    "set model.dtype=bfloat16"))
        if float_workspace.device.type != "cuda" or float_workspace.dtype != torch.uint8:
            problems.append(Problem(
                f"backend '{self.name}' float workspace", f"{float_workspace.dtype} on {float_workspace.device}",
                "a uint8 CUDA tensor (the ledger's 'flashinfer_float')", "wire the flashinfer_float workspace"))
        elif self.kernel == "fa3":
            major, minor = torch.cuda.get_device_capability(float_workspace.device)
            if major != 9:
                problems.append(Problem(
                    f"backend '{self.name}' kernel=fa3", f"a GPU of compute capability {major}.{minor}",
                    "compute capability 9.x (Hopper: FlashInfer's fa3 kernels are SM90a only)",
                    "set backend.kernel=auto (picks fa3 on Hopper, fa2 elsewhere) or backend.kernel=fa2"))
        if problems:
            raise ConfigError(problems)

    def _ledger_name(self, kind: str, tag: str) -> str:
        return f"{kind}:{self.instance}:{tag}" if self.instance else f"{kind}:{tag}"

    def _int_workspace(self, tag: str) -> torch.Tensor:
        spec = WorkspaceSpec(self._ledger_name("flashinfer_int", tag), INT_WORKSPACE_BYTES, zero_init=False,
                             shareable=False)
        return self.ledger.acquire(spec, self.consumer)

    def _new_mla_wrapper(self, int_ws: torch.Tensor, **graph_buffers: Any):
        w = self._MLAWrapper(self.float_workspace, backend=self.kernel, **graph_buffers)
        # No public setter: the constructor allocated an 8 MiB int buffer; use the ledger's instead (same
        # size as the pinned mirror the constructor also made, through which plan() copies).
        w._int_workspace_buffer = int_ws
        return w

    def _new_ragged_wrapper(self, int_ws: torch.Tensor):
        w = self._RaggedWrapper(self.float_workspace, kv_layout="NHD", backend=self.kernel)
        w.reset_workspace_buffer(self.float_workspace, int_ws)
        return w

    # --------------------------------------------------------------------------------- kv indices, plan
    def _kv_pages(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Page ids of every request as a padded page table, gathered on the device in two kernels.

        FlashInfer's MLA kernels (fa2 ``mla.cuh``, fa3 ``mla_hopper.cuh``) address token ``t`` of request
        ``b`` as ``kv_indices[kv_indptr[b] + t // page_size]`` and stop at ``kv_len[b]``; the plan reads
        ``kv_indptr`` only as each request's start. So request b's pages may start at ``b * W`` of a
        [B, W] table (W = pages of the longest request) instead of being packed: one gather, no prefix
        sums on the device. Entries past a request's ``ceil(seq_len / page_size)`` pages are never read.

        Returns
        -------
        kv_indices : [B * W] int32 device: row b holds ``req_to_token[req_b, k * page_size] // page_size``.
        kv_indptr_cpu : [B + 1] int32 host: ``b * W``.
        """
        ps, b = self.page_size, batch.batch_size
        width = -(-batch.max_seq_len // ps)
        table = self.req_to_token_pool.req_to_token
        pages = table[batch.req_pool_indices[:, None], self._page_cols[None, :width]]  # [B, W] slots
        if ps > 1:
            pages = pages // ps
        kv_indptr_cpu = torch.arange(0, (b + 1) * width, width, dtype=torch.int32)
        return pages.reshape(-1), kv_indptr_cpu

    def _plan_mla(self, wrapper, batch: ForwardBatch, causal: bool) -> None:
        """Plan ``wrapper`` for ``batch``. plan() copies its host indptr/length arrays to device buffers with
        non_blocking copies; from pageable memory CUDA would first sync the stream (the host would wait for
        the previous step's kernels), so they are handed over pinned."""
        kv_indices, kv_indptr_cpu = self._kv_pages(batch)
        wrapper.plan(
            _pinned(batch.qo_indptr_cpu), _pinned(kv_indptr_cpu), kv_indices, _pinned(batch.seq_lens_cpu),
            self.num_heads, self.model.kv_lora_rank, self.model.qk_rope_head_dim, self.page_size,
            causal, self.model.sm_scale, self.dtype, self.kv_dtype,
        )

    # ------------------------------------------------------------------------------------ absorbed MLA
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """One plan of the eager MLA wrapper for ``batch``, shared by every layer. Host mirrors feed the
        plan (no device-to-host copy); kv indices are gathered on the device."""
        if batch.mode not in self.capabilities.forward_modes:
            raise ValueError(
                f"{self.name}: forward mode {batch.mode.value!r} is not supported; expected one of "
                f"{sorted(m.value for m in self.capabilities.forward_modes)}. Fix: pick a backend whose "
                "capabilities list this mode.")
        self._graph_active = False
        self._plan_mla(self._mla, batch, causal=batch.mode != ForwardMode.DECODE)

    def _run_mla(self, wrapper, q_nope: torch.Tensor, q_pe: torch.Tensor, layer_id: int) -> torch.Tensor:
        buf = self.kv_pool.buffer(layer_id)
        rank = self.model.kv_lora_rank
        return wrapper.run(_stride1(q_nope), _stride1(q_pe), buf[..., :rank], buf[..., rank:], **self._kv_scales)

    def forward_decode(self, q_nope, q_pe, layer_id, batch):
        """q_nope [B, H, 512], q_pe [B, H, 64] in the KV dtype -> [B, H, 512] in that dtype.

        Uses the CUDA-graph wrapper when a graph hook planned this step, the eager wrapper otherwise; never
        plans (safe inside capture)."""
        wrapper = self._graph_wrapper if self._graph_active else self._mla
        return self._run_mla(wrapper, q_nope, q_pe, layer_id)

    def forward_extend(self, q_nope, q_pe, layer_id, batch):
        """q_nope [T, H, 512], q_pe [T, H, 64] -> [T, H, 512]; causal bottom-right over prefix + new tokens
        (EXTEND, and TARGET_VERIFY / DRAFT_EXTEND, graphed when a graph hook planned this step)."""
        wrapper = self._graph_wrapper if self._graph_active else self._mla
        return self._run_mla(wrapper, q_nope, q_pe, layer_id)

    # ------------------------------------------------------------------ MHA chunked-prefix prefill
    def init_mha_chunk_metadata(self, batch: ForwardBatch) -> None:
        """Plan the causal ragged pass over the new tokens and one non-causal pass per prefix chunk."""
        if self._ragged is None:
            raise ValueError(
                f"{self.name}: MHA chunked prefill was asked for, but backend.disable_ragged=true built no "
                "ragged wrappers. Fix: set backend.disable_ragged=false, or do not inject this backend as the "
                "MHA prefill hook.")
        qo = batch.qo_indptr_cpu
        self._plan_ragged(self._ragged, qo, qo, causal=True)
        while len(self._chunk_wrappers) < len(batch.prefix_chunks):
            tag = f"prefix_chunk{len(self._chunk_wrappers)}"
            self._chunk_wrappers.append(self._new_ragged_wrapper(self._int_workspace(tag)))
        for wrapper, chunk in zip(self._chunk_wrappers, batch.prefix_chunks):
            self._plan_ragged(wrapper, qo, chunk.kv_indptr_cpu, causal=False)
        self._num_chunks = len(batch.prefix_chunks)

    def _plan_ragged(self, wrapper, qo_indptr_cpu: torch.Tensor, kv_indptr_cpu: torch.Tensor, causal: bool) -> None:
        m = self.model
        wrapper.plan(
            _pinned(qo_indptr_cpu), _pinned(kv_indptr_cpu), m.num_heads, m.num_heads, m.qk_head_dim,
            head_dim_vo=m.v_head_dim,
            causal=causal, sm_scale=m.sm_scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )

    def forward_mha_extend(self, q, k, v, layer_id, batch):
        """Causal over the new tokens: q/k [T, H, 192], v [T, H, 128] -> (out [T, H, 128] in q's dtype,
        lse [T, H] float32, base 2)."""
        return self._ragged.run(_stride1(q), _stride1(k), _stride1(v), return_lse=True)

    def forward_mha_prefix_chunk(self, q, k, v, chunk, layer_id, batch):
        """Non-causal over prefix chunk ``chunk``: q [T, H, 192], k [N, H, 192], v [N, H, 128] packed by the
        chunk's ``kv_indptr`` -> (out [T, H, 128], lse [T, H] float32 base 2; 0 / -inf where empty)."""
        if not 0 <= chunk < self._num_chunks:
            raise IndexError(
                f"{self.name}: prefix chunk {chunk} was not planned; init_mha_chunk_metadata planned "
                f"{self._num_chunks}. Fix: call init_mha_chunk_metadata(batch) after batch.prefix_chunks is set.")
        return self._chunk_wrappers[chunk].run(_stride1(q), _stride1(k), _stride1(v), return_lse=True)

    def merge_states(self, out_a, lse_a, out_b, lse_b):
        """FlashInfer's merge_state (base-2 lse): out [T, H, D], lse [T, H] float32 -> merged (out, lse).

        FlashInfer launches one block of (D / vec) x H threads per token, which exceeds 1024 threads for
        H > 64 at D = 128 in bf16 ("invalid argument"). A contiguous [T, H, D] is also [T * G, H / G, D]
        with the same memory order, so the merge runs on that zero-copy view with G head groups.
        """
        t, h, d = out_a.shape
        g = merge_head_groups(h, d, out_a.element_size())
        v, s = self._merge_state(
            out_a.contiguous().view(t * g, h // g, d), lse_a.contiguous().view(t * g, h // g),
            out_b.contiguous().view(t * g, h // g, d), lse_b.contiguous().view(t * g, h // g),
        )
        return v.view(t, h, d), s.view(t, h)

    # ------------------------------------------------------------------------------- CUDA graphs
    def init_graph_state(self, batch: ForwardBatch) -> None:
        """Static metadata for ``batch.mode`` batches of up to ``batch.batch_size`` requests: qo_indptr,
        kv_indptr [bs + 1], kv_len [bs] and kv_indices [bs * (max_context // page_size + 1)] int32, in one
        ledger buffer per mode (``flashinfer_graph_meta:<mode>``), plus one int workspace shared by every graph
        wrapper (each plans right before its own capture/replay, and modes never replay concurrently)."""
        mode, bs = batch.mode, batch.batch_size
        if mode in self._graph_max_bs:
            if bs <= self._graph_max_bs[mode]:
                return  # the static buffers already cover this size
            raise RuntimeError(
                f"{self.name}: init_graph_state({mode.value}) was already called for {self._graph_max_bs[mode]} "
                f"requests; got a second call for {bs}. Fix: call it once per mode, with the largest captured batch.")
        max_pages = self.req_to_token_pool.max_context // self.page_size + 1
        sizes = {"qo_indptr": bs + 1, "kv_indptr": bs + 1, "kv_len": bs, "kv_indices": bs * max_pages}
        # each piece starts 16-byte aligned
        offsets, total = {}, 0
        for key, n in sizes.items():
            offsets[key] = total
            total += -(-n // 4) * 4
        spec = WorkspaceSpec(self._ledger_name("flashinfer_graph_meta", mode.value), total * 4, zero_init=True)
        ints = self.ledger.acquire(spec, self.consumer).view(torch.int32)
        self._graph_bufs[mode] = {k: ints[offsets[k] : offsets[k] + n] for k, n in sizes.items()}
        if self._graph_int_ws is None:
            self._graph_int_ws = self._int_workspace("mla_graph")
        self._graph_max_bs[mode] = bs

    def _graph_wrapper_for(self, mode: ForwardMode, bs: int):
        if not 0 < bs <= self._graph_max_bs.get(mode, 0):
            raise ValueError(
                f"{self.name}: CUDA-graph {mode.value} batch of {bs} requests; expected 1.."
                f"{self._graph_max_bs.get(mode, 0)} (the size given to init_graph_state for this mode). Fix: call "
                "init_graph_state with the largest captured batch of the mode first.")
        w = self._graph_wrappers.get((mode, bs))
        if w is None:
            b = self._graph_bufs[mode]
            w = self._new_mla_wrapper(
                self._graph_int_ws, use_cuda_graph=True, qo_indptr=b["qo_indptr"][: bs + 1],
                kv_indptr=b["kv_indptr"][: bs + 1], kv_indices=b["kv_indices"], kv_len_arr=b["kv_len"][:bs],
            )
            # Every graph wrapper plans right before its own capture/replay and the plan layout in the int
            # workspace is fixed-size, so one int workspace and one pinned mirror serve every mode and size.
            if self._graph_pinned is None:
                self._graph_pinned = w._pin_memory_int_workspace_buffer
            w._pin_memory_int_workspace_buffer = self._graph_pinned
            self._graph_wrappers[(mode, bs)] = w
        return w

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        """Plan the graph wrapper of (``batch.mode``, ``batch.batch_size``), created on first use."""
        self._graph_wrapper = self._graph_wrapper_for(batch.mode, batch.batch_size)
        self._plan_mla(self._graph_wrapper, batch, causal=batch.mode != ForwardMode.DECODE)
        self._graph_active = True

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Re-plan the graph wrapper of (``batch.mode``, ``batch.batch_size``) in place before replay."""
        self.init_forward_metadata_capture(batch)


__all__ = [
    "FLOAT_WORKSPACE", "INT_WORKSPACE_BYTES", "FlashInferMLABackend", "float_workspace_spec", "merge_head_groups",
    "precompile",
]
