"""The whole object graph of a runtime, in build order: read it top to bottom.

tensor-parallel group -> device -> pools (DeepSeek-V4: window ring, compressed-entry pools, compressor state) ->
HiSparse coordinator (when enabled) -> the engine's token allocator -> workspace ledger, the collectives (and their
IPC workspace) and named workspaces -> backend
(chosen by ``config.backend.name``) -> model -> (speculative: draft KV pool, one draft backend per step,
draft model) -> graphs -> engine. Every object receives its collaborators in ``__init__``. Only what the
engine needs is built: the selected backend, and the workspaces that backend asks for.

``build(cfg)`` is the one public way to get a wired runtime. It validates first (every problem, one
error, nothing allocated), then builds, recording the order in which providers ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dependency_injector import containers, providers
from omegaconf import DictConfig, OmegaConf

from backends.base import (
    DRAFT_INSTANCE,
    GraphHooks,
    MHAChunkPrefill,
    decode_graph_hook,
    max_decode_tokens,
    max_q_len,
    mha_prefill_hook,
    sparse_hook,
)
from backends.dsa import DSABackend
from backends.dsv4 import DSV4Backend
from backends.dsv4_flashinfer import FlashInferDecode
from backends.dsv4_flashinfer import load_kernel as load_dsv4_kernel
from backends.flashinfer_mla import FlashInferMLABackend
from backends.hybrid_linear import HybridLinearBackend
from backends.kernels.comm.peer_allreduce import make_collectives
from backends.kernels.dsv4.emulated_dsv4 import EmulatedDSV4SparseDecode
from backends.kernels.mla_decode.emulated_mla import EmulatedTokenSpeedMLADecode, EmulatedTrtllmMLADecode
from backends.linear_attention import LinearAttentionBackend
from backends.multi_step_draft import MultiStepDraftBackend, draft_sparse_hook, shared_kv_indices_pass
from backends.tokenspeed_mla import TokenSpeedMLABackend, sized_sm_count
from backends.tokenspeed_mla import load_kernel as load_tokenspeed_kernel
from backends.torch_mla import TorchMLABackend
from backends.triton_mla import TritonMLABackend
from backends.trtllm_mla import TrtllmMLABackend
from backends.trtllm_mla import load_kernel as load_trtllm_kernel
from runtime.app.memory_checks import agree_problems, memory_problems, plan_memory
from runtime.app.parallel_checks import parallel_problems, rank_view
from runtime.app.validation import validate
from runtime.app.weights_checks import weights_problems
from runtime.core.device import DeviceInfo, probe_device
from runtime.core.dsv4_pools import DSV4Pools
from runtime.core.dsv4_slots import DSV4TokenSlots
from runtime.core.dsv4_spec import DSV4LayerType
from runtime.core.errors import ConfigError
from runtime.core.kv_pool import MLAKVPool, PageAllocator, ReqToTokenPool, TokenSlots
from runtime.core.memory_plan import DeviceMemory
from runtime.core.model_spec import ModelSpec
from runtime.core.parallel import LaunchEnv, Sharding, device_for, make_group
from runtime.core.sparse import OffloadedRows
from runtime.core.state_pool import LinearStatePool
from runtime.core.workspace import WorkspaceInputs, WorkspaceLedger, WorkspaceSpec
from runtime.engine.engine import Engine
from runtime.engine.graph_runner import (
    GraphRunner,
    copies_per_size,
    decide_graphs,
    overlap_enabled,
    plain_mode_graphs,
    speculative_mode_graphs,
)
from runtime.engine.hisparse import HiSparseCoordinator, host_page_count
from runtime.engine.oom import OOMGuard
from runtime.engine.prompts import load_workload
from runtime.engine.sampling import Sampler
from runtime.engine.speculative import DraftSteps, SpeculativeDriver
from runtime.model.deepseek.checkpoint import load_checkpoint, scan_checkpoint
from runtime.model.deepseek.hf_config import resolve_model_config
from runtime.model.deepseek.ops import GEMM_COUNTERS, FusedOps, TorchOps, select_ops
from runtime.model.deepseek.weights import ModelWeights, random_weights
from runtime.model.dsv4.checkpoint import load_dsv4_checkpoint, random_dsv4_weights, scan_dsv4_checkpoint
from runtime.model.dsv4.hf_config import dsv4_config
from runtime.model.dsv4.model import DSV4Model
from runtime.model.dsv4.sharding import rank_config
from runtime.model.dsv4.stored import StoredFormat
from runtime.model.dump import AttentionDumper
from runtime.model.indexer import IndexKeyPool
from runtime.model.mla_model import MLAModel

# name -> class, for validation (capabilities are class data, read before anything is built). The
# Selector below has one provider per name; a test checks the two agree.
BACKENDS: dict[str, type] = {
    "torch_mla": TorchMLABackend,
    "triton_mla": TritonMLABackend,
    "flashinfer_mla": FlashInferMLABackend,
    "dsa": DSABackend,
    "dsv4": DSV4Backend,
    "trtllm_mla": TrtllmMLABackend,
    "tokenspeed_mla": TokenSpeedMLABackend,
}
# Workspaces the report always lists (0 bytes when nobody consumed them); FlashInfer's per-wrapper int
# workspaces (flashinfer_int:*) appear when a FlashInfer backend acquires them.
WORKSPACES = ("flashinfer_float", "triton_split_kv", "dsa_sparse_decode", "dsa_indexer", "dsv4_decode_splits",
              "allreduce_ipc", GEMM_COUNTERS.name)


class BuildLog:
    """Names of the providers in the order they built their object."""

    def __init__(self) -> None:
        self.names: list[str] = []


def _record(log: BuildLog, name: str, obj: Any) -> Any:
    log.names.append(name)
    return obj


def _step(log: providers.Provider, name: str, factory: providers.Provider) -> providers.Singleton:
    """A singleton that builds ``factory`` once (its dependencies first) and records ``name``."""
    return providers.Singleton(_record, log, name, factory)


def _weight_source(spec: ModelSpec) -> str:
    """'checkpoint' when the model is a Hugging Face folder (model.path), else 'random' (a preset); prefixed
    'dsv4_' for a DeepSeek-V4 model (its own weight layout)."""
    return ("dsv4_" if spec.is_dsv4 else "") + ("checkpoint" if spec.path else "random")


def _rank_device_index(group, configured: int) -> int:
    """The GPU index this rank runs on: the group's (LOCAL_RANK with tp > 1), else ``device.index``."""
    return group.device.index if group.device.index is not None else configured


