"""Typed schemas of every config group, registered in Hydra's ConfigStore.

Each YAML option under ``conf/<group>/`` starts from one of these schemas (its defaults list names
``/schema/<group>/<name>``), so a typo or a wrong type fails when Hydra composes the config, before the
runtime sees it. Cross-field rules (a buffer smaller than top-k, a GPU-only backend on the CPU) live in
:mod:`runtime.app.validation`, which reports every problem at once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from runtime.core.switch import Switch

MiB = 1 << 20


class DeviceKind(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DType(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float64 = "float64"


class LayerKind(str, enum.Enum):
    full = "full"  # dense MLA attention
    linear = "linear"  # linear attention (hybrid models)
    sparse = "sparse"  # DeepSeek sparse attention (top-k selected KV)


class MLPKind(str, enum.Enum):
    none = "none"  # attention-only layers (x + attn(x)): the synthetic benchmark models
    deepseek = "deepseek"  # DeepSeek decoder layers: dense SwiGLU for the first layers, MoE after


class ScoringFunc(str, enum.Enum):
    softmax = "softmax"  # DeepSeek-V2 router
    sigmoid = "sigmoid"  # DeepSeek-V3 router (with e_score_correction_bias for the choice)


class TopkMethod(str, enum.Enum):
    greedy = "greedy"  # V2: top-k of the softmax scores
    group_limited_greedy = "group_limited_greedy"  # V2: top-k within the topk_group groups of highest max score
    noaux_tc = "noaux_tc"  # V3: top-k within the topk_group groups of highest top-2 sum (bias-corrected scores)


class FusedMode(Switch):
    """Which decoder-layer ops a model runs (:mod:`runtime.model.deepseek.ops`); true / false: on / off."""

    auto = "auto"  # the fused Triton kernels where the device supports them (FusedOps.capabilities), else torch
    on = "on"  # the fused kernels; a device without support is refused at validation
    off = "off"  # the unfused torch ops (the reference path; the CPU always takes it under auto)


class WeightFormat(str, enum.Enum):
    """``model.weights``: how the linear layers' weights are held and computed (:mod:`runtime.model.quantized`)."""

    auto = "auto"  # a checkpoint: as stored; a preset: bf16
    stored = "stored"  # a checkpoint's fp8 matrices kept as fp8 with their block scales (V4: fp4 experts packed)
    dequantize = "dequantize"  # a checkpoint's fp8 / fp4 weights expanded to model.dtype at load (the reference)
    bf16 = "bf16"  # a preset's random weights in model.dtype (bf16 on the GPU presets)
    fp8 = "fp8"  # a preset's random weights as the release stores them (block-fp8; V4: also fp4 experts)


class Fp8Compute(str, enum.Enum):
    """``model.fp8_compute``: how stored block-fp8 weights multiply 16-bit activations above the few-row decode
    path (up to 16 rows the activations always stay 16-bit; docs/checkpoints.md)."""

    w8a8 = "w8a8"  # activations quantized to e4m3 per token and 128 inputs, as DeepSeek's inference code (fastest)
    w8a16 = "w8a16"  # activations stay 16-bit at every size: the dequantized model's precision, slower prefill


class RopeType(str, enum.Enum):
    default = "default"
    yarn = "yarn"


class PrefillPath(str, enum.Enum):
    auto = "auto"  # MHA chunked-prefix when the full-attention backend provides the hook, else absorbed
    mha_chunked = "mha_chunked"  # require the MHAChunkPrefill hook (refused at startup if missing)
    absorbed = "absorbed"  # always the absorbed path


class LinearImpl(str, enum.Enum):
    torch = "torch"  # chunked prefill / recurrent decode in torch (CPU and GPU; the oracle)
    fla = "fla"  # fla-core Triton kernels (chunk_simple_gla / fused_recurrent_simple_gla), CUDA only


class CheckMode(Switch):  # false: off
    off = "off"
    reference = "reference"  # the float32 torch reference, reading the same (possibly fp8) KV cache
    unquantized = "unquantized"  # also the same run with kv.dtype=auto: what the fp8 cache costs


class KVDType(str, enum.Enum):
    auto = "auto"  # the model dtype
    fp8_e4m3 = "fp8_e4m3"  # float8 e4m3 (max 448) with the per-tensor scale kv.scale


