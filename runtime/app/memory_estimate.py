"""What each line of the memory plan holds, computed from the config alone (nothing is allocated).

* weights: every tensor the model reads (the checkpoint layout), this rank's cut of it, in the precision it is held
  (block-fp8 values + float32 scales, packed fp4 + ue8m0 scales, the model dtype, routers as held): the same bytes
  per dtype as ``ModelWeights.bytes_by_dtype`` reports after the build (tests compare them; a V4 checkpoint whose
  fp4 scales are stored as floats is counted at float32, the upper bound: the loader keeps them as ue8m0 bytes when
  every value is a power of two, :func:`runtime.model.quantized.fp4_scales`);
* pools: built on the ``meta`` device (shapes, no memory) at two page counts: fixed bytes and bytes per page;
* workspaces: the selected backend class's ``workspace_specs`` (what the container acquires);
* activations: an estimate of the largest step's transient tensors (a full prefill batch, the largest decode or
  verify batch), and of the CUDA graph pool (the largest captured batch of each graphed mode).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from runtime.core.config import LayerKind
from runtime.core.device import DeviceInfo
from runtime.core.dsv4_pools import DSV4Pools
from runtime.core.dsv4_spec import DSV4LayerType
from runtime.core.kv_pool import MLAKVPool, ReqToTokenPool
from runtime.core.model_spec import MLPLayer, ModelSpec
from runtime.core.parallel import Sharding
from runtime.core.state_pool import LinearStatePool
from runtime.core.workspace import WorkspaceInputs
from runtime.engine.hisparse import host_page_count
from runtime.model.deepseek.checkpoint import checkpoint_index, expected_tensors
from runtime.model.deepseek.sharding import local_shape, tensor_cut
from runtime.model.deepseek.stored import RELEASE_ROUTER, ROUTER, kept_fp8, release_fp8, router_dtype
from runtime.model.dsv4.checkpoint import expected_tensors as dsv4_expected_tensors
from runtime.model.dsv4.hf_config import dsv4_config
from runtime.model.dsv4.sharding import dsv4_tensor_cut, rank_config
from runtime.model.dsv4.stored import FP4_DTYPES, UE8M0_SCALE_DTYPES, StoredFormat, release_kind, scale_names
from runtime.model.indexer import IndexKeyPool
from runtime.model.quantized import FLOAT32_SCALES, UE8M0_SCALES

META = torch.device("meta")
FP8_BLOCK = 128  # fp8 e4m3 weights: one float32 scale per 128 x 128 block
FP4_GROUP = 32  # packed fp4 experts: one scale per row and 32 inputs, a ue8m0 byte (float32 for float scales)
F32 = 4


def _add(out: dict[str, int], key: str, n: int) -> None:
    if n:
        out[key] = out.get(key, 0) + int(n)


def _fp8(out: dict[str, int], shape: tuple[int, ...]) -> None:
    *lead, r, c = shape
    _add(out, "float8_e4m3fn", math.prod(shape))
    _add(out, FLOAT32_SCALES, math.prod(lead) * math.ceil(r / FP8_BLOCK) * math.ceil(c / FP8_BLOCK) * F32)


def _fp4(out: dict[str, int], shape: tuple[int, ...], ue8m0: bool = True) -> None:
    _add(out, "fp4 e2m1 (packed)", math.prod(shape) // 2)
    *lead, c = shape  # one scale per row and 32 inputs, a partial last group included
    _add(out, UE8M0_SCALES if ue8m0 else FLOAT32_SCALES,
         math.prod(lead) * math.ceil(c / FP4_GROUP) * (1 if ue8m0 else F32))


def _fp4_ue8m0(spec: ModelSpec) -> bool:
    """Whether the fp4 experts' scales are held as ue8m0 bytes: always for a preset (``quantize_fp4``); for a
    checkpoint when every fp4 weight's scale is stored as ``F8_E8M0`` / ``U8`` (float scales: False, the float32
    upper bound)."""
    if not spec.path:
        return True
    index, _ = checkpoint_index(Path(spec.path))
    scales = scale_names(index)
    fp4 = [scales[n] for n, info in index.items() if n in scales and info.dtype in FP4_DTYPES]
    return all(index[s].dtype in UE8M0_SCALE_DTYPES for s in fp4)


def _quantized(model: dict, spec: ModelSpec, index: dict) -> bool:
    """Whether the fp8 release's tensors are held quantized: a preset with model.weights=fp8, or a checkpoint kept
    as stored (auto / stored) whose config declares fp8 (V4: ``v4.fp8_block``; V2/V3: assumed from the weights of
    its ``index``)."""
    if spec.path:
        return spec.weights in ("auto", "stored") and _checkpoint_fp8(model, spec, index)
    return spec.weights == "fp8"


def _checkpoint_fp8(model: dict, spec: ModelSpec, index: dict) -> bool:
    if spec.is_dsv4:
        return bool((model.get("v4") or {}).get("fp8_block"))
    return any("F8" in info.dtype.upper() for info in index.values())


def weight_bytes(model: dict, tp: int, moe: str, rank: int = 0) -> dict[str, int]:
    """dtype -> bytes this rank's weights will hold (``model``: the resolved full-model config)."""
    spec = ModelSpec.from_config(model)
    shard = Sharding(rank, tp, moe)
    # a V2 / V3 checkpoint's headers, read once: whether it is fp8, the router's stored dtype
    index = checkpoint_index(Path(spec.path))[0] if spec.path and not spec.is_dsv4 else {}
    quantized = _quantized(model, spec, index)
    item = torch.empty(0, dtype=spec.dtype).element_size()
    name_of = str(spec.dtype).removeprefix("torch.")
    out: dict[str, int] = {}
    if spec.is_dsv4:
        cfg, fmt = dsv4_config(model), StoredFormat.of(model)
        experts = fmt.expert_dtype or ("fp4" if not spec.path else None)
        ue8m0 = quantized and experts == "fp4" and _fp4_ue8m0(spec)
        for name, shape in dsv4_expected_tensors(cfg).items():
            cut = dsv4_tensor_cut(name, shape, cfg, shard)
            local = local_shape(shape, cut) if cut is not None else shape
            kind = release_kind(name, experts) if quantized else None
            if name.endswith("tid2eid"):
                _add(out, "int64", math.prod(local) * 8)
            elif kind is not None and kind.value == "fp4":
                _fp4(out, local, ue8m0)
            elif kind is not None:
                _fp8(out, local)
            else:
                _add(out, name_of, math.prod(local) * item)
        return out
    linear = {f"model.layers.{i}." for i in spec.linear_layers}  # synthetic hybrids: no checkpoint layout
    d, hl = spec.hidden_size, spec.linear_num_heads * spec.linear_head_dim
    _add(out, name_of, len(linear) * (d + 4 * d * hl + hl) * item)  # norm, q / k / v / out projections, out norm
    for name, shape in expected_tensors(spec).items():
        if name.startswith(tuple(linear)) and ".mlp" not in name and "post_attention" not in name:
            continue
        cut = tensor_cut(name, shape, spec, shard)
        if cut is None:  # another rank's expert
            continue
        local = local_shape(shape, cut)
        if name.endswith(ROUTER):  # as the loader holds it: float32, or the model's 16-bit dtype as stored
            held = router_dtype(index[name].dtype if name in index else RELEASE_ROUTER, spec.dtype)
            _add(out, str(held).removeprefix("torch."), math.prod(local) * held.itemsize)
        elif name.endswith(("e_score_correction_bias", "weights_proj.weight")):
            _add(out, "float32", math.prod(local) * F32)  # the router's bias and the indexer's head weights
        elif quantized and release_fp8(name, shape) and kept_fp8(name):
            _fp8(out, local)
        else:
            _add(out, name_of, math.prod(local) * item)
    return out


