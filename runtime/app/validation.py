"""Startup validation: every reason a config cannot run, found in one pass before anything is allocated.

``validate`` returns a list of :class:`Problem`; ``containers.build`` raises one :class:`ConfigError` with all
of them. Decisions come from backend *capabilities* (class data), never from the backend's type.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

from backends.base import (
    BackendCapabilities,
    CudaGraphLevel,
    GraphHooks,
    MHAChunkPrefill,
    SparseDecode,
    hook_signature_problems,
)
from runtime.app.dsv4_validation import dsv4_problems
from runtime.app.hisparse_checks import hisparse_size_problems
from runtime.core.batch import ForwardMode
from runtime.core.config import LayerKind
from runtime.core.device import DeviceInfo
from runtime.core.errors import Problem
from runtime.core.model_spec import DSV4_MODEL_TYPE, TORCH_DTYPES
from runtime.engine.prompts import capped, check_workload
from runtime.engine.workload import RequestSpec
from runtime.model.deepseek.moe import GROUPED_MM
from runtime.model.deepseek.ops import GEMV_MAX_ROWS, ops_problems

FLASHINFER_WORKSPACE = "flashinfer_float"


def _package_present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def validate(
    cfg: Mapping[str, Any],
    backends: Mapping[str, type],
    device: DeviceInfo,
    package_present: Callable[[str], bool] = _package_present,
    linear_backend: type | None = None,
) -> list[Problem]:
    """Every problem of ``cfg`` (a resolved plain dict of the root config).

    Parameters
    ----------
    backends : name -> backend class, as the container can build them (each has ``capabilities``).
    linear_backend : the linear-attention backend class (for models with linear layers).
    device : the probed device ``cfg.device`` resolves to.
    package_present : module name -> importable (injectable for tests).
    """
    problems: list[Problem] = []
    add = problems.append
    model, work, kv = cfg["model"], cfg["workload"], cfg["kv"]
    name = cfg["backend"]["name"]

    # --- device
    if device.kind == "cuda" and not device.cuda_available:
        add(Problem("device", "device=cuda but torch sees no CUDA GPU", "a visible GPU",
                    "use device=cpu (or device=auto), or run on a GPU machine with a CUDA build of torch"))

    # --- backend and its capabilities; the backends suggested as fixes are those that serve this model's
    #     attention (DeepSeek-V4 or MLA: capabilities.model_families)
    v4 = model.get("model_type") == DSV4_MODEL_TYPE
    family = "dsv4" if v4 else "mla"
    serving = {n: b for n, b in backends.items() if family in b.capabilities.model_families}
    caps: BackendCapabilities | None = None
    if name not in backends:
        add(Problem("backend", f"'{name}'", f"one of {sorted(backends)}", f"pick one: backend={sorted(serving)[0]}"))
    else:
        caps = backends[name].capabilities
        problems += _backend_problems(name, backends[name], cfg, device, package_present, serving)

    # --- model: DeepSeek-V4 (its own attention) or MLA; the backend must compute the model's attention
    problems += _family_problems(model, name, caps, backends, family, device)
    problems += _prefill_problems(cfg, name, caps, serving)
    if v4:
        problems += dsv4_problems(cfg)  # includes what HiSparse of the CSA entries needs
    else:
        set_v4 = sorted(k for k, v in (model.get("v4") or {}).items() if v is not None)
        if set_v4:
            problems.append(Problem(f"model.v4 {set_v4}", f"set for model '{model['name']}' "
                                    f"(model_type {model.get('model_type')})", "model.v4 only for a DeepSeek-V4 model",
                                    "drop the model.v4 overrides"))
        problems += _model_problems(model, name, caps)
        if any(LayerKind(k) == LayerKind.linear for k in model["layer_pattern"]):
            problems += _linear_problems(cfg, linear_backend, device, package_present)
        if cfg["hisparse"]["enabled"]:
            problems += _hisparse_problems(cfg, name, caps, serving)

    # --- the decoder ops (MLA and V4 layers multiply their weights through them)
    fused = str(model.get("fused", "auto"))
    for reason in ops_problems(fused, device, TORCH_DTYPES[str(model["dtype"])]):
        add(Problem(f"model.fused={fused}", f"device {device.kind} ({device.name}), model.dtype={model['dtype']}",
                    f"the fused decoder kernels' requirement: {reason}",
                    "use model.fused=auto (fused where supported, torch elsewhere) or model.fused=off"))
    rows = model.get("gemv_rows", GEMV_MAX_ROWS)
    if not 0 <= int(rows) <= GEMV_MAX_ROWS:
        add(Problem("model.gemv_rows", str(rows), f"0 .. {GEMV_MAX_ROWS} (the few-row kernels use one "
                    f"{GEMV_MAX_ROWS}-row tile; 0 turns them off)", f"model.gemv_rows={GEMV_MAX_ROWS}"))

    # --- speculative decoding
    if cfg["speculative"]["enabled"]:
        problems += _speculative_problems(cfg, name, caps)

    # --- graphs
    g = cfg["graph"]
    if g["enabled"]:
        if device.kind != "cuda":
            add(Problem("graph.enabled=true", f"device {device.kind}", "a CUDA device (graphs are CUDA graphs)",
                        "use graph=off on the CPU"))
        bad = [b for b in g["batch_sizes"] if b < 1]
        if bad or not g["batch_sizes"]:
            add(Problem("graph.batch_sizes", str(g["batch_sizes"]), "a non-empty list of sizes >= 1",
                        "e.g. graph.batch_sizes=[1,2,4,8,16,32]"))
        if any(t < 1 for t in g["prefill_tokens"]):
            add(Problem("graph.prefill_tokens", str(g["prefill_tokens"]), "token counts >= 1 ([] : prefill eager)",
                        "e.g. graph.prefill_tokens=[256,512,1024,2048,4096]"))
        if g["prefill_tokens"] and g["prefill_requests"] < 2:
            add(Problem("graph.prefill_requests", str(g["prefill_requests"]),
                        ">= 2 (a graphed prefill step takes up to prefill_requests - 1 requests; one slot pads)",
                        "graph.prefill_requests=8"))
        moe = str(cfg["model"].get("mlp")) == "deepseek" and cfg["model"].get("n_routed_experts") and \
            (cfg["model"]["first_k_dense_replace"] or 0) < cfg["model"]["num_layers"]
        if moe and str(cfg["model"]["dtype"]) != "bfloat16":
            add(Problem("graph.enabled=true", f"MoE layers with model.dtype={cfg['model']['dtype']}",
                        "bfloat16 (graphed MoE runs torch._grouped_mm; other dtypes loop over experts with a host sync)",
                        "set model.dtype=bfloat16, or graph=off"))
        if moe and device.kind == "cuda":
            problems += _grouped_mm_problems(cfg["model"], device)
        impl = str(cfg["backend"].get("impl", "auto"))
        if caps is not None and caps.graph_impls is not None and impl != "auto" and impl not in caps.graph_impls:
            add(Problem("graph.enabled=true", f"backend '{name}' with impl={impl} (host loops, host syncs)",
                        f"backend.impl in {sorted(caps.graph_impls)} (or auto on CUDA) for graphed decode",
                        "use backend.impl=auto, or graph=off"))

    # --- KV cache and workload
    problems += _kv_dtype_problems(cfg, name, caps, serving, device)
    spec = cfg["speculative"]
    lookahead = spec["num_steps"] + 2 if spec["enabled"] and spec["num_steps"] >= 1 else 0
    source_problems, specs = check_workload(work, model, lookahead)  # reads the prompt file, if any
    problems += capped(source_problems)
    problems += _workload_problems(work, kv, model, lookahead, specs)
    return problems


def _family_problems(model, name: str, caps: BackendCapabilities | None, backends: Mapping[str, type],
                     family: str, device: DeviceInfo) -> list[Problem]:
    """The backend computes the model's kind of attention (``capabilities.model_families``)."""
    if caps is None or family in caps.model_families:
        return []
    cc = device.compute_capability
    serving = sorted(n for n, b in backends.items() if family in b.capabilities.model_families)
    here = [n for n in serving if backends[n].capabilities.runs_on(device.kind, cc) and not backends[n].capabilities.sparse]
    serving_fix = (here or serving)[:1]
    kind = "a DeepSeek-V4 model" if family == "dsv4" else "an MLA model (DeepSeek-V2/V3/V3.2 style)"
    return [Problem(f"backend '{name}' with model '{model['name']}'",
                    f"{kind}; the backend computes {sorted(caps.model_families)} attention",
                    f"a backend whose capabilities.model_families has '{family}': {serving}",
                    f"use backend={serving_fix[0]}" if serving else "no backend serves this model")]