class WorkloadKind(str, enum.Enum):
    synthetic = "synthetic"  # seeded random prompts from the length distributions
    prompts = "prompts"  # one request per line of the JSON-lines file `workload.path`


class OverlapMode(Switch):  # true / false: on / off
    auto = "auto"  # on for CUDA, off on the CPU
    on = "on"  # plan and launch step N+1 before step N's results are read back (one step ahead)
    off = "off"  # read every step's results back before scheduling the next (the host waits for the GPU)


class LengthDist(str, enum.Enum):
    fixed = "fixed"  # always `mean`
    uniform = "uniform"  # uniform integers in [min, max]
    normal = "normal"  # N(mean, std) clamped to [min, max]


# ---------------------------------------------------------------------------------------------- backend
@dataclass
class BackendConfig:
    """Fields every backend has. Backend-specific switches live in the subclasses and reach the backend's
    constructor; they are never per-call arguments."""

    name: str = MISSING


@dataclass
class TorchMLAConfig(BackendConfig):
    name: str = "torch_mla"
    compute_dtype: DType = DType.float32  # float64 on request, for the strictest oracle


@dataclass
class TritonMLAConfig(BackendConfig):
    name: str = "triton_mla"
    max_splits: int = 2048  # split-KV slots one request may take at most (the kernel balances tokens over slots)
    split_slots: int = 2048  # partials in the scratch workspace: a batch of B gets min(max_splits, slots // B)
    min_tokens_per_split: int = 64  # stage-1 chunk floor (tokens): small batches spread over more programs
    block_n: int | None = None  # KV tokens per tile (null: the kernel's default for the head count)
    block_h: int | None = None  # heads per program, each KV tile read once per head block (null: default)
    # 64-head blocks over an fp8 cache on Hopper: fp8 score products (faster) or fp16 ones (for scores in the
    # thousands); null: the kernels' default (fp8)
    fp8_scores: bool | None = None


@dataclass
class FlashInferMLAConfig(BackendConfig):
    name: str = "flashinfer_mla"
    kernel: str = "auto"  # auto | fa3 | fa2
    disable_ragged: bool = False  # MHA prefill: skip the ragged kernel and use the absorbed path


class KernelImpl(str, enum.Enum):
    real = "real"  # the vendor kernel (Blackwell only)
    emulate = "emulate"  # a torch emulation of the kernel's calling contract: any device, for tests, not speed


@dataclass
class TrtllmMLAConfig(BackendConfig):
    """TensorRT-LLM-gen MLA decode through FlashInfer (SM100 / SM103)."""

    name: str = "trtllm_mla"
    kernel: KernelImpl = KernelImpl.real
    workspace_bytes: int = 128 * MiB  # the kernel's own zero-initialised workspace (multi-CTA partials)


@dataclass
class TokenSpeedMLAConfig(BackendConfig):
    """TokenSpeed's CuTe DSL MLA decode (SM100 / SM103 / SM107)."""

    name: str = "tokenspeed_mla"
    kernel: KernelImpl = KernelImpl.real
    emulated_sm_count: int = 148  # SMs the emulation sizes the workspace for on a device without them (B200)


@dataclass
class DSV4BackendConfig(BackendConfig):
    """DeepSeek-V4 attention (sliding window + compressed entries + sinks) in plain torch: the float64-checked
    oracle (backends/dsv4.py)."""

    name: str = "dsv4"
    compute_dtype: DType = DType.float32  # float64 on request: the strictest oracle
    impl: str = "auto"  # decode: auto (triton on CUDA, torch on the CPU) | torch | triton | flashinfer (extend: torch)
    kernel: KernelImpl = KernelImpl.real  # impl=flashinfer: the real FlashInfer call, or its torch emulation
    workspace_bytes: int = 128 * MiB  # impl=flashinfer: the kernel's own zero-initialised workspace


@dataclass
class DSAConfig(BackendConfig):
    """DeepSeek sparse attention: indexer top-k + sparse prefill and decode (optionally over HiSparse)."""

    name: str = "dsa"
    impl: str = "auto"  # auto (triton on CUDA, torch on the CPU) | torch | triton
    max_splits: int = 16  # split-K pieces of the sparse decode the scratch workspace holds per token
    indexer_prefill_mib: int = 256  # the Triton indexer's scratch at least this big: prefill scores tiles of tokens


