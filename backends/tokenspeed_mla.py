"""TokenSpeed's CuTe DSL MLA decode on Blackwell (SM100 / SM103 / SM107): ``tokenspeed_mla.tokenspeed_mla_decode``.

Contract (tokenspeed-mla 2.0.4, read from its source):

* query ``[B, q_len, H, kv_lora + rope]`` (= ``q_nope | q_pe``), bf16 or fp16, kv_cache the pool's
  ``[num_pages, page_size, 576]`` in the same dtype; q_len 1 (DECODE) or the uniform ``num_steps + 1``
  (TARGET_VERIFY / DRAFT_EXTEND, ``causal_mask=True``: bottom-right causal within the q_len rows). The kernel
  compiles once per (q_len, heads, page size, ...), so only those few q_lens ever reach it.
* block_tables ``[B, W]`` int32 page ids (built here: ``builds_own_kv_indices``), seq_lens ``[B]`` int32,
  ``max_seq_len`` (the batch's longest; ``max_context`` inside a CUDA graph), ``softmax_scale`` = the model's,
  ``output_scale`` = 1.0, ``is_var_seq=True``.
* workspace_buffer: a contiguous **int8** buffer for the split-KV partials. The kernel picks
  ``split_kv = min(max(1, SMs // B // (2 q_len_eff)), 32)`` and needs ``B * H_eff * q_len_eff * split_kv *
  (kv_lora + 1) * 4`` bytes; since ``B * q_len_eff * split_kv <= SMs / 2`` and ``H_eff <= min(128, H * q_len)``,
  ``SMs // 2 * min(128, H * max_q_len) * (kv_lora + 1) * 4`` bytes cover every call: that is allocated once,
  at construction, through the ledger (``tokenspeed_mla_workspace``), never the FlashInfer float buffer.

Prefill (EXTEND, lengths differing per request) does not go through the kernel (each new q_len would compile
a new kernel): it runs plain torch absorbed attention over the same block tables, 64 query rows at a time
(correct, not fast; TokenSpeed's ragged ``tokenspeed_mla_prefill`` as an MHA prefill hook is not wired).

The kernel is one injected callable (``kernel``): the real function (imported by :func:`load_kernel`) or the
torch emulation of its contract. The real kernels have not been run by this project's tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from backends import mla_math
from backends.base import BackendCapabilities, CudaGraphLevel, by_name, instances, max_q_len
from backends.block_tables import BlockTables
from backends.kernels.mla_decode.emulated_mla import tokenspeed_workspace_bound
from backends.trtllm_mla import latent_problems
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.device import DeviceInfo
from runtime.core.errors import Problem
from runtime.core.kv_pool import MLAKVPool, ReqToTokenPool
from runtime.core.model_spec import ModelSpec
from runtime.core.workspace import WorkspaceInputs, WorkspaceLedger, WorkspaceSpec

WORKSPACE = "tokenspeed_mla_workspace"
PREFILL_ROWS = 64  # query rows per torch prefill block (bounds the [rows, H, L] score tensor)


def load_kernel() -> Callable:
    """The real kernel, ``tokenspeed_mla.tokenspeed_mla_decode`` (imports tokenspeed_mla and CuTe DSL)."""
    from tokenspeed_mla import tokenspeed_mla_decode

    return tokenspeed_mla_decode


def sized_sm_count(info: DeviceInfo, emulated: int) -> int:
    """The GPU's SM count, or (the CPU) the count the emulation sizes for (``backend.emulated_sm_count``)."""
    return info.sm_count or emulated


def workspace_spec(sm_count: int, model: ModelSpec, max_q_len: int, instance: str = "") -> WorkspaceSpec:
    """int8 split-KV scratch covering every decode / verify call (see the module docstring), unshared."""
    name = f"{WORKSPACE}:{instance}" if instance else WORKSPACE
    nbytes = tokenspeed_workspace_bound(sm_count, model.num_heads, model.kv_lora_rank, max_q_len)
    return WorkspaceSpec(name, max(nbytes, 1), zero_init=False, shareable=False)