def _speculative_problems(cfg, name: str, caps: BackendCapabilities | None) -> list[Problem]:
    out: list[Problem] = []
    add = out.append
    spec, model = cfg["speculative"], cfg["model"]
    if spec["topk"] != 1:
        add(Problem("speculative.topk", str(spec["topk"]), "1 (chain speculation; tree drafts are not implemented)",
                    "set speculative.topk=1"))
    if spec["num_steps"] < 1:
        add(Problem("speculative.num_steps", str(spec["num_steps"]), ">= 1 draft tokens per round",
                    "set speculative.num_steps=3"))
    n, layers = spec["draft_layers"], model["num_layers"]
    if not 1 <= n <= layers:
        add(Problem("speculative.draft_layers", str(n), f"1..model.num_layers ({layers})",
                    "set speculative.draft_layers=1"))
    pattern = [LayerKind(k) for k in model["layer_pattern"]] or [LayerKind.full]
    kinds = {pattern[i % len(pattern)] for i in range(layers)}
    if LayerKind.linear in kinds:
        add(Problem(f"speculative decoding with model '{model['name']}'", "linear-attention layers",
                    "an MLA-only model (rejected draft tokens would need the linear state rolled back, which is "
                    "not implemented)", "use speculative=off for hybrid models"))
    if cfg["hisparse"]["enabled"]:  # sparse layers without HiSparse speculate (the dsa backend verifies)
        add(Problem("speculative decoding with hisparse.enabled=true", "HiSparse offloading of the sparse layers' KV",
                    "hisparse.enabled=false (verify and draft extend over a HiSparse device buffer are not "
                    "implemented)", "use hisparse=off to speculate on a sparse model, or speculative=off"))
    if caps is not None:
        missing = [m.value for m in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND) if m not in caps.forward_modes]
        if missing:
            add(Problem(f"backend '{name}' with speculative decoding", f"forward modes without {missing}",
                        "target_verify and draft_extend in capabilities.forward_modes",
                        "pick a backend that lists them, or speculative=off"))
    return out


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def hardware_problems(name: str, caps: BackendCapabilities, device: DeviceInfo,
                      backends: Mapping[str, type]) -> list[Problem]:
    """Whether backend ``name``'s real kernels run on ``device``; if not, one problem naming the device found,
    the requirement, and the backends whose capabilities say they do run there (never a hard-coded list)."""
    cc = device.compute_capability
    if device.kind == "cuda" and cc is None:
        return []  # no GPU visible: the device check reports it
    if caps.runs_on(device.kind, cc):
        return []
    found = f"GPU {device.name} (compute capability {_cc(cc)})" if device.kind == "cuda" else "device cpu (no GPU)"
    need = []
    if "cuda" in caps.devices and caps.min_compute_capability is not None:
        need.append(f"compute capability >= {_cc(caps.min_compute_capability)}")
    if "cuda" in caps.devices and caps.compute_capabilities is not None:
        need.append("exactly one of " + ", ".join(_cc(c) for c in sorted(caps.compute_capabilities)))
    if device.kind not in caps.devices:
        need.insert(0, f"a device in {sorted(caps.devices)}")
    here = sorted(n for n, b in backends.items() if n != name and b.capabilities.runs_on(device.kind, cc))
    fix = f"use a backend that runs on this {'GPU' if device.kind == 'cuda' else 'machine'}: {', '.join(here)}" \
        if here else "run on a GPU the backend supports"
    if caps.emulation:
        fix += "; or backend.kernel=emulate (a torch emulation of the kernels, for tests: not their speed)"
    return [Problem(f"backend '{name}'", found, " and ".join(need), fix)]