# ----------------------------------------------------------------------------------------------- model
class DSV4AttentionKind(str, enum.Enum):
    sliding_attention = "sliding_attention"  # the sliding window only
    compressed_sparse_attention = "compressed_sparse_attention"  # CSA: window + indexer top-k of compressed entries
    heavily_compressed_attention = "heavily_compressed_attention"  # HCA: window + every compressed entry


class DSV4MlpKind(str, enum.Enum):
    hash_moe = "hash_moe"  # experts from a frozen token-id -> expert-ids table
    moe = "moe"  # top-k of the bias-corrected router scores


class DSV4ExpertDtype(str, enum.Enum):
    """How a quantized V4 checkpoint stores its routed experts (config.json's ``expert_dtype``)."""

    fp8 = "fp8"  # e4m3, block scales like the other fp8 weights
    fp4 = "fp4"  # e2m1 packed two per byte, a ue8m0 scale per row and 32 inputs (the V4 release)


class DSV4Scoring(str, enum.Enum):
    sqrtsoftplus = "sqrtsoftplus"
    softmax = "softmax"
    sigmoid = "sigmoid"


@dataclass
class DSV4ModelConfig:
    """The DeepSeek-V4 fields of the `model` config (``model.v4``; null for MLA models). Names follow
    transformers' ``DeepseekV4Config``; with ``model.path`` they all come from config.json. The shared fields
    (layers, hidden, heads, q_lora_rank, vocab, experts, routed_scaling_factor, rms_norm_eps, main ``rope_theta``)
    are the `model` config's own."""

    head_dim: int | None = None  # D: query heads and the one shared KV head (512)
    rope_head_dim: int | None = None  # RoPE channels at the end of each head (64)
    sliding_window: int | None = None  # W (128)
    layer_types: list[DSV4AttentionKind] | None = None  # per layer (null: transformers' default schedule)
    csa_rate: int | None = None  # tokens per CSA entry (4)
    hca_rate: int | None = None  # tokens per HCA entry (128)
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None  # CSA entries each query keeps (512)
    o_groups: int | None = None
    o_lora_rank: int | None = None
    hc_mult: int | None = None  # mHC streams
    hc_sinkhorn_iters: int | None = None
    hc_eps: float | None = None
    scoring_func: DSV4Scoring | None = None
    swiglu_limit: float | None = None
    mlp_layer_types: list[DSV4MlpKind] | None = None  # per layer (null: 3 hash_moe, then moe)
    compress_rope_theta: float | None = None
    compress_rope_type: RopeType | None = None  # YaRN on the compressed layers' rope
    compress_rope_factor: float | None = None
    compress_rope_original_max_position: int | None = None
    compress_rope_beta_fast: float | None = None
    compress_rope_beta_slow: float | None = None
    # --- how the checkpoint stores its weights (config.json's quantization_config; null: float weights); they
    # are dequantized to model.dtype at load
    fp8_block: list[int] | None = None  # fp8 e4m3 weights' scale block [rows, cols] (the release: [128, 128])
    expert_dtype: DSV4ExpertDtype | None = None  # routed experts' storage (null: float weights)


