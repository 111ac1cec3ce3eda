"""Hugging Face safetensors checkpoints: the tensors a DeepSeek model needs, checked, then loaded shard by shard.

:func:`scan_checkpoint` reads only the safetensors headers (a few KiB per shard) and returns every problem:
a shard the index names that is missing or shorter than its header says (truncated), a tensor that is missing,
has the wrong shape, or a dtype we cannot serve; fp8 weights without their block scales. Validation runs it
before anything is allocated.

:func:`load_checkpoint` then opens one shard at a time with ``safe_open`` and moves each tensor to the device
in the compute dtype as it is read, so at most one tensor of the checkpoint is on the host at a time. fp8 e4m3
weights (the official V3/V3.2 release) carry ``<name>_scale_inv`` [ceil(out/128), ceil(in/128)] float32 block
scales: ``weight = fp8 * scale`` per 128 x 128 block (:mod:`runtime.model.quantized`). ``model.weights=stored``
keeps them so on the device (a :class:`~runtime.model.quantized.BlockFP8`; ``kv_b_proj`` excepted:
:mod:`runtime.model.deepseek.stored`), ``dequantize`` expands them at load. Layers past ``spec.num_layers`` (a cut
model, or the release's MTP layer) are not read.

Tensor parallelism: each rank reads only its slice of each tensor (``safe_open(...).get_slice``; the cuts are
:mod:`runtime.model.deepseek.sharding`'s), for fp8 weights with the block-scale rows and columns that cover the
slice (dequantised, then trimmed to it; the same for DeepSeek-V4's fp4 experts, whose scales cover a row and
32 inputs); with expert parallelism the other ranks' experts are not read at all.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from runtime.core.errors import CheckpointError, Problem
from runtime.core.model_spec import MLPLayer, ModelSpec
from runtime.core.parallel import ONE_RANK, Sharding
from runtime.model.deepseek.sharding import FULL, Cut, experts_of, local_shape, tensor_cut
from runtime.model.deepseek.stored import ROUTER, block_layout_problems, kept_fp8, router_dtype
from runtime.model.deepseek.weights import (
    AttentionWeights,
    DecoderLayerWeights,
    DenseMLPWeights,
    ModelWeights,
    moe_weights,
    split_kv_b,
    stacks_shared,
)
from runtime.model.indexer import IndexerWeights
from runtime.model.quantized import (
    FP8_BLOCK,
    BlockFP8,
    PackedFP4,
    ScaledTensor,
    StoredKind,
    Weight,
    apply_block_scales,
    cat_rows,
    scale_values,
    stored_weight,
    unpack_fp4,
)

INDEX_FILE = "model.safetensors.index.json"
#: the largest fp4 scale a weight kept as stored may have: the CUDA-core fp4 expert kernels scale by 2**63 twice
#: (``backends/kernels/gemm/fp4_fma_kernels.py``), so they hold ue8m0 bytes up to 191
FP4_MAX_SCALE = 2.0**64
SINGLE_FILE = "model.safetensors"
FP8 = "F8_E4M3"
F4 = "F4"  # safetensors' float4 (DeepSeek-V4 fp4 experts; its header counts fp4 elements)
# safetensors dtype names we serve -> torch dtypes
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          FP8: torch.float8_e4m3fn}
FLOAT32_TENSORS = ("e_score_correction_bias", "indexer.weights_proj.weight")  # the router: router_dtype


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (name -> {dtype, shape, data_offsets}) and the byte count it implies."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * (1 << 20):
            raise ValueError(f"header length {n} bytes is not plausible")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    return header, 8 + n + end


def checkpoint_index(folder: Path) -> tuple[dict[str, TensorInfo], list[Problem]]:
    """Every tensor of the folder's safetensors (single file or sharded through the index) -> where and what."""
    problems: list[Problem] = []
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            return {}, [Problem(f"{index_path}", f"unreadable ({e!r})", "a JSON object with a weight_map",
                                "re-download the checkpoint")]
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        return {}, [Problem(f"{folder}", "no model.safetensors and no model.safetensors.index.json",
                            "safetensors weights", "point model.path at a folder saved with safetensors")]
    out: dict[str, TensorInfo] = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            problems.append(Problem(f"shard {path}", "missing", f"the file {INDEX_FILE} lists",
                                    "download the missing shard"))
            continue
        try:
            header, need = read_header(path)
        except (OSError, ValueError) as e:
            problems.append(Problem(f"shard {path}", f"unreadable header ({e})", "a safetensors file",
                                    "re-download the shard"))
            continue
        size = os.path.getsize(path)
        if size < need:
            problems.append(Problem(f"shard {path}", f"{size} bytes (truncated)", f"{need} bytes, as its header says",
                                    "re-download the shard"))
            continue
        for tname, meta in header.items():
            out[tname] = TensorInfo(path, meta["dtype"], tuple(meta["shape"]))
    return out, problems