def _backend_problems(name, backend_cls: type, cfg, device: DeviceInfo, package_present,
                      backends: Mapping[str, type]) -> list[Problem]:
    caps: BackendCapabilities = backend_cls.capabilities
    out: list[Problem] = []
    add = out.append
    emulated = caps.emulation and cfg["backend"].get("kernel") == "emulate"
    if not emulated:  # backend.kernel=emulate runs a torch emulation of the kernels anywhere
        out += hardware_problems(name, caps, device, backends)
        for pkg in caps.packages:
            if not package_present(pkg):
                add(Problem(f"backend '{name}'", f"python package '{pkg}' not importable", f"'{pkg}' installed",
                            caps.install))
    dtype = TORCH_DTYPES.get(str(cfg["model"]["dtype"]))
    if dtype is not None and dtype not in caps.dtypes and not emulated:
        add(Problem(f"backend '{name}'", f"model.dtype={cfg['model']['dtype']}",
                    f"one of {sorted(str(d).removeprefix('torch.') for d in caps.dtypes)}",
                    "set model.dtype=bfloat16"))
    page = cfg["kv"]["page_size"]
    if caps.page_sizes is not None and page not in caps.page_sizes:
        add(Problem(f"backend '{name}'", f"kv.page_size={page}", f"one of {sorted(caps.page_sizes)}",
                    f"set kv.page_size={sorted(caps.page_sizes)[-1]}"))
    if ForwardMode.DECODE not in caps.forward_modes or ForwardMode.EXTEND not in caps.forward_modes:
        add(Problem(f"backend '{name}'", f"forward modes {sorted(m.value for m in caps.forward_modes)}",
                    "at least extend and decode", "pick a complete backend"))
    out += backend_cls.config_problems(cfg["backend"], cfg["model"], device)
    hooks = [(MHAChunkPrefill, caps.mha_chunked_prefill, "capabilities.mha_chunked_prefill"),
             (SparseDecode, caps.sparse, "capabilities.sparse")]
    if cfg["graph"]["enabled"]:
        graphable = any(level > CudaGraphLevel.NEVER for _, level in caps.cuda_graph)
        hooks.append((GraphHooks, graphable, "a CUDA-graph level above NEVER"))
    for proto, declared, because in hooks:
        if declared:
            for msg in hook_signature_problems(backend_cls, proto):
                add(Problem(f"backend '{name}' hook {proto.__name__}", msg,
                            f"every {proto.__name__} method, as backends/base.py declares it (it has {because})",
                            f"implement the method, or drop the capability from {backend_cls.__name__}.capabilities"))
    if cfg["workspace"]["skip"] and FLASHINFER_WORKSPACE in caps.workspaces:
        add(Problem("workspace.skip=true", f"backend '{name}' consumes the shared FlashInfer workspace",
                    "a backend that needs no shared workspace, or workspace.skip=false",
                    "drop workspace=skip, or use backend=triton_mla"))
    return out