@dataclass
class ModelConfig:
    """DeepSeek MLA model dimensions. ``layer_pattern`` is repeated over ``num_layers``: ``[full]`` for DeepSeek-V3,
    ``[linear, linear, linear, full]`` for a hybrid whose every fourth layer is full attention.

    ``path`` (``model=hf model.path=DIR``): a Hugging Face folder. Every dimension below that is null comes from
    its config.json (:mod:`runtime.model.deepseek.hf_config`); ``num_layers`` may cut the model to its first
    layers, ``max_context`` and ``dtype`` (the compute dtype) are the runtime's. Without a path the weights are
    seeded random (``weight_seed``)."""

    name: str = MISSING
    path: str | None = None  # a Hugging Face model folder (config.json, safetensors, tokenizer.json, generation_config.json)
    model_type: str | None = None  # deepseek_v2 | deepseek_v3 | deepseek_v32 | deepseek_v4 (from config.json)
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    vocab_size: int | None = None
    max_context: int | None = None  # null with a path: the checkpoint's max_position_embeddings
    dtype: DType = DType.bfloat16
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    layer_pattern: list[LayerKind] | None = None
    linear_num_heads: int | None = None  # linear-attention heads (default: num_heads)
    linear_head_dim: int = 128  # key and value head dim of linear-attention layers
    index_n_heads: int | None = None  # DeepSeek sparse-attention indexer heads (0: the model has no indexer)
    index_head_dim: int | None = None  # indexer query/key head dim (RoPE on its first qk_rope_head_dim dims)
    index_topk: int | None = None  # tokens each query of a sparse layer attends to
    # --- RoPE: interleaved pairs on the MLA rope dims (DeepSeek checkpoints) or half-split; YaRN scaling
    rope_interleave: bool | None = None
    rope_type: RopeType | None = None
    rope_factor: float | None = None
    rope_original_max_position: int | None = None
    rope_beta_fast: float | None = None
    rope_beta_slow: float | None = None
    rope_mscale: float | None = None
    rope_mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None  # cos/sin multiplier (null: derived from factor and mscales)
    rope_truncate: bool | None = None
    # --- MLP / MoE (mlp=none: attention-only layers)
    mlp: MLPKind | None = None
    intermediate_size: int | None = None  # dense SwiGLU layers
    moe_intermediate_size: int | None = None  # per routed expert (shared experts: x n_shared_experts)
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float | None = None
    norm_topk_prob: bool | None = None
    scoring_func: ScoringFunc | None = None
    topk_method: TopkMethod | None = None
    first_k_dense_replace: int | None = None
    moe_layer_freq: int | None = None
    tie_word_embeddings: bool | None = None
    eos_token_id: list[int] | None = None
    weight_seed: int = 1234
    # stored (a checkpoint's fp8 kept as fp8) | dequantize (expanded at load) | bf16 / fp8 (a preset's random
    # weights); auto: stored for a checkpoint, bf16 for a preset
    weights: WeightFormat = WeightFormat.auto
    fp8_compute: Fp8Compute = Fp8Compute.w8a8  # stored fp8 above 16 rows: e4m3 activations (w8a8) or 16-bit
    # one shared expert as wide as a routed one (DeepSeek-V2 / V3 without expert parallelism): stacked after the
    # routed experts, so the fused ops' block-fp8 grouped GEMMs compute it as one more group at 33-128 tokens (no
    # products of its own); false: its own products (a few-row step takes it in the experts' kernels either way)
    shared_expert_fusion: bool = True
    v4: DSV4ModelConfig | None = None  # DeepSeek-V4 (model_type deepseek_v4): its own attention, mHC and MoE
    fused: FusedMode = FusedMode.auto  # decoder ops: fused Triton kernels (auto: where the device supports them)
    # with fused ops: products of at most this many rows (decode at small batch) take the few-row Triton kernels
    # (linear layers, router, routed + shared experts in two kernels); 0: cuBLAS / grouped GEMM always; <= 16
    gemv_rows: int = 16
    # on a Hopper+ GPU: launch the fused ops and triton_mla's decode kernels with programmatic dependent launch (each
    # kernel's programs start while the previous kernel ends; backends/kernels/pdl.py); off: plain launches
    pdl: bool = True


# Values of the optional model fields when neither the preset nor a checkpoint sets them.
MODEL_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 512, "max_context": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "layer_pattern": ["full"],
    "index_n_heads": 0, "index_head_dim": 128, "index_topk": 2048,
    "rope_interleave": False, "rope_type": "default", "rope_factor": 1.0, "rope_original_max_position": 4096,
    "rope_beta_fast": 32.0, "rope_beta_slow": 1.0, "rope_mscale": None, "rope_mscale_all_dim": None,
    "rope_attention_factor": None, "rope_truncate": True,
    "mlp": "none", "intermediate_size": 0, "moe_intermediate_size": 0, "n_routed_experts": 0, "n_shared_experts": 0,
    "num_experts_per_tok": 0, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
    "scoring_func": "softmax", "topk_method": "greedy", "first_k_dense_replace": 0, "moe_layer_freq": 1,
    "tie_word_embeddings": False, "eos_token_id": [],
}


# ------------------------------------------------------------------------------------- memory and pools
@dataclass
class WorkspaceConfig:
    skip: bool = False  # true: the shared FlashInfer float buffer is never created
    flashinfer_bytes: int = 128 * MiB