def _rank_spec(spec: ModelSpec, group) -> ModelSpec:
    return spec.for_rank(group.size)


def _draft_weights(model: MLAModel, n: int) -> ModelWeights:
    return model.weights.first(n)


def _on_off(enabled: bool) -> str:
    return "on" if enabled else "off"


def _has_sparse_layers(spec: ModelSpec) -> str:
    return "yes" if spec.sparse_layers else "no"


def _index_key_slots(num_pages: int, page_size: int, hisparse: bool, ratio: float) -> int:
    """Rows of the indexer key cache: one per device KV slot, or per host slot with HiSparse (keys are
    stored by host slot there, so they outlive the device pages a request prefilled in)."""
    return (host_page_count(num_pages, ratio) if hisparse else num_pages) * page_size


def _model_kind(spec: ModelSpec) -> str:
    """'dsv4' for a DeepSeek-V4 model (V4 pools, the dsv4 backend, the V4 model); 'hybrid' when the model has
    linear-attention layers (the wrapper routes them); else 'mla'."""
    if spec.is_dsv4:
        return "dsv4"
    return "hybrid" if spec.linear_layers else "mla"


def _slots_kind(kind: str, hisparse: bool) -> str:
    """Which token allocator the engine reserves through: the HiSparse coordinator (which wraps the V4 one or the
    plain one), the V4 one, or plain."""
    return "on" if hisparse else ("dsv4" if kind == "dsv4" else "off")


def _csa_layers(cfg) -> list[int]:
    """The V4 layers whose compressed entries HiSparse offloads (those the indexer's top-k selects)."""
    return cfg.attention.layers_of(DSV4LayerType.csa)


def _dsv4_kernel_kind(impl: str, kernel: str) -> str:
    """Which FlashInfer decode the dsv4 backend gets: none unless impl=flashinfer (so FlashInfer is imported only
    then), else the real kernel or its emulation."""
    return kernel if str(impl) == "flashinfer" else "none"


def _wrapper_mha(hybrid: HybridLinearBackend) -> MHAChunkPrefill | None:
    return hybrid if hybrid.mha is not None else None


def _wrapper_graph(hybrid: HybridLinearBackend) -> GraphHooks | None:
    return hybrid if hybrid.graph is not None else None