def _grouped_mm_problems(model: Mapping[str, Any], device: DeviceInfo) -> list[Problem]:
    """Graphed MoE needs ``torch._grouped_mm`` (:data:`runtime.model.deepseek.moe.GROUPED_MM`): its least compute
    capability, and expert GEMM dims that are multiples of its ``dim_multiple`` (else the experts loop with a
    host sync, which a graph capture refuses)."""
    out, g = [], GROUPED_MM
    cc = device.compute_capability
    if cc is not None and cc < g.min_capability:
        out.append(Problem("graph.enabled=true", f"MoE layers on a GPU of compute capability {cc[0]}.{cc[1]}",
                           f"{g.min_capability[0]}.{g.min_capability[1]} or newer (torch._grouped_mm)", "use graph=off"))
    bad = g.odd_dims({k: model.get(k) or 0 for k in ("hidden_size", "moe_intermediate_size")})
    if bad:
        out.append(Problem("graph.enabled=true", f"MoE dims {bad}",
                           f"multiples of {g.dim_multiple} (torch._grouped_mm's rows)", "use graph=off"))
    return out


def _model_problems(model, backend_name: str, caps: BackendCapabilities | None) -> list[Problem]:
    out: list[Problem] = []
    add = out.append
    for key in ("num_layers", "hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "vocab_size", "max_context"):
        if model[key] < 1:
            add(Problem(f"model.{key}", str(model[key]), ">= 1", f"set model.{key} to a positive value"))
    if model["q_lora_rank"] is not None and model["q_lora_rank"] < 1:
        add(Problem("model.q_lora_rank", str(model["q_lora_rank"]), "null or >= 1", "set model.q_lora_rank=null"))
    if not model["layer_pattern"]:
        add(Problem("model.layer_pattern", "[]", "a non-empty list of full|linear|sparse", "set model.layer_pattern=[full]"))
    kinds = {LayerKind(k) for k in model["layer_pattern"]}
    if LayerKind.linear in kinds and not kinds - {LayerKind.linear}:
        add(Problem(f"model '{model['name']}'", "only linear-attention layers", "at least one MLA layer",
                    "add full to model.layer_pattern, e.g. [linear, linear, linear, full]"))
    if LayerKind.sparse in kinds and caps is not None and not caps.sparse:
        add(Problem(f"model '{model['name']}'", f"sparse layers with backend '{backend_name}'",
                    "a sparse-capable backend for sparse layers",
                    "use backend=dsa, or a model whose layer_pattern is [full]"))
    out += _mlp_problems(model)
    if LayerKind.sparse in kinds:
        if model.get("index_n_heads", 0) < 1:
            add(Problem(f"model '{model['name']}'", f"sparse layers with index_n_heads={model.get('index_n_heads')}",
                        "an indexer (index_n_heads >= 1) to pick the tokens sparse layers attend to",
                        "set model.index_n_heads=64 (or use model=tiny_dsa / deepseek_v32)"))
        di, rope = model.get("index_head_dim", 0), model["qk_rope_head_dim"]
        if di < rope or di % 2:
            add(Problem("model.index_head_dim", f"{di} (qk_rope_head_dim {rope})",
                        "an even head dim >= qk_rope_head_dim (RoPE covers its first qk_rope_head_dim dims)",
                        f"set model.index_head_dim={max(128, rope)}"))
        if model.get("index_topk", 0) < 1:
            add(Problem("model.index_topk", str(model.get("index_topk")), ">= 1", "set model.index_topk=2048"))
        if LayerKind.linear in kinds:
            add(Problem(f"model '{model['name']}'", "sparse and linear-attention layers in one model",
                        "sparse layers with full or sparse layers only", "drop linear from model.layer_pattern"))
    return out


def _mlp_problems(model) -> list[Problem]:
    """DeepSeek MLP / MoE fields (model.mlp=deepseek)."""
    if str(model.get("mlp", "none")) == "none":
        return []
    out: list[Problem] = []
    add = out.append
    n, first, e = model["num_layers"], model["first_k_dense_replace"], model["n_routed_experts"]
    if (first > 0 or not e) and model["intermediate_size"] < 1:
        add(Problem("model.intermediate_size", str(model["intermediate_size"]), ">= 1 (dense MLP layers)",
                    "set model.intermediate_size, or model.mlp=none for attention-only layers"))
    if e and first < n:
        k, g, tg = model["num_experts_per_tok"], model["n_group"], model["topk_group"]
        if model["moe_intermediate_size"] < 1:
            add(Problem("model.moe_intermediate_size", str(model["moe_intermediate_size"]), ">= 1",
                        "set model.moe_intermediate_size"))
        if g < 1 or e % g:
            add(Problem("model.n_group", f"{g} groups of {e} experts", "a divisor of n_routed_experts",
                        "set model.n_group=1"))
        elif not 1 <= tg <= g:
            add(Problem("model.topk_group", str(tg), f"1..n_group ({g})", f"set model.topk_group={g}"))
        elif not 1 <= k <= tg * (e // g):
            add(Problem("model.num_experts_per_tok", str(k), f"1..{tg * (e // g)} (experts in the topk_group groups)",
                        "set model.num_experts_per_tok=8"))
    return out


def _hisparse_problems(cfg, name: str, caps: BackendCapabilities | None, backends) -> list[Problem]:
    hs, model = cfg["hisparse"], cfg["model"]
    out: list[Problem] = []
    add = out.append
    if caps is not None and not caps.sparse:
        sparse = [n for n, b in backends.items() if b.capabilities.sparse]
        add(Problem("hisparse.enabled=true", f"backend '{name}', which is not sparse-capable",
                    "a backend whose capabilities.sparse is true",
                    "use hisparse=off" + (f", or backend={sparse[0]} (sparse-capable)" if sparse else "")))
    out += hisparse_size_problems(hs, "token", ratio_fix=4)
    kinds = {LayerKind(k) for k in model["layer_pattern"]}
    if model.get("index_n_heads", 0) < 1 or LayerKind.sparse not in kinds:
        add(Problem("hisparse.enabled=true", f"model '{model['name']}' without an indexer and sparse layers",
                    "a model with an indexer (index_n_heads >= 1) and sparse layers (HiSparse serves their top-k)",
                    "use model=tiny_dsa (CPU) or model=deepseek_v32, or hisparse=off"))
    elif kinds != {LayerKind.sparse}:
        add(Problem("hisparse.enabled=true", f"model.layer_pattern {sorted(k.value for k in kinds)}",
                    "every attention layer sparse (under HiSparse decode tokens take no device KV page, which dense "
                    "layers would read)", "set model.layer_pattern=[sparse], or hisparse=off"))
    elif hs["top_k"] != model.get("index_topk"):
        add(Problem("hisparse.top_k", f"{hs['top_k']} (model.index_topk is {model.get('index_topk')})",
                    "equal to model.index_topk (the number of tokens the indexer selects)",
                    f"set hisparse.top_k={model.get('index_topk')}"))
    return out


def _prefill_problems(cfg, name: str, caps: BackendCapabilities | None, backends) -> list[Problem]:
    if cfg["attention"]["prefill"] != "mha_chunked" or caps is None:
        return []
    out = []
    if not caps.mha_chunked_prefill:
        have = sorted(n for n, b in backends.items() if b.capabilities.mha_chunked_prefill)
        out.append(Problem(f"backend '{name}' hook MHAChunkPrefill",
                           "missing (capabilities.mha_chunked_prefill is false)",
                           "the hook, because attention.prefill=mha_chunked takes the MHA chunked-prefix path",
                           f"use attention.prefill=auto (absorbed prefill), or a backend with the hook: {have}"))
    if cfg["backend"].get("disable_ragged"):
        out.append(Problem(f"backend '{name}'", "disable_ragged=true with attention.prefill=mha_chunked",
                           "one of the two", "drop backend.disable_ragged, or use attention.prefill=absorbed"))
    return out


def _linear_problems(cfg, linear_backend: type | None, device: DeviceInfo, package_present) -> list[Problem]:
    out: list[Problem] = []
    impl = cfg["attention"]["linear_impl"]
    if linear_backend is not None and device.kind not in linear_backend.capabilities.devices:
        out.append(Problem("linear-attention layers", f"device {device.kind}",
                           f"a device in {sorted(linear_backend.capabilities.devices)}", "use device=cuda"))
    if impl == "fla":
        if device.kind != "cuda":
            out.append(Problem("attention.linear_impl=fla", f"device {device.kind}", "a CUDA device (Triton kernels)",
                               "use attention.linear_impl=torch on the CPU"))
        if not package_present("fla"):
            out.append(Problem("attention.linear_impl=fla", "python package 'fla' (fla-core) not importable",
                               "fla-core installed", "pip install 'mla-runtime[gpu]', or attention.linear_impl=torch"))
    model = cfg["model"]
    if (model.get("linear_num_heads") or 1) < 1 or model.get("linear_head_dim", 1) < 1:
        out.append(Problem("model.linear_num_heads / linear_head_dim",
                           f"{model.get('linear_num_heads')} / {model.get('linear_head_dim')}", ">= 1",
                           "set positive values (null heads means num_heads)"))
    return out


def _fp8_ok(caps: BackendCapabilities, model_dtype, device: DeviceInfo) -> bool:
    if "fp8_e4m3" not in caps.kv_dtypes:
        return False
    if caps.fp8_kv_model_dtypes is not None and model_dtype not in caps.fp8_kv_model_dtypes:
        return False
    cc = device.compute_capability
    return caps.fp8_kv_gpu_major is None or device.kind != "cuda" or cc is None or cc[0] == caps.fp8_kv_gpu_major


def _kv_dtype_problems(cfg, name: str, caps: BackendCapabilities | None, backends: Mapping[str, type],
                       device: DeviceInfo) -> list[Problem]:
    """kv.dtype / kv.scale: the scale is a positive finite number; an fp8 cache needs a backend whose
    capabilities read it (for this model dtype and GPU), and no HiSparse (its host pool copies raw rows)."""
    out: list[Problem] = []
    kv, model_dtype = cfg["kv"], TORCH_DTYPES.get(str(cfg["model"]["dtype"]))
    kv_dtype, scale = str(kv.get("dtype", "auto")), kv.get("scale", 1.0)
    if not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
        out.append(Problem("kv.scale", repr(scale), "a positive finite number (fp8 stores value / scale)",
                           "set kv.scale=1.0, or the cache's absolute maximum / 448"))
    if kv_dtype == "auto":
        return out
    if caps is not None and not _fp8_ok(caps, model_dtype, device):
        working = sorted(n for n, cls in backends.items() if _fp8_ok(cls.capabilities, model_dtype, device))
        extra = []
        if caps.fp8_kv_model_dtypes is not None:
            extra.append(f"model.dtype in {sorted(str(d).removeprefix('torch.') for d in caps.fp8_kv_model_dtypes)}")
        if caps.fp8_kv_gpu_major is not None:
            extra.append(f"a GPU of compute capability {caps.fp8_kv_gpu_major}.x")
        need = f" ({', '.join(extra)})" if extra and kv_dtype in caps.kv_dtypes else ""
        got = f"model.dtype={cfg['model']['dtype']}" + (f", GPU {device.name}" if device.kind == "cuda" else "")
        out.append(Problem(f"kv.dtype={kv_dtype} with backend '{name}'", got,
                           f"a backend that reads an {kv_dtype} cache{need}: {working}",
                           f"use backend={working[0]}, or kv.dtype=auto" if working else "use kv.dtype=auto"))
    if cfg["hisparse"]["enabled"]:
        out.append(Problem(f"kv.dtype={kv_dtype} with hisparse.enabled=true",
                           "HiSparse host pool (copies rows in the model dtype)", "kv.dtype=auto with HiSparse",
                           "set kv.dtype=auto, or hisparse=off"))
    return out


def _workload_problems(work, kv, model, lookahead: int = 0, specs: list[RequestSpec] | None = None) -> list[Problem]:
    """``lookahead``: positions a speculative round reserves past a request's length (num_steps + 2).
    ``specs``: the prompt file's requests (their lengths replace the synthetic length distributions), or None
    for a synthetic workload."""
    out: list[Problem] = []
    add = out.append
    synthetic = specs is None
    keys = ("max_running_requests", "max_tokens_per_batch", "chunked_prefill_size", "mha_prefix_chunk_tokens")
    for key in (("num_requests",) if synthetic else ()) + keys:
        if work[key] < 1:
            add(Problem(f"workload.{key}", str(work[key]), ">= 1", f"set workload.{key} to a positive value"))
    if synthetic:
        for which in ("prompt_len", "output_len"):
            d = work[which]
            if d["min"] < 1 or d["max"] < d["min"] or d["mean"] < 1 or d["std"] < 0:
                add(Problem(f"workload.{which}", f"min={d['min']} mean={d['mean']} std={d['std']} max={d['max']}",
                            "1 <= min <= max, mean >= 1, std >= 0",
                            f"e.g. workload.{which}.min=1 workload.{which}.max=64"))
        longest = work["prompt_len"]["max"] + work["output_len"]["max"] + lookahead
        spec = f" + speculative look-ahead {lookahead}" if lookahead else ""
        if longest > model["max_context"]:
            add(Problem("workload length", f"prompt_len.max + output_len.max{spec} = {longest} tokens",
                        f"<= model.max_context ({model['max_context']})",
                        f"lower workload.prompt_len.max, or raise model.max_context to {longest}"))
    else:  # each line's length against max_context is checked with the file
        longest = max((len(s.prompt) + s.max_new_tokens for s in specs), default=0) + lookahead
    for key in ("page_size", "max_requests"):
        if kv[key] < 1:
            add(Problem(f"kv.{key}", str(kv[key]), ">= 1", f"set kv.{key} to a positive value"))
    fixed = isinstance(kv["num_pages"], int) and not isinstance(kv["num_pages"], bool)  # auto: the memory plan's
    if not fixed and kv["num_pages"] != "auto" or fixed and kv["num_pages"] < 1:
        add(Problem("kv.num_pages", repr(kv["num_pages"]), "auto or an integer >= 1",
                    "set kv.num_pages=auto (sized from the device's free memory), or a page count"))
    elif fixed and kv["page_size"] >= 1:
        usable = (kv["num_pages"] - 1) * kv["page_size"]  # page 0 is the padding page
        need = -(-longest // kv["page_size"]) * kv["page_size"]
        if usable < need:
            add(Problem("kv pool", f"{kv['num_pages'] - 1} usable pages x {kv['page_size']} = {usable} tokens",
                        f"room for one request of {longest} tokens ({need} with page rounding)",
                        f"set kv.num_pages={need // kv['page_size'] + 1} or more"))
    if work["max_running_requests"] > kv["max_requests"] >= 1:
        add(Problem("workload.max_running_requests", str(work["max_running_requests"]),
                    f"<= kv.max_requests ({kv['max_requests']})",
                    f"set kv.max_requests={work['max_running_requests']}"))
    return out