def _dsv4_rank_attention(model: dict, tp: int):
    return rank_config(dsv4_config(model), tp).attention


def pool_bytes(plain: dict, spec: ModelSpec, pages: int) -> dict[str, int]:
    """Bytes of every device pool at ``pages`` pages, built on the meta device (this rank's ``spec``)."""
    kv, tp = plain["kv"], plain["parallel"]["tp"]
    hisparse = plain["hisparse"]["enabled"]
    ps, reqs = int(kv["page_size"]), int(kv["max_requests"])
    out = {"request table": ReqToTokenPool(reqs, spec.max_context, META).nbytes}
    if spec.is_dsv4:
        v4 = DSV4Pools.for_token_pages(_dsv4_rank_attention(plain["model"], tp), reqs, spec.max_context, pages, ps,
                                       spec.dtype, META, hisparse)
        out.update({k.removesuffix("_bytes"): v for k, v in v4.breakdown().items()})
        return out

    def latent(layers: list[int]) -> int:
        return MLAKVPool(layers, pages, ps, spec.kv_lora_rank, spec.qk_rope_head_dim, spec.dtype, META,
                         kv_dtype=kv["dtype"], scale=kv["scale"]).nbytes

    out["kv pool"] = latent(spec.kv_cache_layers)
    if spec.sparse_layers:
        slots = (host_page_count(pages, plain["hisparse"]["host_to_device_ratio"]) if hisparse else pages) * ps
        out["indexer keys"] = IndexKeyPool(spec.sparse_layers, slots, spec.index_head_dim, spec.dtype, META).nbytes
    if plain["speculative"]["enabled"]:
        draft = spec.draft(plain["speculative"]["draft_layers"])
        out["draft kv pool"] = latent(draft.kv_cache_layers)
        if draft.sparse_layers:  # a sparse target's draft keeps its own indexer keys (by device slot)
            out["draft indexer keys"] = IndexKeyPool(draft.sparse_layers, pages * ps, spec.index_head_dim, spec.dtype,
                                                     META).nbytes
    if spec.linear_layers:
        out["linear-attention states"] = LinearStatePool(spec.linear_layers, reqs, spec.linear_num_heads,
                                                         spec.linear_head_dim, spec.linear_head_dim, META).nbytes
    return out