def _instances(factory: providers.Provider, n: int, **per_instance: str) -> list:
    """``n`` objects from ``factory``; each keyword value is formatted with the instance index ``i``."""
    return [factory(**{k: v.format(i=i) for k, v in per_instance.items()}) for i in range(n)]


def _acquire(ledger: WorkspaceLedger, specs: dict[str, WorkspaceSpec], name: str, consumer: str):
    """The ledger's buffer of workspace ``name`` of the selected backend class's ``workspace_specs``."""
    return ledger.acquire(specs[name], consumer)


class Container(containers.DeclarativeContainer):
    config = providers.Configuration(strict=True)
    build_log = providers.Singleton(BuildLog)

    # 0. the tensor-parallel group (torch.distributed; a no-op group for tp=1), first: it picks this rank's GPU
    launch = providers.Singleton(LaunchEnv.from_environ)
    tp_group = _step(build_log, "tp_group", providers.Factory(
        make_group, config.parallel.tp, config.device.kind, config.device.index, launch))
    sharding = providers.Singleton(Sharding, tp_group.provided.rank, tp_group.provided.size, config.parallel.moe)

    # 1. device --------------------------------------------------------------------------------------
    device_info = _step(build_log, "device", providers.Factory(
        probe_device, config.device.kind, providers.Callable(_rank_device_index, tp_group, config.device.index)))
    device = providers.Callable(lambda info: info.torch_device, device_info)
    # the full model (what checkpoints hold) and what this rank computes with (its share of the heads)
    full_model_spec = providers.Singleton(ModelSpec.from_config, config.model)
    model_spec = providers.Singleton(_rank_spec, full_model_spec, tp_group)
    # the memory plan (docs/memory.md): the injectable reader (tests: FixedMemory), then the budget line by line and
    # the page count (kv.num_pages=auto: what memory.fraction of the memory left holds); build() refuses what cannot fit
    memory_reader = providers.Singleton(DeviceMemory)
    memory_budget = _step(build_log, "memory_plan", providers.Singleton(
        plan_memory, config, BACKENDS, device_info, memory_reader, tp_group))

    # 2. pools ---------------------------------------------------------------------------------------
    req_to_token_pool = _step(build_log, "req_to_token_pool", providers.Factory(
        ReqToTokenPool, config.kv.max_requests, model_spec.provided.max_context, device))
    page_allocator = _step(build_log, "page_allocator", providers.Factory(
        PageAllocator, config.kv.num_pages, config.kv.page_size))
    token_slots = _step(build_log, "token_slots", providers.Factory(TokenSlots, req_to_token_pool, page_allocator))
    model_kind = providers.Callable(_model_kind, model_spec)
    mla_kv_pool = _step(build_log, "kv_pool", providers.Factory(
        MLAKVPool,
        layer_ids=model_spec.provided.kv_cache_layers,
        num_pages=config.kv.num_pages,
        page_size=config.kv.page_size,
        kv_lora_rank=model_spec.provided.kv_lora_rank,
        qk_rope_head_dim=model_spec.provided.qk_rope_head_dim,
        dtype=model_spec.provided.dtype,
        device=device,
        kv_dtype=config.kv.dtype,
        scale=config.kv.scale,
    ))

    kv_pool = providers.Selector(model_kind, mla=mla_kv_pool, hybrid=mla_kv_pool, dsv4=providers.Object(None))
    # DeepSeek-V4: window ring, compressed-entry pools and compressor state, sized by the token pages
    dsv4_cfg = providers.Singleton(dsv4_config, config.model)  # the full model's (checkpoint shapes, sharding)
    dsv4_rank_cfg = providers.Singleton(rank_config, dsv4_cfg, tp_group.provided.size)  # this rank's heads, groups
    dsv4_stored = providers.Singleton(StoredFormat.of, config.model)  # the checkpoint's fp8 / fp4 storage
    dsv4_pools = providers.Selector(
        model_kind, mla=providers.Object(None), hybrid=providers.Object(None),
        dsv4=_step(build_log, "dsv4_pools", providers.Factory(
            DSV4Pools.for_token_pages, dsv4_rank_cfg.provided.attention, config.kv.max_requests,
            model_spec.provided.max_context, config.kv.num_pages, config.kv.page_size, model_spec.provided.dtype,
            device, config.hisparse.enabled)))  # HiSparse: the CSA entries live in the coordinator's host pool

    index_key_pool = providers.Selector(  # sparse models: the indexer's key cache
        providers.Callable(_has_sparse_layers, model_spec),
        no=providers.Object(None),
        yes=_step(build_log, "index_key_pool", providers.Factory(
            IndexKeyPool, model_spec.provided.sparse_layers,
            providers.Callable(_index_key_slots, config.kv.num_pages, config.kv.page_size, config.hisparse.enabled,
                               config.hisparse.host_to_device_ratio),
            model_spec.provided.index_head_dim, model_spec.provided.dtype, device)),
    )

    dsv4_token_slots = _step(build_log, "dsv4_token_slots", providers.Factory(DSV4TokenSlots, token_slots, dsv4_pools))

    # 3. HiSparse coordinator, before any backend: host pool, per-request device buffers, swap-in. The sparse
    #    backend (dsa; dsv4) receives it in its constructor; the engine reserves token slots through it. What it
    #    offloads is injected: V3.2's latent rows (wrapping the plain allocator) or V4's CSA entries (wrapping
    #    the V4 allocator, whose HCA pool and window ring stay on the device).
    hisparse_on = providers.Callable(_on_off, config.hisparse.enabled)
    hisparse_rows = providers.Selector(
        model_kind, mla=providers.Factory(OffloadedRows.latent, kv_pool),
        hybrid=providers.Factory(OffloadedRows.latent, kv_pool),
        dsv4=providers.Factory(OffloadedRows.csa_entries, dsv4_pools, config.kv.page_size))
    hisparse_allocator = providers.Selector(model_kind, mla=token_slots, hybrid=token_slots, dsv4=dsv4_token_slots)
    hisparse_layers = providers.Selector(
        model_kind, mla=model_spec.provided.sparse_layers, hybrid=model_spec.provided.sparse_layers,
        dsv4=providers.Callable(_csa_layers, dsv4_cfg))
    hisparse_coordinator = providers.Selector(
        hisparse_on,
        off=providers.Object(None),
        on=_step(build_log, "hisparse_coordinator", providers.Factory(
            HiSparseCoordinator, req_to_token_pool, hisparse_allocator, config.hisparse.top_k,
            config.hisparse.device_buffer_size, config.hisparse.host_to_device_ratio, device, tp_group,
            rows=hisparse_rows, layer_ids=hisparse_layers)),
    )
    engine_token_slots = providers.Selector(
        providers.Callable(_slots_kind, model_kind, config.hisparse.enabled),
        off=token_slots, on=hisparse_coordinator, dsv4=dsv4_token_slots)

    # 4. workspaces: the ledger, then one provider per named workspace (built only if consumed), each acquiring a
    #    spec of the selected backend class's workspace_specs (the memory plan adds up the same specs) -------
    workspace_ledger = _step(build_log, "workspace_ledger", providers.Factory(WorkspaceLedger, device, known=WORKSPACES))
    # the collectives the model calls (parallel.allreduce): NCCL / gloo, or the one-shot kernels over the symmetric
    # IPC buffers (workspace 'allreduce_ipc', exchanged here: before the model and before any graph is captured)
    collectives = _step(build_log, "collectives", providers.Singleton(
        make_collectives, tp_group, workspace_ledger, config.parallel, launch.provided.local_world_size))
    workspace_specs = providers.Callable(
        lambda name, inputs: BACKENDS[name].workspace_specs(inputs), config.backend.name, providers.Factory(
            WorkspaceInputs, model_spec, config, device_info, providers.Selector(
                model_kind, mla=providers.Object(None), hybrid=providers.Object(None),
                dsv4=dsv4_rank_cfg.provided.attention)))  # V4: this rank's heads
    triton_split_kv_workspace = _step(build_log, "workspace:triton_split_kv", providers.Factory(
        _acquire, workspace_ledger, workspace_specs, "triton_split_kv", "triton_mla"))
    flashinfer_float_workspace = _step(build_log, "workspace:flashinfer_float", providers.Factory(
        _acquire, workspace_ledger, workspace_specs, "flashinfer_float", "flashinfer_mla"))
    dsa_decode_workspace = _step(build_log, "workspace:dsa_sparse_decode", providers.Factory(
        _acquire, workspace_ledger, workspace_specs, "dsa_sparse_decode", "dsa"))
    dsa_indexer_workspace = _step(build_log, "workspace:dsa_indexer", providers.Factory(
        _acquire, workspace_ledger, workspace_specs, "dsa_indexer", "dsa"))
    dsv4_decode_workspace = _step(build_log, "workspace:dsv4_decode_splits", providers.Factory(
        _acquire, workspace_ledger, workspace_specs, "dsv4_decode_splits", "dsv4"))

    # 5. backends: the selected full-attention backend (only that one is built); for a model with
    #    linear-attention layers also the state pool, the linear backend and the wrapper that routes layers.
    # the Blackwell backends' kernel call: one injected callable, the real one (imported only here) or the torch
    # emulation of its contract (backend.kernel=emulate); tests override these providers with fakes
    trtllm_kernel = providers.Selector(
        config.backend.kernel,
        real=providers.Singleton(load_trtllm_kernel),
        emulate=providers.Singleton(EmulatedTrtllmMLADecode, device_info.provided.sm_count))
    # dsv4 impl=flashinfer: FlashInfer's V4 sparse decode (real, imported only here) or its emulation
    dsv4_flashinfer = providers.Selector(
        providers.Callable(_dsv4_kernel_kind, config.backend.impl, config.backend.kernel),
        none=providers.Object(None),
        real=providers.Singleton(FlashInferDecode, providers.Singleton(load_dsv4_kernel), workspace_ledger,
                                 config.backend),
        emulate=providers.Singleton(FlashInferDecode, providers.Singleton(EmulatedDSV4SparseDecode), workspace_ledger,
                                    config.backend))
    tokenspeed_sm_count = providers.Callable(sized_sm_count, device_info, config.backend.emulated_sm_count)
    tokenspeed_kernel = providers.Selector(
        config.backend.kernel,
        real=providers.Singleton(load_tokenspeed_kernel),
        emulate=providers.Singleton(EmulatedTokenSpeedMLADecode, tokenspeed_sm_count))
    max_batch = providers.Callable(max_decode_tokens, config.kv, config.graph)
    max_query = providers.Callable(max_q_len, config.speculative)

    backend = providers.Selector(
        config.backend.name,
        torch_mla=_step(build_log, "backend:torch_mla", providers.Factory(
            TorchMLABackend, req_to_token_pool, kv_pool, model_spec, config.backend.compute_dtype)),
        triton_mla=_step(build_log, "backend:triton_mla", providers.Factory(
            TritonMLABackend, req_to_token_pool, kv_pool, model_spec, triton_split_kv_workspace,
            config.backend, config.model.pdl)),
        flashinfer_mla=_step(build_log, "backend:flashinfer_mla", providers.Factory(
            FlashInferMLABackend, req_to_token_pool, kv_pool, model_spec, flashinfer_float_workspace,
            workspace_ledger, config.backend)),
        dsa=_step(build_log, "backend:dsa", providers.Factory(
            DSABackend, req_to_token_pool, kv_pool, index_key_pool, hisparse_coordinator, model_spec,
            dsa_decode_workspace, dsa_indexer_workspace, config.backend, device)),
        dsv4=_step(build_log, "backend:dsv4", providers.Factory(
            DSV4Backend, dsv4_pools, config.backend.compute_dtype, config.backend.impl, device, hisparse_coordinator,
            dsv4_flashinfer, dsv4_decode_workspace)),
        trtllm_mla=_step(build_log, "backend:trtllm_mla", providers.Factory(
            TrtllmMLABackend, req_to_token_pool, kv_pool, model_spec, workspace_ledger, trtllm_kernel,
            config.backend, max_batch, device_info.provided.sm_count)),
        tokenspeed_mla=_step(build_log, "backend:tokenspeed_mla", providers.Factory(
            TokenSpeedMLABackend, req_to_token_pool, kv_pool, model_spec, workspace_ledger, tokenspeed_kernel,
            config.backend, tokenspeed_sm_count, max_query)),
    )
    backend_mha_prefill = providers.Callable(mha_prefill_hook, backend, config.attention.prefill, config.backend)
    backend_decode_graph = providers.Callable(decode_graph_hook, backend)
    sparse_decode = providers.Callable(sparse_hook, backend)
    linear_state_pool = _step(build_log, "linear_state_pool", providers.Factory(
        LinearStatePool, model_spec.provided.linear_layers, config.kv.max_requests,
        model_spec.provided.linear_num_heads, model_spec.provided.linear_head_dim,
        model_spec.provided.linear_head_dim, device))
    linear_backend = _step(build_log, "backend:linear", providers.Factory(
        LinearAttentionBackend, linear_state_pool, model_spec.provided.linear_num_heads,
        model_spec.provided.linear_head_dim, model_spec.provided.linear_head_dim, config.attention.linear_impl))
    hybrid = _step(build_log, "backend:hybrid_linear", providers.Factory(
        HybridLinearBackend, backend, linear_backend, model_spec.provided.full_layers, backend_mha_prefill,
        backend_decode_graph, config.backend.name))

    attention = providers.Selector(model_kind, mla=backend, hybrid=hybrid, dsv4=backend)
    mha_prefill = providers.Selector(model_kind, mla=backend_mha_prefill, hybrid=providers.Callable(_wrapper_mha, hybrid),
                                     dsv4=providers.Object(None))
    decode_graph = providers.Selector(model_kind, mla=backend_decode_graph,
                                      hybrid=providers.Callable(_wrapper_graph, hybrid), dsv4=backend_decode_graph)
    target_backends = providers.Selector(model_kind, mla=providers.List(backend),
                                         hybrid=providers.List(backend, linear_backend), dsv4=providers.List(backend))
    # per-request state the engine resets on admission (V4's compressor state is reset by its token allocator)
    request_states = providers.Selector(model_kind, mla=providers.List(), hybrid=providers.List(linear_state_pool),
                                        dsv4=providers.List())

    # 6. weights (seeded random, or a Hugging Face folder read shard by shard) and model ---------------
    model_weights = providers.Selector(
        providers.Callable(_weight_source, model_spec),
        random=_step(build_log, "weights:random", providers.Factory(random_weights, full_model_spec, device,
                                                                    sharding)),
        checkpoint=_step(build_log, "weights:checkpoint", providers.Factory(load_checkpoint, full_model_spec, device,
                                                                            sharding)),
        dsv4_random=_step(build_log, "weights:random", providers.Factory(
            random_dsv4_weights, dsv4_cfg, model_spec.provided.weight_seed, model_spec.provided.dtype, device,
            sharding, weights=model_spec.provided.weights, fmt=dsv4_stored)),
        dsv4_checkpoint=_step(build_log, "weights:checkpoint", providers.Factory(
            load_dsv4_checkpoint, dsv4_cfg, model_spec.provided.path, dsv4_stored, model_spec.provided.dtype,
            device, sharding, weights=model_spec.provided.weights)),
    )
    dumper = providers.Singleton(AttentionDumper, config.dump_dir, req_to_token_pool)
    decoder_ops = providers.Selector(  # model.fused (auto|on|off) against the ops classes' capabilities
        providers.Callable(select_ops, config.model.fused, device_info, model_spec.provided.dtype),
        torch=providers.Singleton(TorchOps),
        fused=providers.Singleton(FusedOps, config.model.gemv_rows, config.model.pdl, config.model.fp8_compute,
                                  providers.Factory(WorkspaceLedger.acquire, workspace_ledger, GEMM_COUNTERS, "ops")),
    )
    mla_model = _step(build_log, "model", providers.Factory(
        MLAModel, model_spec, device, kv_pool, attention, mha_prefill, dumper, sparse_decode, model_weights,
        decoder_ops, collectives))
    dsv4_model = _step(build_log, "model", providers.Factory(
        DSV4Model, model_spec, dsv4_rank_cfg, model_weights, dsv4_pools, backend, collectives, decoder_ops))
    model = providers.Selector(model_kind, mla=mla_model, hybrid=mla_model, dsv4=dsv4_model)

    # 7. speculative decoding (built only when speculative.enabled): the draft model is the target's first
    #    draft_layers layers with its own KV pool (sharing the request table, so both use the same slots);
    #    one instance of the configured backend per draft step, over the draft pool (dsa: sparse drafts too).
    spec_mode = providers.Callable(_on_off, config.speculative.enabled)
    draft_spec = providers.Callable(lambda spec, n: spec.draft(n), model_spec, config.speculative.draft_layers)
    draft_kv_pool = _step(build_log, "draft_kv_pool", providers.Factory(
        MLAKVPool,
        layer_ids=draft_spec.provided.kv_cache_layers,
        num_pages=config.kv.num_pages,
        page_size=config.kv.page_size,
        kv_lora_rank=model_spec.provided.kv_lora_rank,
        qk_rope_head_dim=model_spec.provided.qk_rope_head_dim,
        dtype=model_spec.provided.dtype,
        device=device,
        kv_dtype=config.kv.dtype,
        scale=config.kv.scale,
    ))
    # a sparse target's draft (dsa): its own indexer keys for its sparse layers (HiSparse and speculation exclude
    # each other, so by device slot), read by one dsa backend per draft step (the target's scratch workspaces: the
    # forwards run one after another on one stream)
    draft_index_key_pool = providers.Selector(
        providers.Callable(_has_sparse_layers, draft_spec), no=providers.Object(None),
        yes=_step(build_log, "draft_index_key_pool", providers.Factory(
            IndexKeyPool, draft_spec.provided.sparse_layers,
            providers.Callable(_index_key_slots, config.kv.num_pages, config.kv.page_size, False, 1.0),
            model_spec.provided.index_head_dim, model_spec.provided.dtype, device)))
    draft_split_kv_workspace = providers.Factory(
        _acquire, workspace_ledger, workspace_specs, "triton_split_kv", "triton_mla:draft")
    draft_backends = _step(build_log, "backend:draft_steps", providers.Selector(
        config.backend.name,
        torch_mla=providers.Callable(_instances, providers.Factory(
            TorchMLABackend, req_to_token_pool, draft_kv_pool, model_spec, config.backend.compute_dtype).provider,
            config.speculative.num_steps),
        triton_mla=providers.Callable(_instances, providers.Factory(
            TritonMLABackend, req_to_token_pool, draft_kv_pool, model_spec, draft_split_kv_workspace,
            config.backend, config.model.pdl).provider, config.speculative.num_steps),
        dsa=providers.Callable(_instances, providers.Factory(
            DSABackend, req_to_token_pool, draft_kv_pool, draft_index_key_pool, None, draft_spec, dsa_decode_workspace,
            dsa_indexer_workspace, config.backend, device).provider, config.speculative.num_steps),
        flashinfer_mla=providers.Callable(_instances, providers.Factory(
            FlashInferMLABackend, req_to_token_pool, draft_kv_pool, model_spec, flashinfer_float_workspace,
            workspace_ledger, config.backend).provider, config.speculative.num_steps, instance=DRAFT_INSTANCE),
        trtllm_mla=providers.Callable(_instances, providers.Factory(
            TrtllmMLABackend, req_to_token_pool, draft_kv_pool, model_spec, workspace_ledger, trtllm_kernel,
            config.backend, max_batch, device_info.provided.sm_count).provider, config.speculative.num_steps,
            instance=DRAFT_INSTANCE),
        tokenspeed_mla=providers.Callable(_instances, providers.Factory(
            TokenSpeedMLABackend, req_to_token_pool, draft_kv_pool, model_spec, workspace_ledger, tokenspeed_kernel,
            config.backend, tokenspeed_sm_count, max_query).provider, config.speculative.num_steps,
            instance=DRAFT_INSTANCE),
    ))
    draft_kv_indices = providers.Singleton(
        shared_kv_indices_pass, draft_backends, config.speculative.shared_kv_indices, req_to_token_pool,
        config.kv.page_size)
    draft_attention = providers.Singleton(MultiStepDraftBackend, draft_backends, draft_kv_indices, req_to_token_pool)
    draft_weights = providers.Callable(_draft_weights, model, config.speculative.draft_layers)
    draft_model = _step(build_log, "draft_model", providers.Factory(
        MLAModel, draft_spec, device, draft_kv_pool, draft_attention, None, None,
        providers.Callable(draft_sparse_hook, draft_attention, draft_backends), draft_weights,
        decoder_ops, collectives, shares_weights=True))
    draft_steps = providers.Singleton(DraftSteps, draft_model, draft_attention)

    # every attention backend the engine runs: the graph decision takes the minimum level over them
    backends_in_use = providers.Selector(
        spec_mode, off=target_backends,
        on=providers.Callable(lambda target, draft: [*target, *draft], target_backends, draft_backends))

    # 8. graphs and engine ------------------------------------------------------------------------------
    device_type = providers.Callable(lambda d: d.type, device)
    graph_decisions = providers.Callable(
        decide_graphs, config.graph.enabled, device_type, backends_in_use, config.speculative.enabled,
        config.graph.batch_sizes, config.graph.prefill_tokens)
    padding_row = req_to_token_pool.provided.padding_row
    overlap = providers.Callable(overlap_enabled, config.engine.overlap, device)
    graph_copies = providers.Callable(copies_per_size, overlap)
    graph_modes = providers.Selector(
        spec_mode,
        off=providers.Callable(plain_mode_graphs, graph_decisions, model, decode_graph, padding_row, device,
                               graph_copies, tp_group.provided.stats, config.graph.prefill_requests),
        on=providers.Callable(speculative_mode_graphs, graph_decisions, model, attention, draft_model, draft_attention,
                              draft_steps, config.speculative.num_steps, padding_row, device, graph_copies,
                              tp_group.provided.stats),
    )
    graph_runner = _step(build_log, "graph_runner", providers.Factory(GraphRunner, graph_modes, device, dumper))
    # the requests (synthetic, or a prompt file's), their stop ids and the tokenizer that decodes outputs
    workload = _step(build_log, "workload", providers.Factory(load_workload, config.workload, config.model))
    speculative = providers.Selector(
        spec_mode, off=providers.Object(None),
        on=_step(build_log, "speculative", providers.Factory(
            SpeculativeDriver, model, draft_model, attention, draft_attention, draft_steps, graph_runner, token_slots,
            config.speculative.num_steps, config.kv.max_requests, device)))
    engine = _step(build_log, "engine", providers.Factory(
        Engine, model, attention, mha_prefill, graph_runner, engine_token_slots, request_states, config.workload,
        workload, device, speculative, overlap, dumper, tp_group,
        oom=providers.Factory(OOMGuard, memory_budget, tp_group, memory_reader, device),
        sampler=providers.Factory(Sampler, device)))  # per-request sampling (runtime/engine/sampling.py)


