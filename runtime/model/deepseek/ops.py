"""The decoder layer's small ops in two implementations, chosen by ``model.fused`` and the device's capabilities.

* :class:`TorchOps`: the unfused torch ops (the reference: the CPU, and ``model.fused=off``).
* :class:`FusedOps`: one Triton kernel per op (:mod:`backends.kernels.decoder.decoder_ops`): residual add + RMSNorm
  (two outputs), RMSNorm, kv_a_layernorm + RoPE of the rope key + the paged KV-cache write together with RoPE of
  the query's rope dims in place and, at few rows, the absorbed query q_nope @ W_UK (one launch), SiLU * up, and
  for the MoE: V3 (sigmoid, noaux_tc) routing, the expert grouping (a stable counting sort with the grouped GEMM's
  offsets) and the weighted combine plus the shared experts.
  Where a kernel does not apply (an fp8 KV cache: the torch write counts clipped values; softmax routing; MoE
  without ``torch._grouped_mm``; mHC with float64 streams or an hc_mult that is not a power of two up to 16) the op
  takes the torch path for that case.
  Products of at most ``gemv_rows`` rows (``model.gemv_rows``: decode at small batch) take the few-row kernels of
  :mod:`backends.kernels.gemm.skinny` instead of cuBLAS: the linear layers (bf16 / fp16; the q LoRA's RMSNorm inside
  q_b_proj's kernel), the router (float32, no cast kernels) and the routed + shared experts in two kernels (no
  sort, no grouped GEMM, no combine pass).
  Block-fp8 weights (``model.weights=stored`` / ``fp8``) take the block-fp8 kernels:
  :mod:`backends.kernels.gemm.fp8_gemm` for the linear layers (few rows: fp8 widened in registers; many rows: W8A8 with
  1 x 128 activation scales) and :mod:`backends.kernels.gemm.fp8_moe` for the experts (few tokens: two kernels as above;
  many: a grouped fp8 GEMM; at 33-128 tokens the shared expert stacked after the routed ones, ``MoEWeights.stacked``,
  is one more group of it). V4's mHC around each block (:mod:`backends.kernels.dsv4.hc_mix`): everything after the
  mixing linear in one kernel (sigmoids, softmax, Sinkhorn rounds, the collapse), the expansion in another.
  With ``model.pdl`` (default on) the fused kernels launch with programmatic dependent launch
  on Hopper and newer GPUs (:mod:`backends.kernels.pdl`): each one starts while the kernel before it ends.
  V4's compressor decode step (state update, window softmax mix, RMSNorm, the entry's RoPE) is one kernel,
  :mod:`backends.kernels.dsv4.compress_decode` (float64 states stay torch).
  V4's RoPE tail (cos / sin of the positions, the rotation of the last rope channels, or its inverse) is one
  kernel, :mod:`backends.kernels.dsv4.rope_tail` (float64 and other layouts stay torch). V4's MoE: the routing
  after the router's product (scores, bias, top-k or the hash table's rows, renormalised and scaled) in one kernel
  (``v4_route``), the shared expert's clamped SwiGLU in another (``v4_swiglu``).

Both share one interface (the methods below, same shapes and dtypes); :func:`select_ops` picks the class from
``model.fused`` (``auto|on|off``) and the classes' :class:`OpsCapabilities`, never from a type check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from runtime.core.config import Fp8Compute
from runtime.core.device import DeviceInfo
from runtime.core.dsv4_pools import CompressorStatePool
from runtime.core.kv_pool import MLAKVPool
from runtime.core.model_spec import ModelSpec
from runtime.core.workspace import WorkspaceSpec
from runtime.model.deepseek.mlp import swiglu
from runtime.model.deepseek.moe import grouped_expert_mlp, local_expert_ids, route
from runtime.model.deepseek.moe import moe as torch_moe
from runtime.model.deepseek.rope import RopeParams, apply_rope, apply_rope_tail, cos_sin, inv_freq_on
from runtime.model.deepseek.weights import DenseMLPWeights, MoEWeights
from runtime.model.dsv4 import routing as v4_routing
from runtime.model.dsv4.compressor import compress_decode_rope
from runtime.model.dsv4.norms import rms_norm as v4_weighted_norm
from runtime.model.dsv4.norms import unweighted_rms_norm
from runtime.model.layers import rms_norm
from runtime.model.mhc import hc_mix, hc_post
from runtime.model.quantized import BlockFP8, linear

#: the most rows the few-row kernels take (``backends.kernels.gemm.skinny.MAX_ROWS``: one 16-row tensor-core tile)
GEMV_MAX_ROWS = 16
#: the fused ops' split-K counters (int32, zero; each launch leaves them zero): the block-fp8 products sum their
#: partials in each column tile's last program (``fp8_gemm.fp8_linear``'s ``counters``), 4096 tiles at most
GEMM_COUNTERS = WorkspaceSpec("gemm_counters", 4 * 4096, zero_init=True)


@dataclass(frozen=True)
class OpsCapabilities:
    """Where an ops implementation runs: device kinds, the least CUDA compute capability, model dtypes."""

    devices: tuple[str, ...]
    min_compute_capability: tuple[int, int] | None
    dtypes: tuple[torch.dtype, ...]

    def problems(self, device: DeviceInfo, dtype: torch.dtype) -> list[str]:
        """Why this implementation cannot run on ``device`` with ``dtype`` (empty: it can)."""
        out = []
        if device.kind not in self.devices:
            out.append(f"a device in {list(self.devices)} (got {device.kind})")
        elif device.kind == "cuda" and self.min_compute_capability is not None and device.compute_capability \
                is not None and device.compute_capability < self.min_compute_capability:
            cc, need = device.compute_capability, self.min_compute_capability
            out.append(f"compute capability >= {need[0]}.{need[1]} (got {cc[0]}.{cc[1]} on {device.name})")
        if dtype not in self.dtypes:
            out.append(f"model.dtype in {[str(d).removeprefix('torch.') for d in self.dtypes]} (got "
                       f"{str(dtype).removeprefix('torch.')})")
        return out


def torch_latent(spec: ModelSpec, kv_pool: MLAKVPool, layer_id: int, slots: torch.Tensor, kv: torch.Tensor,
                 weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv [T, kv_lora + rope] (kv_a_proj_with_mqa output) -> (ckv [T, kv_lora] normed, kpe [T, rope] rotated),
    both written to the pool at ``slots`` [T] (the pool quantizes where its dtype asks)."""
    c = spec.kv_lora_rank
    ckv = rms_norm(kv[:, :c], weight, spec.rms_norm_eps)
    kpe = apply_rope(spec, kv[:, c:], cos, sin)
    kv_pool.write(layer_id, slots, ckv, kpe)
    return ckv, kpe