def hisparse_bytes(plain: dict, spec: ModelSpec, pages: int) -> tuple[int, int]:
    """(device buffers and tables, host pool) bytes of the HiSparse coordinator at ``pages`` device pages."""
    hs, kv = plain["hisparse"], plain["kv"]
    if not hs["enabled"]:
        return 0, 0
    item = torch.empty(0, dtype=spec.dtype).element_size()
    if spec.is_dsv4:
        att = _dsv4_rank_attention(plain["model"], plain["parallel"]["tp"])
        layers = len(att.layers_of(DSV4LayerType.csa))
        row_dim, per_row = att.head_dim, att.csa_rate
    else:
        layers, row_dim, per_row = len(spec.sparse_layers), spec.kv_row_dim, 1
    rows_per_page = -(-int(kv["page_size"]) // per_row)
    table_rows, buf = int(kv["max_requests"]) + 1, int(hs["device_buffer_size"])
    keys = max(1, spec.max_context // per_row)
    device = layers * table_rows * buf * (row_dim * item + 4 + 8) + table_rows * keys * 4
    host = layers * host_page_count(pages, hs["host_to_device_ratio"]) * rows_per_page * row_dim * item
    return device, host


def workspace_inputs(plain: dict, spec: ModelSpec, info: DeviceInfo) -> WorkspaceInputs:
    """What the backend class sizes its workspaces from (the container builds the same from its providers)."""
    v4 = _dsv4_rank_attention(plain["model"], plain["parallel"]["tp"]) if spec.is_dsv4 else None
    return WorkspaceInputs(spec, plain, info, v4)


def workspace_bytes(plain: dict, backends: dict[str, type], spec: ModelSpec, info: DeviceInfo) -> dict[str, int]:
    """name -> bytes of the named workspaces the selected backend will acquire: its class's ``workspace_specs``,
    the specs the container acquires (``backends``: name -> backend class)."""
    specs = backends[plain["backend"]["name"]].workspace_specs(workspace_inputs(plain, spec, info))
    return {name: s.nbytes for name, s in specs.items()}


def _longest(plain: dict, spec: ModelSpec) -> int:
    """Tokens of the longest request the workload can bring (synthetic: its length bounds; a prompts file:
    ``model.max_context``, the bound every line was checked against)."""
    w = plain["workload"]
    if w["kind"] == "synthetic":
        return min(spec.max_context, w["prompt_len"]["max"] + w["output_len"]["max"])
    return spec.max_context


def min_pages(plain: dict, spec: ModelSpec) -> int:
    """The fewest pages that hold one longest request (plus the padding page and a speculative look-ahead)."""
    sp = plain["speculative"]
    look = sp["num_steps"] + 2 if sp["enabled"] else 0
    return -(-(_longest(plain, spec) + look) // int(plain["kv"]["page_size"])) + 1


def step_bytes(plain: dict, spec: ModelSpec, tokens: int, rows: int, context: int) -> int:
    """Transient bytes of one forward of ``tokens`` tokens (``rows`` sampled) over contexts of ``context`` tokens:
    the widest layer's live tensors (hidden states, q, attention in the backend's compute dtype, the MLP or the
    routed experts), the attention scores of a torch-math backend, the logits. An estimate, on the high side."""
    item = torch.empty(0, dtype=spec.dtype).element_size()
    d, h = spec.hidden_size, spec.num_heads
    compute = 8 if str(plain["backend"].get("compute_dtype")) == "float64" else 4
    if spec.is_dsv4:
        v4 = plain["model"]["v4"]
        hd = int(v4["head_dim"])
        attn = h * hd * (2 * item + compute) + 4 * d * int(v4.get("hc_mult") or 1) * item
    else:
        attn = h * (spec.qk_head_dim * item + (spec.kv_lora_rank + spec.qk_rope_head_dim) * compute
                    + spec.kv_lora_rank * compute + spec.v_head_dim * item)
    inter = 0
    if MLPLayer.dense in spec.mlp_kinds:
        inter = 3 * spec.intermediate_size // max(1, spec.tp_size)
    if spec.has_moe:
        moe_i = spec.moe_intermediate_size // max(1, spec.tp_size)
        inter = max(inter, 3 * moe_i * (spec.num_experts_per_tok + spec.n_shared_experts)
                    + spec.n_routed_experts * F32 // item)
    per_token = 6 * d * item + attn + inter * item
    torch_math = plain["backend"]["name"] in ("torch_mla", "dsv4", "dsa") or LayerKind.linear in spec.layer_kinds
    chunk = min(tokens, int(plain["workload"]["chunked_prefill_size"]))
    scores = h * chunk * context * compute * 2 if torch_math else 0
    logits = rows * spec.vocab_size * F32 * 3
    return tokens * per_token + scores + logits


def activation_bytes(plain: dict, spec: ModelSpec) -> int:
    """The largest step the config allows: a full prefill batch, or the largest decode / verify batch."""
    w, sp = plain["workload"], plain["speculative"]
    running = min(int(w["max_running_requests"]), int(plain["kv"]["max_requests"]))
    q_len = sp["num_steps"] + 1 if sp["enabled"] else 1
    context = _longest(plain, spec)
    prefill = step_bytes(plain, spec, int(w["max_tokens_per_batch"]), running, context)
    decode = step_bytes(plain, spec, running * q_len, running * q_len, context)
    return max(prefill, decode)


def graph_bytes(plain: dict, spec: ModelSpec, on_cuda: bool, prefill: bool = False) -> int:
    """The CUDA graph memory pool: every size is captured into one pool, largest first, so it holds about one
    forward of the largest captured batch per graphed mode (decode; with speculation also draft decode, verify
    and draft extend). ``prefill``: the backend graphs prefill (``graph.prefill_tokens``, without speculation):
    the pool holds the largest of those steps or the decode one, and every prefill graph's output (hidden states of
    its tokens, two copies each with the overlap scheduler)."""
    g, sp = plain["graph"], plain["speculative"]
    if not (g["enabled"] and on_cuda and g["batch_sizes"]):
        return 0
    b, context = max(g["batch_sizes"]), _longest(plain, spec)
    if not sp["enabled"]:
        decode = step_bytes(plain, spec, b, b, context)
        if not (prefill and g["prefill_tokens"]):
            return decode
        item = torch.empty(0, dtype=spec.dtype).element_size()
        outputs = 2 * sum(g["prefill_tokens"]) * spec.hidden_size * item
        return max(decode, step_bytes(plain, spec, max(g["prefill_tokens"]), 0, context)) + outputs
    q = sp["num_steps"] + 1
    return step_bytes(plain, spec, b * q, b * q, context) * 2 + step_bytes(plain, spec, b, b, context)