# The stages `build` walks, in order. Workspaces are absent on purpose: a workspace is built only when the
# selected backend consumes it.
BUILD_STAGES = (
    "tp_group", "device_info", "req_to_token_pool", "page_allocator", "token_slots", "kv_pool", "index_key_pool",
    "dsv4_pools", "hisparse_coordinator", "engine_token_slots", "workspace_ledger", "collectives", "attention",
    "model_weights", "model", "graph_runner", "workload", "speculative", "engine",
)


@dataclass
class Runtime:
    """A wired runtime: the container (for the report and tests), its engine, and what was built."""

    container: Container
    config: dict
    device: DeviceInfo

    @property
    def engine(self) -> Engine:
        return self.container.engine()

    @property
    def build_order(self) -> list[str]:
        return list(self.container.build_log().names)


def to_plain(cfg: DictConfig | dict) -> dict:
    """The resolved plain dict the container reads (enums as their names, the model's optional fields filled)."""
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True, enum_to_str=True)
    plain = dict(cfg)
    plain.setdefault("dump_dir", None)
    if isinstance(plain.get("model"), dict):  # optional model fields filled (preset defaults or config.json);
        plain["model"] = resolve_model_config(plain["model"])[0]  # build() resolves again for the problems
    return plain


def build(cfg: DictConfig | dict, container: Container | None = None) -> Runtime:
    """Validate ``cfg`` (all problems at once, nothing allocated), then build the runtime.

    Parameters
    ----------
    cfg : the composed root config (DictConfig) or its resolved plain dict.
    container : a Container whose providers a test has overridden; a fresh one otherwise.
    """
    plain = to_plain(cfg)
    container = container or Container()
    launch = container.launch()
    info = probe_device(*device_for(plain["device"]["kind"], plain["device"]["index"], launch, plain["parallel"]["tp"]))
    plain["model"], problems = resolve_model_config(plain["model"])
    if not problems:  # a model config that resolved: everything else, and the checkpoint's headers
        problems = validate(rank_view(plain), BACKENDS, info, linear_backend=LinearAttentionBackend)
        problems += parallel_problems(plain, launch, info)
        problems += weights_problems(plain, info)  # the full model's view: tensor-parallel cuts of fp8 blocks
        if not problems and plain["model"]["path"]:
            spec = ModelSpec.from_config(plain["model"])
            shard = Sharding(0, plain["parallel"]["tp"], plain["parallel"]["moe"])
            problems = (scan_dsv4_checkpoint(dsv4_config(plain["model"]), spec.path, StoredFormat.of(plain["model"]),
                                             shard, keep=spec.weights == "stored")[-1] if spec.is_dsv4
                        else scan_checkpoint(spec, shard)[2])
    if problems:
        raise ConfigError(problems)
    container.config.from_dict(plain)
    plan = container.memory_budget()  # the tp group, the device and the plan: nothing large is allocated yet
    problems = agree_problems(memory_problems(plan, plain), container.tp_group())
    if problems:
        raise ConfigError(problems)
    plain["kv"] = {**plain["kv"], "num_pages": plan.num_pages}  # auto resolved: every pool reads this count
    container.config.kv.num_pages.from_value(plan.num_pages)
    for stage in BUILD_STAGES:  # top to bottom; each stage builds what it depends on first
        getattr(container, stage)()
    return Runtime(container=container, config=plain, device=info)