def expected_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor ``spec`` reads (routed experts in the per-expert layout)."""
    s = spec
    d, h, v = s.hidden_size, s.num_heads, s.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not s.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for i, (kind, mkind) in enumerate(zip(s.layer_kinds, s.mlp_kinds)):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        out[f"{p}.input_layernorm.weight"] = (d,)
        if s.q_lora_rank:
            out.update({f"{a}.q_a_proj.weight": (s.q_lora_rank, d), f"{a}.q_a_layernorm.weight": (s.q_lora_rank,),
                        f"{a}.q_b_proj.weight": (h * s.qk_head_dim, s.q_lora_rank)})
        else:
            out[f"{a}.q_proj.weight"] = (h * s.qk_head_dim, d)
        out.update({f"{a}.kv_a_proj_with_mqa.weight": (s.kv_row_dim, d), f"{a}.kv_a_layernorm.weight": (s.kv_lora_rank,),
                    f"{a}.kv_b_proj.weight": (h * (s.qk_nope_head_dim + s.v_head_dim), s.kv_lora_rank),
                    f"{a}.o_proj.weight": (d, h * s.v_head_dim)})
        if kind.value == "sparse":
            hi, di, x = s.index_n_heads, s.index_head_dim, f"{a}.indexer"
            out.update({f"{x}.wq_b.weight": (hi * di, s.q_lora_rank or d), f"{x}.wk.weight": (di, d),
                        f"{x}.k_norm.weight": (di,), f"{x}.k_norm.bias": (di,), f"{x}.weights_proj.weight": (hi, d)})
        if mkind != MLPLayer.none:
            out[f"{p}.post_attention_layernorm.weight"] = (d,)
        if mkind == MLPLayer.dense:
            out.update(_mlp(f"{p}.mlp", s.intermediate_size, d))
        elif mkind == MLPLayer.moe:
            e, im = s.n_routed_experts, s.moe_intermediate_size
            out[f"{p}.mlp.gate.weight"] = (e, d)
            if s.scoring_func == "sigmoid":
                out[f"{p}.mlp.gate.e_score_correction_bias"] = (e,)
            for x in range(e):
                out.update(_mlp(f"{p}.mlp.experts.{x}", im, d))
            if s.n_shared_experts:
                out.update(_mlp(f"{p}.mlp.shared_experts", im * s.n_shared_experts, d))
    return out


def _mlp(prefix: str, inter: int, d: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.gate_proj.weight": (inter, d), f"{prefix}.up_proj.weight": (inter, d),
            f"{prefix}.down_proj.weight": (d, inter)}


def _fused_experts(index: dict[str, TensorInfo], expected: dict, spec: ModelSpec) -> dict:
    """Accept transformers' fused expert tensors (``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj``
    [E, D, I]) in place of the per-expert ones, layer by layer."""
    out = dict(expected)
    e, im, d = spec.n_routed_experts, spec.moe_intermediate_size, spec.hidden_size
    for i, mkind in enumerate(spec.mlp_kinds):
        fused = f"model.layers.{i}.mlp.experts.gate_up_proj"
        if mkind == MLPLayer.moe and fused in index:
            for x in range(e):
                for part in ("gate_proj", "up_proj", "down_proj"):
                    out.pop(f"model.layers.{i}.mlp.experts.{x}.{part}.weight")
            out[fused] = (e, 2 * im, d)
            out[f"model.layers.{i}.mlp.experts.down_proj"] = (e, d, im)
    return out


def tensor_problems(folder: Path, index: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]]) -> list[Problem]:
    """Every expected tensor that is missing (the first 20, then a count) or has another shape, with its file."""
    problems: list[Problem] = []
    missing = [n for n in expected if n not in index]
    for name in missing[:20]:
        problems.append(Problem(f"tensor {name}", "missing", f"shape {list(expected[name])} in {folder}",
                                "use a complete checkpoint, or check config.json against the weights"))
    if len(missing) > 20:
        problems.append(Problem("tensors", f"{len(missing) - 20} more missing", "every tensor the config implies",
                                "use a complete checkpoint"))
    for name, shape in expected.items():
        info = index.get(name)
        if info is not None and info.shape != shape:
            problems.append(Problem(f"tensor {name} in {info.file.name}", f"shape {list(info.shape)}",
                                    f"shape {list(shape)} (from config.json)",
                                    "the config and the weights disagree: fix config.json or re-save the checkpoint"))
    return problems


def scan_checkpoint(spec: ModelSpec, shard: Sharding = ONE_RANK) -> tuple[dict[str, TensorInfo], dict, list[Problem]]:
    """Headers only: (index, expected name -> shape, every problem). See the module docstring. With
    ``model.weights=stored``, every fp8 tensor's tensor-parallel cut (``shard``) and load-time fusion must keep
    its scale blocks whole."""
    folder = Path(spec.path)
    index, problems = checkpoint_index(folder)
    if problems and not index:
        return index, {}, problems
    expected = _fused_experts(index, expected_tensors(spec), spec)
    problems += tensor_problems(folder, index, expected)
    for name, shape in expected.items():
        info = index.get(name)
        if info is None:
            continue
        if info.dtype not in DTYPES:
            problems.append(Problem(f"tensor {name} in {info.file.name}", f"dtype {info.dtype}",
                                    f"one of {sorted(DTYPES)}", "convert the checkpoint to bf16"))
        elif info.dtype == FP8:
            scale = index.get(name + "_scale_inv")
            want = tuple(-(-n // b) for n, b in zip(shape, FP8_BLOCK))
            if scale is None or scale.shape != want:
                problems.append(Problem(f"tensor {name} in {info.file.name}",
                                        "fp8 e4m3 without block scales" if scale is None
                                        else f"{name}_scale_inv of shape {list(scale.shape)}",
                                        f"{name}_scale_inv of shape {list(want)} (128 x 128 blocks)",
                                        "use the release's scales, or a bf16 checkpoint"))
    if spec.weights == "stored" and not problems:
        fp8 = {n: shape for n, shape in expected.items() if index[n].dtype == FP8}
        problems += block_layout_problems(spec, shard, fp8)
    return index, expected, problems


def v3_scales(index: dict[str, TensorInfo]) -> dict[str, ScaledTensor]:
    """The V3/V3.2 release's fp8 weights: each ``F8_E4M3`` tensor's float32 ``<name>_scale_inv``, 128 x 128."""
    return {name: ScaledTensor(StoredKind.fp8, name + "_scale_inv", FP8_BLOCK)
            for name, info in index.items() if info.dtype == FP8}


def _span(s: slice, n: int) -> tuple[int, int]:
    r = range(n)[s]
    return r.start, r.stop


class _Reader:
    """Reads tensors shard by shard (one open file at a time), converting each to the device and a dtype; a
    tensor ``scaled`` names (fp8 / fp4 with its scale tensor) is dequantized as it is read, or, when ``keep``
    says so for its name, kept as stored (a :class:`BlockFP8`, or DeepSeek-V4's fp4 as a :class:`PackedFP4`)."""

    def __init__(self, index: dict[str, TensorInfo], device: torch.device, dtype: torch.dtype,
                 scaled: dict[str, ScaledTensor], keep=lambda name: False):
        self.index, self.device, self.dtype, self.scaled, self.keep = index, device, dtype, scaled, keep
        self._file: Path | None = None
        self._handle = None

    def _open(self, path: Path):
        if self._file != path:
            self.close()
            self._handle = safe_open(str(path), framework="pt", device="cpu").__enter__()
            self._file = path
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            self._handle.__exit__(None, None, None)
            self._handle, self._file = None, None

    def kept(self, name: str) -> bool:
        """Whether tensor ``name`` is read as stored (block-fp8 / packed fp4) rather than dequantized."""
        return name in self.scaled and self.keep(name)

    def get(self, name: str, dtype: torch.dtype | None = None, cut: Cut = FULL) -> Weight:
        """Tensor ``name`` (this rank's ``cut`` of it: only those bytes are read) on the device, in ``dtype`` (or as
        stored: a BlockFP8)."""
        info = self.index[name]
        if name.endswith(ROUTER):
            want = dtype or router_dtype(info.dtype, self.dtype)
        else:
            want = dtype or (torch.float32 if name.endswith(FLOAT32_TENSORS) else self.dtype)
        if cut.replicated:
            parts = [self._whole(name, info, want)]
        else:
            parts = [self._piece(name, info, piece, want) for piece in cut.pieces]
        return parts[0] if len(parts) == 1 else cat_rows(parts, dim=cut.dim)

    def _scale(self, stored: ScaledTensor, blocks: tuple[slice, ...] | None = None) -> torch.Tensor:
        h = self._open(self.index[stored.scale].file)
        return h.get_tensor(stored.scale) if blocks is None else h.get_slice(stored.scale)[blocks]

    def _kept_scale(self, name: str, stored: ScaledTensor, scale: torch.Tensor) -> torch.Tensor:
        """The scales of a weight kept as stored, as read (on the host), after the check the fp4 kernels need:
        every scale at most 2**64 (:data:`FP4_MAX_SCALE`, ue8m0 bytes <= 191; NaN / inf refused too)."""
        if stored.kind == StoredKind.fp4 and scale.numel():
            raw = scale.dtype in (torch.uint8, torch.float8_e8m0fnu)  # ue8m0 bytes: the largest byte only (fast)
            top = float(scale_values(scale.view(torch.uint8).max().reshape(1) if raw else scale).max())
            if not top <= FP4_MAX_SCALE:  # NaN fails too
                raise CheckpointError([Problem(
                    f"{stored.scale} (the fp4 scales of {name})", f"a scale of {top:g}",
                    "scales up to 2**64 (ue8m0 bytes <= 191; the CUDA-core fp4 kernels take no more, and a "
                    "release's are near 2**-8)", "the file is damaged: download the shard that holds it again")])
        return scale

    def _whole(self, name: str, info: TensorInfo, want: torch.dtype) -> Weight:
        t = self._open(info.file).get_tensor(name)
        stored = self.scaled.get(name)
        if stored is None:
            return t.to(device=self.device, dtype=want)
        scale = self._scale(stored)
        if self.kept(name):
            return stored_weight(stored.kind, stored.block, t.to(self.device),
                                 self._kept_scale(name, stored, scale).to(self.device))
        return stored.dequantize(t.to(self.device), scale.to(self.device), want)

    def _piece(self, name: str, info: TensorInfo, piece: tuple[slice, ...], want: torch.dtype) -> torch.Tensor:
        """One piece of a cut: ``piece`` indexes the tensor's (unpacked) elements. A block-scaled weight reads the
        stored bytes that cover it and the scale blocks that cover those, dequantizes, then trims: fp8 [out, in];
        fp4 packed two per byte ([out, in / 2] ``I8``: the bytes that hold the piece's columns; a ``F4`` tensor is
        read whole and cut on the host, as safetensors cannot slice it)."""
        stored = self.scaled.get(name)
        if stored is None:
            return self._open(info.file).get_slice(name)[piece].to(device=self.device, dtype=want)
        fp4 = stored.kind == StoredKind.fp4
        rows, cols = info.shape[0], info.shape[1] * (2 if fp4 and info.dtype != F4 else 1)
        if self.kept(name):  # whole blocks / groups (the scan checked the cut): the bytes and scales as stored
            full = PackedFP4.empty((rows, cols), "meta", stored.block[1]) if fp4 else \
                BlockFP8.empty((rows, cols), "meta", stored.block)
            w_idx, s_idx = full.index_of(piece)
            h = self._open(info.file)
            t = h.get_tensor(name)[w_idx] if info.dtype == F4 else h.get_slice(name)[w_idx]
            return stored_weight(stored.kind, stored.block, t.to(self.device),
                                 self._kept_scale(name, stored, self._scale(stored, s_idx)).to(self.device))
        (br, bc), (r0, r1), (c0, c1) = stored.block, *(_span(s, n) for s, n in zip(piece + (slice(None),) * 2,
                                                                                  (rows, cols)))
        b0, b1 = (c0 // 2, -(-c1 // 2)) if fp4 else (c0, c1)  # the stored columns (fp4: bytes) that hold the piece
        if info.dtype == F4:
            t = self._open(info.file).get_tensor(name)[r0:r1, b0:b1]
        else:
            t = self._open(info.file).get_slice(name)[r0:r1, b0:b1]
        t = t.to(self.device)
        values = unpack_fp4(t)[:, c0 - 2 * b0: c1 - 2 * b0] if fp4 else t.float()
        blocks = (slice(r0 // br, -(-r1 // br)), slice(c0 // bc, -(-c1 // bc)))
        scale = self._scale(stored, blocks)
        return apply_block_scales(values, scale.to(self.device), stored.block, want, r0 % br, c0 % bc)


def load_checkpoint(spec: ModelSpec, device: torch.device, shard: Sharding = ONE_RANK) -> ModelWeights:
    """The weights of ``spec`` (the full model) from ``spec.path`` (see the module docstring), this rank's slices
    of them under tensor parallelism (``shard``); fp8 tensors kept as stored with ``model.weights=stored``.
    Raises CheckpointError listing every problem before any tensor is read."""
    start = time.perf_counter()
    index, expected, problems = scan_checkpoint(spec, shard)
    if problems:
        raise CheckpointError(problems)
    cuts = {n: tensor_cut(n, expected[n], spec, shard) for n in expected}
    # read in file order: each shard is opened once; other ranks' experts (moe=ep) are skipped
    order = sorted((n for n in expected if cuts[n] is not None), key=lambda n: (str(index[n].file), n))
    r = _Reader(index, torch.device(device), spec.dtype, v3_scales(index),
                keep=kept_fp8 if spec.weights == "stored" else lambda name: False)
    got: dict[str, Weight] = {}
    stacks: dict[str, Weight] = {}
    mine, d = experts_of(spec.n_routed_experts, shard), spec.hidden_size
    try:
        for name in order:
            if ".mlp.experts." in name and name.split(".mlp.experts.")[1][0].isdigit():
                layer = name.split(".mlp.experts.")[0]
                x, part = name.split(".mlp.experts.")[1].split(".")[:2]
                key = f"{layer}.gate_up" if part in ("gate_proj", "up_proj") else f"{layer}.down"
                im = local_shape(expected[name], cuts[name])[0 if part != "down_proj" else 1]
                if key not in stacks:  # with the shared expert's slot last where it is stored as they are
                    slots = len(mine) + (stacks_shared(spec, shard) and _shared_as(r, layer, name))
                    shape = (slots, 2 * im, d) if key.endswith("gate_up") else (slots, d, im)
                    stacks[key] = BlockFP8.empty(shape, device) if r.kept(name) else \
                        torch.empty(shape, dtype=spec.dtype, device=device)
                rows = {"gate_proj": slice(0, im), "up_proj": slice(im, 2 * im), "down_proj": slice(None)}[part]
                stacks[key][int(x) - mine.start, rows] = r.get(name, cut=cuts[name])
            else:
                got[name] = r.get(name, cut=cuts[name])
    finally:
        r.close()
    for i in range(spec.num_layers):  # transformers' fused layout
        p = f"model.layers.{i}.mlp.experts"
        if f"{p}.gate_up_proj" in got:
            stacks[f"model.layers.{i}.gate_up"] = got.pop(f"{p}.gate_up_proj")
            stacks[f"model.layers.{i}.down"] = got.pop(f"{p}.down_proj")
    weights = _assemble(spec, got, stacks, mine, shard.part(spec.vocab_size).start)
    weights.load_seconds = time.perf_counter() - start
    weights.peak_host_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights.source = str(spec.path)
    weights.stored_dtypes = dict(Counter(index[n].dtype for n in order))
    return weights


def _shared_as(r: _Reader, layer: str, routed: str) -> bool:
    """Whether the shared expert of ``layer`` is read in the storage of its routed expert ``routed`` (both kept
    as stored, or both in the model dtype), so it can take the experts' stack's last slot."""
    names = [f"{layer}.mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
    return all(n in r.index and r.kept(n) == r.kept(routed) for n in names)


def _assemble(spec: ModelSpec, g: dict[str, Weight], stacks: dict[str, Weight], mine: range,
              vocab_start: int) -> ModelWeights:
    s = spec
    layers = []
    for i, (kind, mkind) in enumerate(zip(s.layer_kinds, s.mlp_kinds)):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        w_uk, w_uv = split_kv_b(g.pop(f"{a}.kv_b_proj.weight"), s)
        indexer = None
        if kind.value == "sparse":
            x = f"{a}.indexer"
            indexer = IndexerWeights(wq_b=g[f"{x}.wq_b.weight"], wk=g[f"{x}.wk.weight"],
                                     k_norm_weight=g[f"{x}.k_norm.weight"], k_norm_bias=g[f"{x}.k_norm.bias"],
                                     weights_proj=g[f"{x}.weights_proj.weight"])
        attn = AttentionWeights.of(
            attn_norm=g[f"{p}.input_layernorm.weight"],
            q_a=g.get(f"{a}.q_a_proj.weight"), q_a_norm=g.get(f"{a}.q_a_layernorm.weight"),
            q_b=g[f"{a}.q_b_proj.weight"] if s.q_lora_rank else g[f"{a}.q_proj.weight"],
            kv_a=g[f"{a}.kv_a_proj_with_mqa.weight"], kv_a_norm=g[f"{a}.kv_a_layernorm.weight"],
            w_uk=w_uk, w_uv=w_uv, o=g[f"{a}.o_proj.weight"], indexer=indexer)
        layer = DecoderLayerWeights(attn)
        if mkind == MLPLayer.dense:
            layer.mlp_norm, layer.mlp = g[f"{p}.post_attention_layernorm.weight"], _dense(g, f"{p}.mlp")
        elif mkind == MLPLayer.moe:
            layer.mlp_norm = g[f"{p}.post_attention_layernorm.weight"]
            layer.mlp = moe_weights(
                gate=g[f"{p}.mlp.gate.weight"], bias=g.get(f"{p}.mlp.gate.e_score_correction_bias"),
                gate_up=stacks[f"{p}.gate_up"], down=stacks[f"{p}.down"],
                shared=_dense(g, f"{p}.mlp.shared_experts") if s.n_shared_experts else None,
                n_local=len(mine), first_expert=mine.start)
        layers.append(layer)
    embed = g["model.embed_tokens.weight"]
    lm_head = embed if s.tie_word_embeddings else g["lm_head.weight"]
    return ModelWeights(embed, layers, g["model.norm.weight"], lm_head, vocab_start=vocab_start)


def _dense(g: dict[str, Weight], prefix: str) -> DenseMLPWeights:
    gate_up = cat_rows([g.pop(f"{prefix}.gate_proj.weight"), g.pop(f"{prefix}.up_proj.weight")])
    return DenseMLPWeights(gate_up=gate_up, down=g[f"{prefix}.down_proj.weight"])
