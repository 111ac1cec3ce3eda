"""TensorRT-LLM-gen MLA decode on Blackwell (SM100 / SM103), through FlashInfer.

Kernel: ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` (FlashInfer 0.6.18; contract read from its
source), called with ``backend="trtllm-gen"``:

* query ``[B, q_len, H, kv_lora + rope]`` = ``q_nope | q_pe`` (absorbed); q_len 1 for DECODE, the uniform
  ``num_steps + 1`` for TARGET_VERIFY / DRAFT_EXTEND (the kernel masks the q_len rows bottom-right causally);
  for EXTEND (prefill, lengths differ per request) the compact form ``[T, H, D]`` with ``cum_seq_lens_q`` =
  ``batch.qo_indptr`` and ``max_q_len``, which FlashInfer routes to TRT-LLM-gen as well. Prefill therefore
  runs through the same kernel, absorbed: there is no MHA chunked-prefix hook (TRT-LLM's ragged prefill
  kernel is not wired), so ``attention.prefill=mha_chunked`` is refused by capability.
* kv_cache: the pool's ``[num_pages, page_size, 576]`` buffer as it is; page size 32 or 64 (capability).
* block_tables ``[B, W]`` int32 page ids, built by this backend from ``req_to_token`` in its metadata step
  (``builds_own_kv_indices``: the multi-step draft skips its shared kv-indices pass); W rounded up to a
  multiple of ``128 / page_size``.
* seq_lens ``batch.seq_lens`` (int32, including the new tokens), ``max_seq_len`` the batch's longest (in a
  CUDA graph: ``max_context``, a constant baked into the graph).
* ``bmm1_scale`` = the model's softmax scale (1 / sqrt(qk_head_dim), times YaRN's mscale^2), ``bmm2_scale``
  = 1.0: python floats, static for graphs.
* workspace_buffer: this instance's own ``trtllm_mla_workspace`` from the ledger, zero-initialised once and
  never shared (the kernel keeps semaphore state in it between launches); ``multi_ctas_kv_counter_buffer``:
  its own zero-initialised ``trtllm_mla_counters`` (one int32 per request and head, at least one per SM),
  sized for the largest batch it will see. Without it FlashInfer allocates a fresh zeroed buffer on every
  call (inside a CUDA graph too). It never touches the shared ``flashinfer_float`` buffer.
* out: ``[..., H, kv_lora]`` in the query's dtype (the kernel writes bf16; float32 / float64 only with the
  emulation).

The kernel is one injected callable (``kernel``): the real function (imported by :func:`load_kernel`, only on
that path) or the torch emulation of its contract (``backends/kernels/mla_decode/emulated_mla.py``), so tests can
replace it. The real kernels have not been run by this project's tests (no Blackwell GPU was available).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from backends.base import BackendCapabilities, CudaGraphLevel, by_name, instances, max_decode_tokens
from backends.block_tables import BlockTables
from backends.kernels.mla_decode.emulated_mla import trtllm_counter_bytes
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.errors import Problem
from runtime.core.kv_pool import MLAKVPool, ReqToTokenPool
from runtime.core.model_spec import ModelSpec
from runtime.core.workspace import WorkspaceInputs, WorkspaceLedger, WorkspaceSpec

WORKSPACE = "trtllm_mla_workspace"
COUNTERS = "trtllm_mla_counters"


def load_kernel() -> Callable:
    """The real kernel, ``flashinfer.mla.trtllm_batch_decode_with_kv_cache_mla`` (imports FlashInfer)."""
    from flashinfer.mla import trtllm_batch_decode_with_kv_cache_mla

    return trtllm_batch_decode_with_kv_cache_mla


def latent_problems(name: str, model_cfg: dict) -> list[Problem]:
    """The Blackwell MLA kernels are built for DeepSeek's latent shape (kv_lora_rank 512, rope 64)."""
    if (model_cfg["kv_lora_rank"], model_cfg["qk_rope_head_dim"]) == (512, 64):
        return []
    return [Problem(f"backend '{name}' latent shape",
                    f"kv_lora_rank={model_cfg['kv_lora_rank']}, qk_rope_head_dim={model_cfg['qk_rope_head_dim']}",
                    "kv_lora_rank=512, qk_rope_head_dim=64 (the kernels are built for DeepSeek's latent shape)",
                    "use a DeepSeek-shaped model config, or backend=triton_mla / torch_mla")]