class TokenSpeedMLABackend:
    """Absorbed MLA with TokenSpeed's decode kernel (decode, verify, draft extend) and torch prefill.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
    kv_pool : MLAKVPool
    model : ModelSpec
    ledger : WorkspaceLedger
        Source of the split-KV workspace, acquired here (at construction).
    kernel : callable
        ``tokenspeed_mla_decode`` or its emulation (same keyword arguments).
    config : dict
        The `backend` config.
    sm_count : int
        SMs of the GPU the workspace is sized for.
    max_q_len : int
        Most query tokens per request a kernel call gets: 1, or ``speculative.num_steps + 1``.
    instance : str
        Names this instance's workspace in the ledger (``...:draft0`` for speculative draft steps).
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        forward_modes=frozenset(ForwardMode),
        cuda_graph=((ForwardMode.DECODE, CudaGraphLevel.SINGLE_TOKEN_DECODE),
                    (ForwardMode.TARGET_VERIFY, CudaGraphLevel.UNIFORM_BATCH),
                    (ForwardMode.DRAFT_EXTEND, CudaGraphLevel.UNIFORM_BATCH)),
        mha_chunked_prefill=False,
        builds_own_kv_indices=True,
        page_sizes=frozenset({2, 4, 8, 16, 32, 64, 128}),  # divides the 128-key tile, not 1
        min_compute_capability=(10, 0),
        compute_capabilities=frozenset({(10, 0), (10, 3), (10, 7)}),  # SM100, SM103, SM107
        dtypes=frozenset({torch.bfloat16, torch.float16}),
        devices=frozenset({"cuda"}),
        workspaces=frozenset({WORKSPACE}),
        packages=("tokenspeed_mla",),
        install="pip install 'mla-runtime[blackwell]' (on a Blackwell machine)",
        emulation=True,
    )

    @classmethod
    def workspace_specs(cls, inputs: WorkspaceInputs) -> dict[str, WorkspaceSpec]:
        """Every instance's split-KV scratch (:func:`workspace_spec`): the target's, and one per speculative draft
        step; acquired by each instance at construction."""
        c = inputs.cfg
        sms = sized_sm_count(inputs.device, c["backend"]["emulated_sm_count"])
        return by_name(*(workspace_spec(sms, inputs.model, max_q_len(c["speculative"]), i)
                         for i in instances(c["speculative"])))

    @classmethod
    def config_problems(cls, backend_cfg: dict, model_cfg: dict, device) -> list[Problem]:
        name = backend_cfg.get("name", "tokenspeed_mla")
        out = latent_problems(name, model_cfg)
        if not 1 <= model_cfg["num_heads"] <= 128:
            out.append(Problem(f"backend '{name}' num_heads", str(model_cfg["num_heads"]), "1..128",
                               "shard heads with tensor parallelism, or backend=triton_mla"))
        if backend_cfg["emulated_sm_count"] < 1:
            out.append(Problem("backend.emulated_sm_count", str(backend_cfg["emulated_sm_count"]), ">= 1",
                               "set backend.emulated_sm_count=148"))
        return out

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MLAKVPool, model: ModelSpec,
                 ledger: WorkspaceLedger, kernel: Callable, config: dict, sm_count: int, max_q_len: int,
                 instance: str = ""):
        self.name = str(config.get("name", "tokenspeed_mla"))
        self.consumer = f"{self.name}:{instance}" if instance else self.name
        self.kernel = kernel
        self.req_to_token_pool, self.kv_pool, self.model = req_to_token_pool, kv_pool, model
        self.page_size = kv_pool.page_size
        self.tables = BlockTables(req_to_token_pool, self.page_size)
        self.workspace = ledger.acquire(workspace_spec(sm_count, model, max_q_len, instance),
                                        self.consumer).view(torch.int8)

    # ------------------------------------------------------------------------------------- metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Block tables [B, W] gathered from the request table; max_seq_len from the host mirror."""
        if batch.mode not in self.capabilities.forward_modes:
            raise ValueError(f"{self.name}: forward mode {batch.mode.value!r} is not supported")
        self.tables.for_step(batch)

    def init_graph_state(self, batch: ForwardBatch) -> None:
        self.tables.init_graph_state(batch.batch_size)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self.tables.for_capture(batch.batch_size)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.tables.for_replay(batch)

    # -------------------------------------------------------------------------------------- forwards
    def _call(self, query: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        out = torch.empty(query.shape[:-1] + (self.model.kv_lora_rank,), dtype=query.dtype, device=query.device)
        return self.kernel(
            query=query, kv_cache=self.kv_pool.buffer(layer_id), workspace_buffer=self.workspace,
            kv_lora_rank=self.model.kv_lora_rank, qk_rope_head_dim=self.model.qk_rope_head_dim,
            block_tables=self.tables.current, seq_lens=batch.seq_lens, max_seq_len=self.tables.max_seq_len,
            softmax_scale=self.model.sm_scale, output_scale=1.0, out=out, is_var_seq=True, causal_mask=True,
        )

    def forward_decode(self, q_nope, q_pe, layer_id, batch):
        """q_nope [B, H, 512], q_pe [B, H, 64] -> [B, H, 512] (query [B, 1, H, 576])."""
        b, h = q_nope.shape[:2]
        query = torch.cat([q_nope, q_pe], dim=-1).view(b, 1, h, -1)
        return self._call(query, layer_id, batch).view(b, h, -1)

    def forward_extend(self, q_nope, q_pe, layer_id, batch):
        """q_nope [T, H, 512], q_pe [T, H, 64] -> [T, H, 512]: the kernel for uniform new tokens per request
        (verify, draft extend), torch absorbed attention per request otherwise (prefill)."""
        t, h = q_nope.shape[:2]
        query = torch.cat([q_nope, q_pe], dim=-1)
        b, n = batch.batch_size, batch.max_extend_len
        if t == b * n and batch.mode != ForwardMode.EXTEND:
            return self._call(query.view(b, n, h, -1), layer_id, batch).view(t, h, -1)
        return self._torch_prefill(query, layer_id, batch)

    def _torch_prefill(self, query: torch.Tensor, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """Per request and block of query rows: query row i of a request with n new tokens sees keys up to
        ``seq_len - n + i``. Host loop over the host mirrors (prefill is never graphed)."""
        out = torch.empty(query.shape[:-1] + (self.model.kv_lora_rank,), dtype=query.dtype, device=query.device)
        cache, qo = self.kv_pool.buffer(layer_id), batch.qo_indptr_cpu.tolist()
        seq = batch.seq_lens_cpu.tolist()
        for r in range(batch.batch_size):
            for s in range(qo[r], qo[r + 1], PREFILL_ROWS):
                e = min(s + PREFILL_ROWS, qo[r + 1])
                visible = seq[r] - (qo[r + 1] - e)  # keys of the block's last row
                lens = torch.full((1,), visible, dtype=torch.int32, device=query.device)
                out[s:e] = mla_math.paged_absorbed_attention(
                    query[None, s:e], cache, self.tables.current[r : r + 1], lens, self.model.kv_lora_rank,
                    self.model.sm_scale, 1.0)[0]
        return out