@dataclass
class KVCacheConfig:
    page_size: int = 16
    # "auto" (the default): on CUDA the pages the memory plan leaves (runtime/core/memory_plan.py, docs/memory.md);
    # on the CPU a fixed 1024 (memory_plan.CPU_NUM_PAGES). An int: exactly that many pages (page 0 is the padding page)
    num_pages: Any = "auto"
    max_requests: int = 64  # rows of the request -> token table
    dtype: KVDType = KVDType.auto  # storage of the latent cache: writes quantize, kernels dequantize on read
    scale: float = 1.0  # fp8: stored = clamp(value / scale, -448, 448); read = stored * scale


@dataclass
class MemoryConfig:
    """How the memory plan sizes the KV pools with ``kv.num_pages=auto`` (docs/memory.md)."""

    fraction: float = 0.9  # of the device memory left after weights, workspaces, graphs and the activation peak
    activation_bytes: int | None = None  # null: the plan's estimate; a measured peak (the report's) to pin it


@dataclass
class HiSparseConfig:
    enabled: bool = False
    top_k: int = 2048
    device_buffer_size: int = 4096  # tokens per request kept on the device
    host_to_device_ratio: float = 4.0  # host KV pool size / device KV pool size


class SharedKVIndices(str, enum.Enum):
    auto = "auto"  # the multi-step draft runs its shared kv-indices pass only for backends that need it
    always = "always"  # run it for every backend (what a leading engine did; for benchmarks of the skip)


@dataclass
class SpeculativeConfig:
    """EAGLE-style chain speculation: per round the draft proposes ``num_steps`` tokens (the first from the
    previous round's draft extend, then ``num_steps - 1`` draft decode steps), the target verifies them in
    one forward, greedy acceptance keeps the longest agreeing prefix plus the target's next token."""

    enabled: bool = False
    num_steps: int = 3  # draft tokens per round (verify runs num_steps + 1 tokens per request)
    topk: int = 1  # chain speculation: one candidate per step
    draft_layers: int = 1  # the draft model = the target's first draft_layers layers + its embedding/LM head
    shared_kv_indices: SharedKVIndices = SharedKVIndices.auto
    baseline: bool = True  # also run the workload without speculation (same backend) for the report


@dataclass
class GraphConfig:
    """``batch_sizes``: padded decode batches; ``prefill_tokens``: padded token counts of graphed prefill steps (empty:
    prefill runs eagerly), each captured with ``prefill_requests`` request slots (one kept for the padding)."""

    enabled: bool = False
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    prefill_tokens: list[int] = field(default_factory=list)
    prefill_requests: int = 8


@dataclass
class LengthConfig:
    dist: LengthDist = LengthDist.uniform
    mean: int = 32
    std: int = 8
    min: int = 1
    max: int = 64


@dataclass
class WorkloadConfig:
    """Requests and scheduler limits. ``kind=synthetic`` draws ``num_requests`` random prompts from the length
    distributions; ``kind=prompts`` reads them from ``path`` (JSON lines, see runtime/engine/prompts.py)."""

    name: str = MISSING
    kind: WorkloadKind = WorkloadKind.synthetic
    path: str | None = None  # kind=prompts: the JSON-lines file, one request per line
    max_new_tokens: int = 32  # kind=prompts: for lines without their own max_new_tokens
    tokenizer: str | None = None  # a tokenizer.json (or a folder with one); default: model.path's tokenizer.json
    eos_token_ids: list[int] | None = None  # stop ids; null: the model folder's (none for presets); []: never stop
    num_requests: int = 8
    prompt_len: LengthConfig = field(default_factory=LengthConfig)
    output_len: LengthConfig = field(default_factory=lambda: LengthConfig(mean=8, std=2, min=1, max=16))
    seed: int = 0
    max_running_requests: int = 32
    max_tokens_per_batch: int = 2048
    chunked_prefill_size: int = 512  # new tokens of one request per prefill step at most
    mha_prefix_chunk_tokens: int = 4096  # prefix tokens decompressed per MHA chunk


@dataclass
class AttentionConfig:
    """How the model uses its backends (the backends themselves are the `backend` group)."""

    prefill: PrefillPath = PrefillPath.auto
    linear_impl: LinearImpl = LinearImpl.torch  # for models with linear-attention layers