def instance_workspaces(config: dict, model: ModelSpec, max_batch: int, sm_count: int,
                        instance: str = "") -> tuple[WorkspaceSpec, WorkspaceSpec]:
    """One instance's kernel workspace (``backend.workspace_bytes``) and its multi-CTA counters (sized for
    ``max_batch`` requests), both zero-initialised and unshared; named ``...:<instance>`` for a draft step's."""
    def named(base: str) -> str:
        return f"{base}:{instance}" if instance else base

    counters = trtllm_counter_bytes(max(1, int(max_batch)), model.num_heads, int(sm_count))
    return (WorkspaceSpec(named(WORKSPACE), int(config["workspace_bytes"]), zero_init=True, shareable=False),
            WorkspaceSpec(named(COUNTERS), counters, zero_init=True, shareable=False))


class TrtllmMLABackend:
    """Absorbed MLA with TensorRT-LLM-gen's decode kernel (all four forward modes).

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
    kv_pool : MLAKVPool
        Per layer ``[num_pages, page_size, 576]``; page size 32 or 64.
    model : ModelSpec
    ledger : WorkspaceLedger
        Source of this instance's workspace and counter buffer (acquired here, at construction).
    kernel : callable
        ``trtllm_batch_decode_with_kv_cache_mla`` or its emulation (same keyword arguments).
    config : dict
        The `backend` config: ``workspace_bytes``.
    max_batch : int
        The largest batch it will run (``kv.max_requests``, or a larger captured graph size): sizes the counters.
    sm_count : int
        SMs of the GPU (0 on the CPU): the counter buffer holds at least one counter per SM.
    instance : str
        Names this instance's workspaces in the ledger (``...:draft0`` for speculative draft steps).
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        forward_modes=frozenset(ForwardMode),
        # graphs: fixed block-table buffer, max_seq_len = max_context, uniform q_len per request
        cuda_graph=((ForwardMode.DECODE, CudaGraphLevel.SINGLE_TOKEN_DECODE),
                    (ForwardMode.TARGET_VERIFY, CudaGraphLevel.UNIFORM_BATCH),
                    (ForwardMode.DRAFT_EXTEND, CudaGraphLevel.UNIFORM_BATCH)),
        mha_chunked_prefill=False,
        builds_own_kv_indices=True,
        page_sizes=frozenset({32, 64}),
        min_compute_capability=(10, 0),
        compute_capabilities=frozenset({(10, 0), (10, 3)}),  # SM100 (B200, GB200), SM103 (B300, GB300)
        dtypes=frozenset({torch.bfloat16}),
        devices=frozenset({"cuda"}),
        workspaces=frozenset({WORKSPACE, COUNTERS}),
        packages=("flashinfer",),
        install="pip install 'mla-runtime[blackwell]' (on a Blackwell machine)",
        emulation=True,
    )

    @classmethod
    def workspace_specs(cls, inputs: WorkspaceInputs) -> dict[str, WorkspaceSpec]:
        """Every instance's workspace and counters (:func:`instance_workspaces`): the target's, and one pair per
        speculative draft step; acquired by each instance at construction."""
        c = inputs.cfg
        batch = max_decode_tokens(c["kv"], c["graph"])
        return by_name(*(s for i in instances(c["speculative"])
                         for s in instance_workspaces(c["backend"], inputs.model, batch, inputs.device.sm_count, i)))

    @classmethod
    def config_problems(cls, backend_cfg: dict, model_cfg: dict, device) -> list[Problem]:
        name = backend_cfg.get("name", "trtllm_mla")
        out = latent_problems(name, model_cfg)
        h = model_cfg["num_heads"]
        if 64 < h < 128 or h > 128:
            out.append(Problem(f"backend '{name}' num_heads", str(h),
                               "<= 64 or exactly 128 (TRT-LLM-gen has MLA decode kernels for those head counts)",
                               "shard heads differently (e.g. tensor parallel 8 gives 16 heads), or backend=triton_mla"))
        if backend_cfg["workspace_bytes"] < 1:
            out.append(Problem("backend.workspace_bytes", str(backend_cfg["workspace_bytes"]), ">= 1",
                               "set backend.workspace_bytes=134217728"))
        return out

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MLAKVPool, model: ModelSpec,
                 ledger: WorkspaceLedger, kernel: Callable, config: dict, max_batch: int, sm_count: int,
                 instance: str = ""):
        self.name = str(config.get("name", "trtllm_mla"))
        self.consumer = f"{self.name}:{instance}" if instance else self.name
        self.kernel = kernel
        self.req_to_token_pool, self.kv_pool, self.model = req_to_token_pool, kv_pool, model
        self.page_size = kv_pool.page_size
        self.tables = BlockTables(req_to_token_pool, self.page_size, align=max(1, 128 // self.page_size))

        workspace, counters = instance_workspaces(config, model, max_batch, sm_count, instance)
        self.workspace = ledger.acquire(workspace, self.consumer)
        self.counters = ledger.acquire(counters, self.consumer)

    # ------------------------------------------------------------------------------------- metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Block tables [B, W] gathered from the request table; max_seq_len from the host mirror."""
        if batch.mode not in self.capabilities.forward_modes:
            raise ValueError(f"{self.name}: forward mode {batch.mode.value!r} is not supported")
        self.tables.for_step(batch)

    def init_graph_state(self, batch: ForwardBatch) -> None:
        """A static block table for up to ``batch.batch_size`` requests (one serves every graphed mode)."""
        self.tables.init_graph_state(batch.batch_size)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.tables.for_capture(batch.batch_size)  # max_seq_len = max_context, a constant the launch keeps

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.tables.for_replay(batch)

    # -------------------------------------------------------------------------------------- forwards
    def _call(self, query: torch.Tensor, layer_id: int, batch: ForwardBatch, **var_q) -> torch.Tensor:
        out = torch.empty(query.shape[:-1] + (self.model.kv_lora_rank,), dtype=query.dtype, device=query.device)
        return self.kernel(
            query=query, kv_cache=self.kv_pool.buffer(layer_id), workspace_buffer=self.workspace,
            qk_nope_head_dim=self.model.qk_nope_head_dim, kv_lora_rank=self.model.kv_lora_rank,
            qk_rope_head_dim=self.model.qk_rope_head_dim, block_tables=self.tables.current, seq_lens=batch.seq_lens,
            max_seq_len=self.tables.max_seq_len, out=out, bmm1_scale=self.model.sm_scale, bmm2_scale=1.0,
            backend="trtllm-gen", multi_ctas_kv_counter_buffer=self.counters, **var_q,
        )

    def forward_decode(self, q_nope, q_pe, layer_id, batch):
        """q_nope [B, H, 512], q_pe [B, H, 64] -> [B, H, 512] (query [B, 1, H, 576])."""
        b, h = q_nope.shape[:2]
        query = torch.cat([q_nope, q_pe], dim=-1).view(b, 1, h, -1)
        return self._call(query, layer_id, batch).view(b, h, -1)

    def forward_extend(self, q_nope, q_pe, layer_id, batch):
        """q_nope [T, H, 512], q_pe [T, H, 64] -> [T, H, 512]. Uniform new tokens per request (verify, draft
        extend): query [B, q_len, H, 576]; otherwise (prefill) the compact [T, H, 576] with cum_seq_lens_q."""
        t, h = q_nope.shape[:2]
        query = torch.cat([q_nope, q_pe], dim=-1)
        b, n = batch.batch_size, batch.max_extend_len
        if t == b * n:
            return self._call(query.view(b, n, h, -1), layer_id, batch).view(t, h, -1)
        return self._call(query, layer_id, batch, cum_seq_lens_q=batch.qo_indptr, max_q_len=n)
