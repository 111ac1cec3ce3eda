"""Our own Triton MLA kernels: split-KV absorbed decode, causal absorbed extend.

The backend consumes one workspace, ``triton_split_kv`` (partial outputs and log-sum-exps of the split-KV
decode), and never the FlashInfer buffer. The kernels live in ``backends/kernels`` and are imported when
the backend is built, so the module imports on machines without Triton (validation says what is missing).
Under ``TRITON_INTERPRET=1`` the kernels also run on the CPU (slowly), which is how CI tests them.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from backends.base import BackendCapabilities, CudaGraphLevel, by_name
from backends.kernels.mla_decode.mla_decode_workspace import decode_work_ints
from runtime.core.batch import ForwardBatch, ForwardMode
from runtime.core.kv_pool import MLAKVPool, ReqToTokenPool
from runtime.core.model_spec import ModelSpec
from runtime.core.workspace import WorkspaceInputs, WorkspaceSpec

WORKSPACE = "triton_split_kv"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def split_kv_workspace_spec(model: ModelSpec, backend_cfg: dict) -> WorkspaceSpec:
    """Partial outputs (float32 [slots, H, kv_lora]) and LSEs (float32 [slots, H]) of the split-KV decode, and at
    the end the work list of its wgmma stage 1 (int32, :func:`_work_ints`; Hopper).

    ``split_slots`` bounds (batch x splits): a decode batch of B requests gets at most
    ``min(max_splits, split_slots // B)`` splits per request, so the scratch does not grow with the batch.
    Shareable: it is scratch of one decode call (partials written, then merged), so the target and every
    speculative draft step, which run one after another on one stream, use the same buffer.
    """
    slots, h = int(backend_cfg["split_slots"]), model.num_heads
    nbytes = slots * h * (model.kv_lora_rank + 1) * 4 + _work_ints(slots, h) * 4
    return WorkspaceSpec(WORKSPACE, nbytes=nbytes, zero_init=False, shareable=True)


def _work_ints(split_slots: int, heads: int) -> int:
    """int32 of the decode plan (``work``) that :func:`backends.kernels.mla_decode.mla_decode.mla_decode` checks on
    every call: a batch's requests never exceed the split slots, nor its programs (the launcher's own bound,
    :func:`~backends.kernels.mla_decode.mla_decode_workspace.decode_work_ints`)."""
    return decode_work_ints(split_slots, heads, split_slots)


class TritonMLABackend:
    """Absorbed MLA over the paged cache with our Triton kernels.

    Parameters
    ----------
    req_to_token_pool : ReqToTokenPool
    kv_pool : MLAKVPool
    model : ModelSpec
    split_kv_workspace : torch.Tensor
        uint8 [nbytes] from the ledger (see :func:`split_kv_workspace_spec`).
    config : dict
        The `backend` config: max_splits, split_slots, min_tokens_per_split, block_n, block_h, fp8_scores (64-head
        blocks over an fp8 cache on Hopper: fp8 or fp16 score products, see
        :func:`backends.kernels.mla_decode.mla_decode.mla_decode`).
    pdl : bool
        Launch both decode stages with programmatic dependent launch where the GPU has it (``model.pdl``, the same
        switch as the fused decoder kernels': a graphed step is one chain of PDL kernels).
    """

    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        forward_modes=frozenset(ForwardMode),  # verify / draft extend run the causal extend kernel
        # the extend kernel's grid depends only on max_q_len and the request count and it reads the lengths on the
        # device: uniform batches graph, and so does prefill over a padded layout (runtime/engine/prefill_graphs.py)
        cuda_graph=((ForwardMode.DECODE, CudaGraphLevel.SINGLE_TOKEN_DECODE),
                    (ForwardMode.TARGET_VERIFY, CudaGraphLevel.UNIFORM_BATCH),
                    (ForwardMode.DRAFT_EXTEND, CudaGraphLevel.UNIFORM_BATCH),
                    (ForwardMode.EXTEND, CudaGraphLevel.ALWAYS)),
        mha_chunked_prefill=False,
        builds_own_kv_indices=True,
        page_sizes=None,
        min_compute_capability=(8, 0),
        dtypes=frozenset({torch.bfloat16, torch.float16, torch.float32}),
        kv_dtypes=frozenset({"auto", "fp8_e4m3"}),
        devices=frozenset({"cuda", "cpu"} if _INTERPRET else {"cuda"}),
        workspaces=frozenset({WORKSPACE}),
        packages=("triton",),
    )

    @classmethod
    def workspace_specs(cls, inputs: WorkspaceInputs) -> dict[str, WorkspaceSpec]:
        """The split-KV scratch (:func:`split_kv_workspace_spec`), shared by the target and every draft step."""
        return by_name(split_kv_workspace_spec(inputs.model, inputs.cfg["backend"]))

    @classmethod
    def config_problems(cls, backend_cfg: dict, model_cfg: dict, device) -> list:
        from runtime.core.errors import Problem

        out = []
        for key in ("max_splits", "split_slots", "min_tokens_per_split"):
            if backend_cfg[key] < 1:
                out.append(Problem(f"backend.{key}", str(backend_cfg[key]), ">= 1", f"set backend.{key} to a positive value"))
        for key in ("block_n", "block_h"):
            v = backend_cfg[key]
            if v is not None and (v < 16 or v & (v - 1)):
                out.append(Problem(f"backend.{key}", str(v), "null or a power of two >= 16 (tl.dot tiles)",
                                   f"set backend.{key}=null"))
        for key in ("kv_lora_rank", "qk_rope_head_dim"):
            v = model_cfg[key]
            if v & (v - 1):
                out.append(Problem(f"model.{key} with backend triton_mla", str(v), "a power of two",
                                   "use DeepSeek latent dims (512 / 64)"))
        return out

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: MLAKVPool,
        model: ModelSpec,
        split_kv_workspace: torch.Tensor,
        config: dict,
        pdl: bool = False,
    ):
        from backends.kernels.mla_decode.mla_decode import mla_decode
        from backends.kernels.mla_extend.mla_extend import mla_extend

        self._decode_kernel, self._extend_kernel = mla_decode, mla_extend
        self.req_to_token_pool, self.kv_pool, self.model = req_to_token_pool, kv_pool, model
        self.workspace = split_kv_workspace
        n_work = _work_ints(int(config["split_slots"]), model.num_heads)
        self._work = split_kv_workspace.view(torch.int32)[-n_work:]  # the spec's tail
        self.max_splits = int(config["max_splits"])
        self.split_slots = int(config["split_slots"])
        self.min_tokens_per_split = int(config["min_tokens_per_split"])
        self.block_n, self.block_h = config["block_n"], config["block_h"]
        self.fp8_scores = config["fp8_scores"]
        self.pdl = bool(pdl)
        self.page_size = kv_pool.page_size
        self.page_table = torch.empty(0, 0, dtype=torch.int32)
        self._graph_page_table = torch.empty(0, 0, dtype=torch.int32)
        # the decode plan of the running forward pass (written by its first layer's call, reused by the others) and
        # the last layer decoded: a layer id not above it starts a new pass, which plans again (the graph runner's
        # warm-ups and capture run several passes after one metadata hook)
        self._plan, self._last_layer = None, -1

    def _new_step(self) -> None:
        self._plan, self._last_layer = None, -1

    def _gather_page_table(self, batch: ForwardBatch, width: int) -> torch.Tensor:
        """[B, width] int32 page ids, gathered on the device from the request table."""
        table = self.req_to_token_pool.req_to_token
        cols = torch.arange(0, width * self.page_size, self.page_size, device=table.device)
        cols = cols.clamp_max(table.shape[1] - 1)
        return (table[batch.req_pool_indices[:, None], cols[None, :]] // self.page_size).to(torch.int32)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Page table [B, ceil(max_len / page_size)] for this step."""
        self._new_step()
        self.page_table = self._gather_page_table(batch, -(-batch.max_seq_len // self.page_size))

    # ------------------------------------------------------------------------------- decode graphs
    def init_graph_state(self, batch: ForwardBatch) -> None:
        """A static page table wide enough for the longest request the request table can hold, or the longest
        ``batch`` holds (a prefill graph's padding request may exceed ``max_context``: its rows read the padding
        page); one table serves every graphed mode (modes never replay concurrently), sized for the largest batch
        and width asked."""
        rows, cols = self._graph_page_table.shape
        width = -(-max(self.req_to_token_pool.max_context, batch.max_seq_len) // self.page_size)
        if batch.batch_size <= rows and width <= cols:
            return
        self._graph_page_table = torch.zeros(max(rows, batch.batch_size), max(cols, width), dtype=torch.int32,
                                             device=self.workspace.device)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        self._new_step()
        self.page_table = self._graph_page_table[: batch.batch_size]

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        """Refresh the static page table in place (the kernel reads only pages below each seq_len)."""
        width = -(-batch.max_seq_len // self.page_size)
        self._new_step()
        self.page_table = self._graph_page_table[: batch.batch_size]
        self.page_table[:, :width].copy_(self._gather_page_table(batch, width))

    def _partials(self, batch_size: int, heads: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        splits = max(1, min(self.max_splits, self.split_slots // max(batch_size, 1)))
        n_out = batch_size * heads * splits * self.model.kv_lora_rank
        f32 = self.workspace.view(torch.float32)
        partial_out = f32[:n_out].view(batch_size, heads, splits, self.model.kv_lora_rank)
        partial_lse = f32[n_out : n_out + batch_size * heads * splits].view(batch_size, heads, splits)
        return partial_out, partial_lse, splits

    def forward_decode(self, q_nope, q_pe, layer_id, batch):
        """One layer's decode. On Hopper the first layer of a forward pass writes the work plan (one small kernel)
        and the others reuse it: it depends only on the lengths, the same for every layer of a step."""
        b, h = q_nope.shape[:2]
        out = torch.empty(b, h, self.model.kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)
        partial_out, partial_lse, splits = self._partials(b, h)
        reuse = self._plan if layer_id > self._last_layer else None
        self._plan = self._decode_kernel(
            q_nope, q_pe, self.kv_pool.buffer(layer_id), self.page_table, batch.seq_lens, self.model.sm_scale,
            out, partial_out, partial_lse, max_splits=splits, min_tokens_per_split=self.min_tokens_per_split,
            block_n=self.block_n, block_h=self.block_h, kv_scale=self.kv_pool.scale, pdl=self.pdl, work=self._work,
            plan=reuse, fp8_scores=self.fp8_scores,
        )
        self._last_layer = layer_id
        return out

    def forward_extend(self, q_nope, q_pe, layer_id, batch):
        t, h = q_nope.shape[:2]
        out = torch.empty(t, h, self.model.kv_lora_rank, dtype=q_nope.dtype, device=q_nope.device)
        self._extend_kernel(
            q_nope, q_pe, self.kv_pool.buffer(layer_id), self.page_table, batch.qo_indptr, batch.seq_lens,
            self.model.sm_scale, out, max_q_len=batch.max_extend_len, kv_scale=self.kv_pool.scale,
        )
        return out