@dataclass
class EngineConfig:
    """How the engine loop drives the device (runtime/engine/engine.py)."""

    overlap: OverlapMode = OverlapMode.auto


@dataclass
class ServeConfig:
    """`python -m runtime.serve`: the OpenAI-compatible HTTP server (runtime/app/serve/, docs/serving.md)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_queued_requests: int = 256  # requests waiting for the engine; more get 503 with Retry-After
    api_key: str | None = None  # set: every request needs `Authorization: Bearer KEY` (401 otherwise)
    served_model_name: str | None = None  # the model id of /v1/models and responses; null: model.name


class MoEParallel(str, enum.Enum):
    tp = "tp"  # every routed expert's intermediate dim split over the ranks
    ep = "ep"  # expert parallelism: each rank owns n_routed_experts / tp whole experts


class AllReduceMode(str, enum.Enum):
    auto = "auto"  # fused / one-shot up to parallel.oneshot_max_bytes where the ranks can (one node, peer access)
    nccl = "nccl"  # torch.distributed (NCCL on CUDA, gloo on the CPU) for every all-reduce
    oneshot = "oneshot"  # the one-shot kernel over the symmetric (IPC) buffers, NCCL above the buffer
    fused = "fused"  # oneshot, and the decoder layer's all-reduce + residual add + RMSNorm in one kernel


@dataclass
class ParallelConfig:
    """Tensor parallelism over ``torchrun`` processes (runtime/core/parallel.py): ``tp`` ranks, one per GPU
    (``WORLD_SIZE`` must equal it), how the routed experts are split, and which all-reduce the model calls
    (docs/parallelism.md)."""

    tp: int = 1
    moe: MoEParallel = MoEParallel.tp
    allreduce: AllReduceMode = AllReduceMode.auto  # the kernels passed on two H200s (tests/test_allreduce_gpu.py)
    oneshot_max_bytes: int = 128 * 1024  # auto: the one-shot / fused kernels up to this message, NCCL above (the
    # crossing measured on two H200s: bench.tp_decode --sweep-only)
    fused_max_bytes: int = 32 * 1024  # auto: the fused all-reduce + add + RMSNorm up to this (1-2 tokens x 7168)
    ipc_buffer_bytes: int = 8 * 1024 * 1024  # the symmetric buffer per rank: the largest one-shot message


@dataclass
class DeviceConfig:
    kind: DeviceKind = DeviceKind.auto
    index: int = 0


# ------------------------------------------------------------------------------------------------ root
@dataclass
class Config:
    backend: BackendConfig = MISSING
    model: ModelConfig = MISSING
    workspace: WorkspaceConfig = MISSING
    hisparse: HiSparseConfig = MISSING
    speculative: SpeculativeConfig = MISSING
    graph: GraphConfig = MISSING
    workload: WorkloadConfig = MISSING
    device: DeviceConfig = MISSING
    parallel: ParallelConfig = MISSING
    serve: ServeConfig = MISSING
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    check: CheckMode = CheckMode.reference
    progress: bool = True  # progress bar on long runs (off anyway when stdout is not a terminal)


# Every option name registered per group, for the error messages of `validation` and the tests.
BACKEND_SCHEMAS: dict[str, type[BackendConfig]] = {
    "torch_mla": TorchMLAConfig,
    "triton_mla": TritonMLAConfig,
    "flashinfer_mla": FlashInferMLAConfig,
    "dsa": DSAConfig,
    "dsv4": DSV4BackendConfig,
    "trtllm_mla": TrtllmMLAConfig,
    "tokenspeed_mla": TokenSpeedMLAConfig,
}

_GROUP_SCHEMAS: dict[str, Any] = {
    "model": ModelConfig,
    "workspace": WorkspaceConfig,
    "hisparse": HiSparseConfig,
    "speculative": SpeculativeConfig,
    "graph": GraphConfig,
    "workload": WorkloadConfig,
    "device": DeviceConfig,
    "parallel": ParallelConfig,
    "serve": ServeConfig,
}


def register_configs() -> None:
    """Store the root schema and one schema per group option (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    for name, node in BACKEND_SCHEMAS.items():
        cs.store(group="schema/backend", name=name, node=node)
    for group, node in _GROUP_SCHEMAS.items():
        cs.store(group=f"schema/{group}", name=group, node=node)


register_configs()