class TorchOps:
    """The unfused torch ops (the reference path)."""

    name: ClassVar[str] = "torch"
    capabilities: ClassVar[OpsCapabilities] = OpsCapabilities(
        ("cpu", "cuda"), None, (torch.float32, torch.float64, torch.bfloat16, torch.float16))
    fp8_compute: ClassVar[str] = "w8a16"  # stored fp8: dequantized per weight, then the product in the model dtype

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta) * weight); delta None: (x, RMSNorm(x) * weight). [T, D] each."""
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, eps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def v4_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """V4's RMSNorm over the last dim (``runtime.model.dsv4.norms``: the weight before the cast; None: the
        unweighted norm) of ``x.to(out_dtype)`` (default x's dtype)."""
        x = x if out_dtype is None else x.to(out_dtype)
        return unweighted_rms_norm(x, eps) if weight is None else v4_weighted_norm(x, weight, eps)

    def rope_tail(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeParams, rope_dim: int,
                  inverse: bool = False) -> torch.Tensor:
        """V4: x [T, ..., D] with its last ``rope_dim`` channels rotated in interleaved pairs at positions [T]
        (``rope``'s frequencies, cos / sin times its attention factor; ``inverse``: undone, ``-sin``), a new tensor
        in x's dtype: :func:`~runtime.model.deepseek.rope.cos_sin` then
        :func:`~runtime.model.deepseek.rope.apply_rope_tail`."""
        cos, sin = cos_sin(rope, rope_dim, positions, x.dtype)
        return apply_rope_tail(x, cos, -sin if inverse else sin)

    def linear(self, x: torch.Tensor, w: torch.Tensor | BlockFP8) -> torch.Tensor:
        """x [T, K] @ w [N, K].T -> [T, N] (a block-fp8 w dequantized to x's dtype first)."""
        return linear(x, w)

    def head_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per head: x [T, H, K] @ w [H, K, N] -> [T, H, N] (the absorbed MLA's ``q_nope @ w_uk``, ``o_lat @ w_uv``):
        one batched matmul over the heads, written in the [T, H, N] layout the next op reads."""
        y = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=x.dtype, device=x.device)
        torch.bmm(x.transpose(0, 1), w, out=y.transpose(0, 1))
        return y

    def norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor) -> torch.Tensor:
        """linear(RMSNorm(x) * norm_weight, w): the q LoRA's q_a_layernorm then q_b_proj. x [T, K] -> [T, N]."""
        return self.linear(self.rms_norm(x, norm_weight, eps), w)

    def rope_latent(self, spec: ModelSpec, q: torch.Tensor, kv_pool: MLAKVPool, layer_id: int, slots: torch.Tensor,
                    kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    w_uk: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The MLA's q and latent preparation. q [T, H, qk_head] -> q_nope [T, H, nope], q_pe [T, H, rope]
        rotated; kv [T, kv_lora + rope] (kv_a_proj_with_mqa output) -> ckv [T, kv_lora] normed, kpe [T, rope]
        rotated, both written to the pool at ``slots`` [T]; with w_uk [H, nope, kv_lora] also the absorbed query
        q_nope @ w_uk [T, H, kv_lora] (else None). Returns (q_nope, q_pe, ckv, kpe, q_abs)."""
        n = spec.qk_nope_head_dim
        q_nope = q[..., :n]
        return (q_nope, apply_rope(spec, q[..., n:], cos, sin),
                *torch_latent(spec, kv_pool, layer_id, slots, kv, weight, cos, sin),
                None if w_uk is None else self.head_linear(q_nope, w_uk))

    def silu_mul(self, h: torch.Tensor) -> torch.Tensor:
        """[N, 2I] (gate, up) -> silu(gate) * up [N, I]."""
        return swiglu(h)

    def dense_mlp(self, w: DenseMLPWeights, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> down(silu(gate x) * up x) [T, D]."""
        return self.linear(self.silu_mul(self.linear(x, w.gate_up)), w.down)

    def compress_decode(self, kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                        norm_weight: torch.Tensor, eps: float, state: CompressorStatePool, layer_id: int,
                        rows: torch.Tensor, positions: torch.Tensor, rope: RopeParams,
                        rope_dim: int) -> torch.Tensor:
        """V4: one compressor's decode step for the batch (kv, gate [B, width]; rows, positions [B] integer),
        updating ``state``; returns the candidate entries [B, dim] with RoPE
        (:func:`runtime.model.dsv4.compressor.compress_decode_rope`)."""
        return compress_decode_rope(kv, gate, position_bias, norm_weight, eps, state, layer_id, rows, positions,
                                    rope, rope_dim)

    def moe(self, spec: ModelSpec, w: MoEWeights, x: torch.Tensor, grouped_mm: bool) -> torch.Tensor:
        """x [T, D] -> routed + shared experts [T, D] in x's dtype."""
        return torch_moe(spec, w, x, grouped_mm)

    def v4_route(self, w: v4_routing.MoEWeights, x: torch.Tensor, input_ids: torch.Tensor | None,
                 cfg: v4_routing.DSV4Config) -> tuple[torch.Tensor, torch.Tensor]:
        """V4's router, x [T, hidden] -> (expert ids [T, k] int64, weights [T, k] in x's dtype): top-k of the
        bias-corrected scores, or the hash table's rows at ``input_ids`` [T] (:func:`runtime.model.dsv4.moe.route`)."""
        return v4_routing.route(w, x, input_ids, cfg)

    def v4_swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
        """V4's clamped SwiGLU: gate, up [T, I] -> silu(min(gate, limit)) * clamp(up, -limit, limit) [T, I]
        (:func:`runtime.model.dsv4.moe.swiglu`)."""
        return v4_routing.swiglu(gate, up, limit)

    def hc_mix(self, mixed: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor,
               iters: int, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """V4's mHC before a block, after its mixing linear: mixed [T, 2n + n * n], streams [T, n, hidden] ->
        (post [T, n], comb [T, n, n], collapsed [T, hidden]); see :func:`runtime.model.mhc.hc_mix`."""
        return hc_mix(mixed, base, scale, streams, iters, hc_eps)

    def hc_post(self, post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor,
                streams: torch.Tensor) -> torch.Tensor:
        """V4's mHC after a block: ``post * block_out + comb^T @ streams`` [T, n, hidden]; see
        :func:`runtime.model.mhc.hc_post`."""
        return hc_post(post, comb, block_out, streams)


#: the most rows (tokens) whose MoE takes the stacked shared expert as one more group of the block-fp8 grouped
#: GEMMs (from ``fp8_gemm.SPLIT_ROWS + 1``). On an H200, 16 layers of ``h100_triton_tp8`` fp8 (``python -m
#: bench.decode_roofline ... --weights fp8`` with and without ``model.shared_expert_fusion``): the decode step's
#: period 6444.1 -> 6120.4 µs at 64 and 7473.3 -> 7212.2 at 128, but 5247.0 -> 5331.6 at 32 (against the split
#: kernel), and prefill slower (``bench.prefill_bench``: 4 x 1024 36.07 -> 36.56 ms, 8 x 1000 64.49 -> 66.76: the
#: grouped W8A8 GEMM is behind FlashInfer's / cuBLAS's dense GEMMs at many rows)
SHARED_FUSION_MAX_ROWS = 128


class FusedOps:
    """The same ops as fused Triton kernels (CUDA); see the module docstring for the cases that stay torch."""

    name: ClassVar[str] = "fused"
    capabilities: ClassVar[OpsCapabilities] = OpsCapabilities(
        ("cuda",), (8, 0), (torch.float32, torch.bfloat16, torch.float16))

    def __init__(self, gemv_rows: int = GEMV_MAX_ROWS, pdl: bool = True, fp8_compute: str = "w8a8",
                 counters: torch.Tensor | None = None):
        # imports triton: only where the fused ops are built
        from backends.kernels.decoder import decoder_ops
        from backends.kernels.dsv4 import compress_decode
        from backends.kernels.dsv4 import hc_mix as hc_kernels
        from backends.kernels.dsv4 import rope_tail as rope_kernels
        from backends.kernels.gemm import fp8_gemm, fp8_moe, skinny

        if not 0 <= gemv_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"model.gemv_rows: got {gemv_rows}; expected 0 .. {GEMV_MAX_ROWS}. Fix: "
                             f"model.gemv_rows={GEMV_MAX_ROWS}")
        known = [c.value for c in Fp8Compute]
        if fp8_compute not in known:
            raise ValueError(f"model.fp8_compute: got {fp8_compute!r}; expected one of {known}. Fix: "
                             "model.fp8_compute=w8a8")
        self.k, self.s, self.gemv_rows, self.pdl = decoder_ops, skinny, gemv_rows, bool(pdl)
        # stored fp8 above the few-row path: e4m3 activations (w8a8), or 16-bit ones at every size (w8a16)
        self.fp8_compute = str(fp8_compute)
        self.w8a8 = fp8_compute == "w8a8"
        # the workspace GEMM_COUNTERS (uint8 from the ledger); None: split-K partials summed by a second kernel
        self.counters = None if counters is None else counters.view(torch.int32)
        self.f8, self.f8moe = fp8_gemm, fp8_moe
        self.hc, self.cd = hc_kernels, compress_decode
        self.torch = TorchOps()
        self.rt = rope_kernels  # V4's RoPE tail

    def _few_rows(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """x's rows and dtype take the few-row kernels, with weights of x's dtype and contiguous rows."""
        return (0 < x.shape[0] <= self.gemv_rows and x.dtype in self.s.DOT_DTYPES and x.stride(-1) == 1
                and all(w.dtype == x.dtype and w.is_contiguous() for w in weights))

    def linear(self, x, w):
        if isinstance(w, BlockFP8):  # stored fp8: the block-fp8 kernels (few rows, or W8A8) on 16-bit activations
            if x.dtype in self.f8.ACT_DTYPES:
                return self.f8.fp8_linear(x, w.weight, w.scale, w.block, pdl=self.pdl, w8a8=self.w8a8,
                                          counters=self.counters)
            return self.torch.linear(x, w)  # float32 (the reference run): dequantized, then the matmul
        return self.s.linear(x, w, pdl=self.pdl) if self._few_rows(x, w) else F.linear(x, w)

    def head_linear(self, x, w):
        if self._few_rows(x[:, 0], w):
            return self.s.head_linear(x, w, pdl=self.pdl)
        return self.torch.head_linear(x, w)

    def add_rms_norm(self, x, delta, weight, eps):
        return self.k.add_rms_norm(x, delta, weight, eps, self.pdl)

    def rms_norm(self, x, weight, eps):
        return self.k.rms_norm(x, weight, eps, self.pdl)

    def v4_rms_norm(self, x, weight, eps, out_dtype=None):
        dts = self.k.V4_NORM_DTYPES
        if x.dtype in dts and (out_dtype or x.dtype) in dts and 0 < x.shape[-1] <= self.k.V4_NORM_MAX:
            return self.k.v4_rms_norm(x, weight, eps, out_dtype, self.pdl)
        return self.torch.v4_rms_norm(x, weight, eps, out_dtype)  # float64 (the reference) or too wide

    def rope_tail(self, x, positions, rope, rope_dim, inverse=False):
        if self.rt.takes(x, positions, rope_dim):  # the frequencies made once: no host copy in a CUDA graph
            return self.rt.rope_tail(x, positions, inv_freq_on(rope, rope_dim, x.device, torch.float32),
                                     rope.attention_factor, inverse, pdl=self.pdl)
        return self.torch.rope_tail(x, positions, rope, rope_dim, inverse)  # float64 (the reference), layouts

    def norm_linear(self, x, norm_weight, eps, w):
        if isinstance(w, BlockFP8):  # stored fp8 at one or two rows: the norm inside the CUDA-core kernel
            if (0 < x.shape[0] <= self.f8.FMA_ROWS and x.dtype in self.f8.ACT_DTYPES and x.stride(-1) == 1
                    and norm_weight.dtype == x.dtype):
                return self.f8.fp8_norm_linear(x, norm_weight, eps, w.weight, w.scale, w.block, pdl=self.pdl,
                                               counters=self.counters)
        elif self._few_rows(x, w, norm_weight):
            return self.s.norm_linear(x, norm_weight, eps, w, pdl=self.pdl)
        return self.linear(self.rms_norm(x, norm_weight, eps), w)

    def rope_latent(self, spec, q, kv_pool, layer_id, slots, kv, weight, cos, sin, w_uk=None):
        n, c = spec.qk_nope_head_dim, spec.kv_lora_rank
        quantized = kv_pool.quantized  # an fp8 pool: the torch write quantizes and counts clipped values
        absorb = w_uk is not None and self._few_rows(q[:, 0], w_uk)  # else the batched matmul below
        q_abs = self.k.rope_latent(q, n, None if quantized else kv, weight, cos, sin, slots,
                                   None if quantized else kv_pool.flat(layer_id), spec.rms_norm_eps,
                                   spec.rope_interleave, self.pdl, w_uk if absorb else None)
        if w_uk is not None and not absorb:
            q_abs = self.torch.head_linear(q[..., :n], w_uk)
        ckv, kpe = torch_latent(spec, kv_pool, layer_id, slots, kv, weight, cos, sin) if quantized \
            else (kv[:, :c], kv[:, c:])
        return q[..., :n], q[..., n:], ckv, kpe, q_abs

    def silu_mul(self, h):
        return self.k.silu_mul(h, self.pdl)

    def dense_mlp(self, w, x):
        return self.linear(self.silu_mul(self.linear(x, w.gate_up)), w.down)

    def compress_decode(self, kv, gate, position_bias, norm_weight, eps, state, layer_id, rows, positions, rope,
                        rope_dim):
        if state.pending_kv.dtype not in self.cd.DTYPES or kv.dtype not in self.cd.DTYPES:  # float64: torch
            return self.torch.compress_decode(kv, gate, position_bias, norm_weight, eps, state, layer_id, rows,
                                              positions, rope, rope_dim)
        li, overlap = state.layer(layer_id), state.prev_kv is not None
        return self.cd.compress_decode(
            kv, gate, position_bias, norm_weight, eps, state.pending_kv[li], state.pending_gate[li],
            state.prev_kv[li] if overlap else None, state.prev_gate[li] if overlap else None, rows, positions,
            inv_freq_on(rope, rope_dim, positions.device, torch.float32), rope.attention_factor, pdl=self.pdl)

    def _route(self, spec, w, x, few: bool):
        """(weights [T, k] float32, ids [T, k]): V3's sigmoid routing in one kernel (the router's product in the
        few-row kernel at few rows), softmax routing in torch."""
        if spec.scoring_func != "sigmoid":
            return route(spec, w, x)
        if few:
            logits = self.s.linear_f32(x, w.gate, pdl=self.pdl)
        elif x.is_cuda and x.dtype in self.s.DOT_DTYPES and w.gate.dtype == x.dtype:  # 16-bit products are exact
            logits = torch.mm(x, w.gate.t(), out_dtype=torch.float32)  # in float32: its product, on tensor cores
        else:
            logits = F.linear(x.float(), w.gate.float())
        return self.k.route_sigmoid(logits, w.bias, spec.n_group, spec.topk_group, spec.num_experts_per_tok,
                                    spec.norm_topk_prob, spec.routed_scaling_factor, self.pdl)

    def moe(self, spec, w, x, grouped_mm):
        stored = isinstance(w.gate_up, BlockFP8)  # block-fp8 experts: the fp8 kernels, whatever grouped_mm says
        shared = (w.shared.gate_up, w.shared.down) if w.shared is not None else ()
        if stored and x.dtype not in self.s.DOT_DTYPES:  # float32 (the reference run): dequantized per expert
            return self.torch.moe(spec, w, x, grouped_mm)
        few = 0 < x.shape[0] <= self.gemv_rows if stored else self._few_rows(x, w.gate_up, w.down, *shared)
        if not (grouped_mm or few or stored):  # the per-expert loop (host sync) stays torch
            return self.torch.moe(spec, w, x, grouped_mm)
        weights, ids = self._route(spec, w, x, few)
        n_local = w.gate_up.shape[0]
        local, mine = local_expert_ids(w, ids)  # expert parallelism: other ranks' pairs in one last group
        if few and stored:
            sh = [t for m in shared for t in (m.weight, m.scale)] if shared else [None] * 4
            return self.f8moe.fp8_moe_experts(x, local.contiguous(), weights.contiguous(), w.gate_up.weight,
                                              w.gate_up.scale, w.down.weight, w.down.scale, *sh, pdl=self.pdl)
        if few:  # every (token, slot) pair streams its expert once; other ranks' experts (id n_local) add 0
            return self.s.moe_experts(x, local.contiguous(), weights.contiguous(), w.gate_up, w.down,
                                      *(shared or (None, None)), pdl=self.pdl, others=mine is not None)
        # block-fp8 experts at decode batches above the split kernel's rows (where the shared expert's own
        # products take the library's GEMM), no other ranks' pairs: the stacked shared expert is one more group
        fuse = stored and mine is None and self.f8.SPLIT_ROWS < x.shape[0] <= SHARED_FUSION_MAX_ROWS
        stack = w.stacked if fuse else None
        tokens, inv, offsets = self.k.moe_dispatch(local.contiguous(), n_local + (mine is not None),
                                                   shared=stack is not None)
        offsets = offsets[:n_local + (stack is not None)]
        gate_up, down = stack or (w.gate_up, w.down)
        if stored:  # the grouped rows read from x through tokens (no gathered copy)
            y = self.f8moe.fp8_grouped_expert_mlp(x, gate_up.weight, gate_up.scale, down.weight, down.scale,
                                                  offsets, self.silu_mul, w8a8=self.w8a8, tokens=tokens)
        else:
            y = grouped_expert_mlp(x[tokens], gate_up, down, offsets, self.silu_mul)
        if stack is not None:
            shared = y[inv.shape[0]:]
        else:
            shared = self.dense_mlp(w.shared, x) if w.shared is not None else None
        # rows past the last offset (other ranks' experts) are not computed: the combine reads them as zeros
        return self.k.moe_combine(y, inv, weights, shared, x.dtype, offsets[-1:] if mine is not None else None)

    def v4_route(self, w, x, input_ids, cfg):
        """The router's product (the few-row kernel at few rows: logits in x's dtype, as the reference), then one
        kernel for the rest; float64, more experts than the kernel holds, or no token ids on a hash layer: torch."""
        r, k = v4_routing.v4_router(cfg), self.k
        if x.dtype not in k.V4_MOE_DTYPES or w.gate.shape[0] > k.V4_ROUTE_MAX_E or (w.tid2eid is not None
                                                                                   and input_ids is None):
            return self.torch.v4_route(w, x, input_ids, cfg)
        weights, ids = k.v4_route(self.linear(x, w.gate), r.scoring.value, w.e_score_correction_bias, w.tid2eid,
                                  input_ids, r.top_k, r.norm_eps, r.routed_scaling_factor, self.pdl)
        return ids, weights

    def v4_swiglu(self, gate, up, limit):
        if gate.dtype in self.k.V4_MOE_DTYPES and up.dtype == gate.dtype and gate.dim() == 2 and up.shape == \
                gate.shape and gate.stride(-1) == 1 and up.stride(-1) == 1:
            return self.k.v4_swiglu(gate, up, limit, self.pdl)
        return self.torch.v4_swiglu(gate, up, limit)

    def _hc_kernel(self, streams: torch.Tensor) -> bool:
        """The streams' n (hc_mult) and dtype take the mHC kernels (else the torch path: float64, other n)."""
        return streams.shape[1] in self.hc.HC_MULTS and streams.dtype in self.hc.STREAM_DTYPES

    def hc_mix(self, mixed, base, scale, streams, iters, hc_eps):
        if self._hc_kernel(streams):
            return self.hc.hc_mix(mixed, base, scale, streams, iters, hc_eps, pdl=self.pdl)
        return self.torch.hc_mix(mixed, base, scale, streams, iters, hc_eps)

    def hc_post(self, post, comb, block_out, streams):
        if self._hc_kernel(streams) and block_out.dtype == streams.dtype:
            return self.hc.hc_post(post, comb, block_out, streams, pdl=self.pdl)
        return self.torch.hc_post(post, comb, block_out, streams)


#: ``model.fused`` -> the implementations it may pick, in order of preference.
_CANDIDATES = {"auto": (FusedOps, TorchOps), "on": (FusedOps,), "off": (TorchOps,)}


def ops_problems(mode: str, device: DeviceInfo, dtype: torch.dtype) -> list[str]:
    """Why ``model.fused=mode`` cannot run here (empty: it can): the reasons of its only candidate."""
    cands = _CANDIDATES[str(mode)]
    return cands[0].capabilities.problems(device, dtype) if len(cands) == 1 else []


def select_ops(mode: str, device: DeviceInfo, dtype: torch.dtype) -> str:
    """The name of the ops class ``model.fused=mode`` takes on ``device`` with ``dtype``: the first candidate
    whose capabilities allow it (validation refused a mode with none)."""
    for cls in _CANDIDATES[str(mode)]:
        if not cls.capabilities.problems(device, dtype):
            return cls.name
    raise ValueError(f"model.fused={mode}: got {device.kind} / {dtype}; expected "
                     f"{'; '.join(ops_problems(mode, device, dtype))}. Fix: model.fused=auto")


OPS = {cls.name: cls for cls in (TorchOps, FusedOps)}
