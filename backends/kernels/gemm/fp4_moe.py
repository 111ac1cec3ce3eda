"""Launchers of the fp4 MoE expert kernels (:mod:`backends.kernels.gemm.fp4_moe_kernels`): DeepSeek-V4's routed
experts computed from their storage format (e2m1 packed two per byte, one power-of-two scale per row and 32 inputs:
``runtime.model.quantized.PackedFP4``), without a 16-bit copy of the weights. Scales are read as stored: ue8m0 bytes
(uint8 b, ``2 ** (b - 127)``, widened to float32 in registers) or float32 values, the same bits either way. Hopper
has no fp4 tensor-core product: the kernels widen the nibbles in registers and multiply on the CUDA cores in
float32 or on the tensor cores in bf16 / fp16 (W4A16).

* :func:`fp4_moe_experts`: decode at few tokens (T <= :func:`few_tokens_max`: 64 on the CUDA cores), the routed
  experts' weighted sum in two kernels (gate/up + activation, then down + routing weights), each pair's packed
  expert read once; by default the CUDA-core kernels that read 32-bit words (:mod:`.fp4_fma_kernels`,
  :func:`fma_config`), the tensor-core kernels on request (``Fp4ExpertConfig(fma=False)``, T <= 16; ``mx=True``:
  through Triton's microscaled product, :mod:`.fp4_mx_kernels`).
* :func:`fp4_grouped_expert_mlp`: prefill, ``runtime.model.deepseek.moe.grouped_expert_mlp``'s contract (rows
  grouped by expert, inclusive int32 offsets), two W4A16 grouped GEMMs, the activation fused into the first
  (``act=None``) or a callable as the contract has it; bf16 with 8+ rows per expert through Triton's microscaled
  product (:func:`grouped_config`).

The activation: ``limit=None`` is V3's silu(gate) * up, a float is V4's clamped SwiGLU
silu(min(gate, limit)) * clamp(up, -limit, limit) (``runtime.model.dsv4.moe.swiglu``).

Layout (experts stacked): gate_up [E, 2 I, D / 2] uint8 (gate rows, then up rows) with scales
[E, 2 I, cdiv(D, 32)]; down [E, D, I / 2] uint8 with scales [E, D, cdiv(I, 32)] (each scale tensor uint8 ue8m0 or
float32, on its own). D and I even (two inputs per
byte); any row count (each row has its own scales). A partial last scale group is read masked.

CUDA-graph safe (outputs from ``torch.empty``, grids from shapes, no host sync). Validated in Triton's CPU
interpreter and on an H200 (``pytest -m gpu tests/test_fp4_moe.py``, ue8m0 scales, every kernel set).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from backends.kernels.checks import require
from backends.kernels.gemm import fp4_fma_kernels as fk
from backends.kernels.gemm import fp4_moe_kernels as k
from backends.kernels.gemm import fp4_mx_kernels as mx
from backends.kernels.gemm.fp8_moe import check_few_tokens
from backends.kernels.pdl import use_pdl

#: the most tokens :func:`fp4_moe_experts`' tensor-core kernels take (one 16-row tile per pair)
MAX_TOKENS = 16
#: the most tokens its CUDA-core kernels take: up to here they beat the grouped GEMMs (``bench.fp4_moe_bench``)
FMA_MAX_TOKENS = 64
#: inputs per scale
GROUP = 32
#: the scale storages the kernels read: ue8m0 bytes (True: the kernels' ``*_UE8M0`` constexpr) or float32 values
SCALE_DTYPES = {torch.uint8: True, torch.float32: False}
DOT_DTYPES = (torch.bfloat16, torch.float16)


def _shape(t: torch.Tensor | None) -> object:
    return None if t is None else (tuple(t.shape), str(t.dtype).removeprefix("torch."))


def _act_code(limit: float | None, fused: bool = True) -> int:
    """The kernels' ACT constexpr: 0 none, 1 silu(gate) * up, 2 the clamped SwiGLU."""
    if not fused:
        return 0
    require(limit is None or float(limit) > 0, f"limit None (silu(gate) * up) or a positive float (V4's clamped "
            f"SwiGLU, model swiglu_limit); got {limit!r}")
    return 1 if limit is None else 2


def _check_fp4(name: str, w: torch.Tensor, scale: torch.Tensor, lead: tuple[int, ...], rows: int,
               cols: int) -> bool:
    """w [*lead, rows, cols / 2] uint8 contiguous, scale [*lead, rows, cdiv(cols, 32)] uint8 (ue8m0) or float32
    contiguous; returns whether the scales are ue8m0 bytes."""
    require(cols % 2 == 0 and cols > 0, f"{name}'s input width even and positive (two e2m1 values per byte); got "
            f"{cols}. Fix: dequantize the weight (model.weights=dequantize)")
    want_w, want_s = (*lead, rows, cols // 2), (*lead, rows, triton.cdiv(cols, GROUP))
    require(tuple(w.shape) == want_w and w.dtype == torch.uint8 and w.is_contiguous(),
            f"{name} {list(want_w)} uint8 (packed e2m1, low nibble first), contiguous; got {_shape(w)}, contiguous "
            f"{w.is_contiguous()}. Fix: pass PackedFP4.weight (.contiguous(); torch.float4_e2m1fn_x2 / int8 bytes: "
            f".view(torch.uint8))")
    require(tuple(scale.shape) == want_s and scale.dtype in SCALE_DTYPES and scale.is_contiguous(),
            f"{name}_scale {list(want_s)} uint8 (ue8m0 bytes) or float32 (one power-of-two scale per row and {GROUP} "
            f"inputs), contiguous; got {_shape(scale)}. Fix: pass PackedFP4.scale (float8_e8m0fnu: "
            f".view(torch.uint8); other floats: runtime.model.quantized.scale_values)")
    return SCALE_DTYPES[scale.dtype]


@dataclass(frozen=True)
class Fp4ExpertConfig:
    """:func:`fp4_moe_experts` launches: gate/up rows per program and inputs per loop step of the first kernel,
    output columns per program and hidden inputs per step of the second, warps and pipeline stages of both.

    The field defaults are the tensor-core kernels' tiles, chosen offline from the sm90 compile (``cuobjdump
    --dump-resource-usage``; Triton 3.9: 16 x 256 up and 32 x 256 down tiles spill nothing); the launcher's
    default is :func:`fma_config`."""

    up_block_i: int = 16
    up_block_k: int = 256
    down_block_d: int = 32
    down_block_i: int = 256
    num_warps: int = 4
    num_stages: int = 4
    #: the CUDA-core kernels (``fp4_fma_kernels``: 32-bit words, float32 products, a pair is one token; D and I
    #: multiples of 8) instead of the tensor-core ones
    fma: bool = False
    #: the tensor-core kernels through Triton's microscaled product (``fp4_mx_kernels``: ``tl.dot_scaled``, its own
    #: e2m1 widening; bf16 activations only) instead of ours; not with ``fma``
    mx: bool = False
    #: the second kernel's warps (None: ``num_warps``)
    down_warps: int | None = None


def few_tokens_max(d: int, inter: int) -> int:
    """The most tokens :func:`fp4_moe_experts` takes by default: :data:`FMA_MAX_TOKENS` where the CUDA-core
    kernels read whole words (D and I multiples of 8: every DeepSeek-V4 width), else the tensor-core kernels'
    :data:`MAX_TOKENS`."""
    return FMA_MAX_TOKENS if d % 8 == 0 and inter % 8 == 0 else MAX_TOKENS


def fma_config(inter: int, d: int = 4096) -> Fp4ExpertConfig:
    """:func:`fp4_moe_experts`' default launch: the CUDA-core kernels (5-8x faster than the tensor-core ones), tiles
    by the expert slice's intermediate width only, so a token's result does not depend on the batch beside it (the
    tiles set the float32 summation order); the tensor-core kernels where the widths are not whole words. Swept on
    an H200 (``python -m bench.fp4_moe_bench --tokens 1 4 16 32 64 --sweep``: 6 up tiles, then 7 down tiles;
    V4-Flash D 4096, top-6), each pick within 5% of the best at 1-64 tokens unless noted:

    * I <= 512 (tp8's 256): 4 gate / up rows x 1024 inputs per step on 4 warps (one token 21.9 us against 26.4
      for 512 inputs on 2 warps, which is 2-3% faster from 16 tokens), 8 output columns x 512 hidden inputs on 2
      warps (10% ahead of 1024 inputs on 4 warps from 16 tokens);
    * I <= 1024 (tp2): 4 x 512 on 2 warps, 8 x 512 on 2 warps (one token 42.5 us against 37.7 for the down kernel
      on 8 x 1024 x 4 warps, which is 2-3% slower from 16 tokens);
    * wider (ep8's whole 2048): 4 x 512 on 4 warps, 8 x 1024 on 4 warps."""
    if d % 8 or inter % 8:
        return Fp4ExpertConfig()
    if inter <= 512:
        return Fp4ExpertConfig(4, 1024, 8, 512, 4, 3, fma=True, down_warps=2)
    if inter <= 1024:
        return Fp4ExpertConfig(4, 512, 8, 512, 2, 3, fma=True)
    return Fp4ExpertConfig(4, 512, 8, 1024, 4, 3, fma=True)


def _block_k(want: int, k_dim: int) -> int:
    """A power of two >= 64 (two scale groups: the 16-wide half-tiles tl.dot needs) and no wider than needed."""
    return max(64, min(want, triton.next_power_of_2(k_dim)))


def fp4_moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                    limit: float | None = None, out_dtype: torch.dtype | None = None, pdl: bool = False,
                    config: Fp4ExpertConfig | None = None) -> torch.Tensor:
    """The routed experts' weighted sum for few tokens, from packed fp4 weights.

    Every (token, slot) pair streams its expert's packed rows once, widened in registers; no sort, no grouped GEMM,
    no combine pass. Rounding as the torch path (``runtime.model.deepseek.moe.routed_expert_sum`` on the
    dequantized weights): each GEMM output, SiLU and the product in x's dtype, the weighted sum in float32 in slot
    order.

    Parameters
    ----------
    x : torch.Tensor
        [T, D] bfloat16 or float16, last dim contiguous; T <= 64 on the CUDA cores, 16 on the tensor cores.
    ids : torch.Tensor
        [T, k] int64 local expert ids, contiguous; ``E`` (= gate_up.shape[0]) marks other ranks' experts, which
        add 0 (the CUDA-core kernels skip them; their rows of the intermediate are left unwritten).
    weights : torch.Tensor
        [T, k] float32 routing weights, contiguous.
    gate_up, gate_up_scale : torch.Tensor
        [E, 2 I, D / 2] uint8 (gate rows, then up rows), [E, 2 I, cdiv(D, 32)] uint8 (ue8m0) or float32.
    down, down_scale : torch.Tensor
        [E, D, I / 2] uint8, [E, D, cdiv(I, 32)] uint8 (ue8m0) or float32.
    limit : float or None
        None: silu(gate) * up (V3); a float: V4's clamped SwiGLU.
    out_dtype : torch.dtype, optional
        The output's dtype (default x's): float32 keeps the weighted sum unrounded (V4 adds the shared expert in
        float32).
    pdl : bool
        Launch with programmatic dependent launch (Hopper+, compiled only).
    config : Fp4ExpertConfig, optional
        Default :func:`fma_config`.

    Returns
    -------
    torch.Tensor
        [T, D] of ``out_dtype``.
    """
    require(x.dim() == 2 and ids.dim() == 2 and weights.dim() == 2 and gate_up.dim() == 3 and down.dim() == 3,
            f"x [T, D], ids / weights [T, k], gate_up [E, 2 I, D / 2], down [E, D, I / 2]; got x {_shape(x)}, ids "
            f"{_shape(ids)}, weights {_shape(weights)}, gate_up {_shape(gate_up)}, down {_shape(down)}")
    c = config or fma_config(gate_up.shape[1] // 2, x.shape[1])
    t, d, top_k = check_few_tokens(x, ids, weights, "fp4_grouped_expert_mlp", FMA_MAX_TOKENS if c.fma else MAX_TOKENS)
    n_local, two_i = gate_up.shape[:2]
    inter = two_i // 2
    require(two_i % 2 == 0 and inter > 0, f"gate_up [E, 2 I, D / 2] with 2 I even and positive (gate rows, then up "
            f"rows); got {_shape(gate_up)}")
    gu_ue8m0 = _check_fp4("gate_up", gate_up, gate_up_scale, (n_local,), two_i, d)
    dn_ue8m0 = _check_fp4("down", down, down_scale, (n_local,), d, inter)
    out_dtype = out_dtype or x.dtype
    require(out_dtype in (*DOT_DTYPES, torch.float32), f"out_dtype bfloat16 / float16 / float32; got {out_dtype}")
    act = _act_code(limit)
    out = torch.empty(t, d, dtype=out_dtype, device=x.device)
    if t == 0 or top_k == 0:
        return out.zero_()
    rows = (4, 8, 16, 32, 64, 128) if c.fma else (16, 32, 64, 128)
    wide = (64, 128, 256, 512, 1024)
    require(c.up_block_i in rows and c.down_block_d in rows and c.up_block_k in wide and c.down_block_i in wide
            and not (c.fma and c.mx), f"Fp4ExpertConfig up_block_i / down_block_d in {rows[0]} .. 128, up_block_k / "
            f"down_block_i in 64 .. 1024, powers of two, not both fma and mx; got {c}")
    require(not c.fma or (d % 8 == 0 and inter % 8 == 0), f"Fp4ExpertConfig(fma=True) reads whole 32-bit words: D "
            f"and I multiples of 8; got D {d}, I {inter}. Fix: Fp4ExpertConfig() (the tensor-core kernels)")
    require(not c.mx or x.dtype == torch.bfloat16, f"Fp4ExpertConfig(mx=True) takes bfloat16 activations (Triton's "
            f"microscaled product widens to bf16); got {x.dtype}. Fix: the default config")
    n_pairs = t * top_k
    h = torch.empty(n_pairs, inter, dtype=x.dtype, device=x.device)
    up_kernel, down_kernel = ((fk._fp4_moe_up_fma_kernel, fk._fp4_moe_down_fma_kernel) if c.fma
                              else (mx._fp4_moe_up_mx_kernel, mx._fp4_moe_down_mx_kernel) if c.mx
                              else (k._fp4_moe_up_kernel, k._fp4_moe_down_kernel))
    p = use_pdl(pdl, up_kernel, x.device)
    lim = float(limit or 0.0)
    up_kernel[(n_pairs, triton.cdiv(inter, c.up_block_i))](
        x, ids, gate_up, gate_up_scale, h, d, inter, n_local, lim, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), h.stride(0), TOPK=top_k,
        BLOCK_I=c.up_block_i, BLOCK_K=_block_k(c.up_block_k, d), ACT=act, PDL=p, GUS_UE8M0=gu_ue8m0,
        launch_pdl=p, num_warps=c.num_warps, num_stages=c.num_stages)
    down_kernel[(t, triton.cdiv(d, c.down_block_d))](
        h, ids, weights, down, down_scale, out, d, inter, n_local, h.stride(0), down.stride(0), down.stride(1),
        down_scale.stride(0), down_scale.stride(1), out.stride(0), TOPK=top_k,
        TOPK_P2=triton.next_power_of_2(top_k), BLOCK_D=c.down_block_d, BLOCK_I=_block_k(c.down_block_i, inter),
        PDL=p, DNS_UE8M0=dn_ue8m0, launch_pdl=p, num_warps=c.down_warps or c.num_warps, num_stages=c.num_stages)
    return out


@dataclass(frozen=True)
class GroupedConfig:
    """:func:`fp4_grouped_gemm` launch: rows per tile (``block_m``; default from the mean rows per expert), output
    columns per tile, inputs per k step, tile slots per swept column block (``group_m``), warps, stages. Not timed
    on a GPU; chosen offline from the sm90 compile: 64 x 128 tiles over 64 inputs with 8 warps spill nothing
    without the fused activation and 200 bytes with it (4 warps over 128 inputs: 1.5-2.9 KB of stack)."""

    block_m: int | None = None
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    #: the products through Triton's microscaled product (``fp4_moe_kernels._fp4_grouped_gemm_kernel``'s ``MX``; bf16 only;
    #: block_m up to 128)
    mx: bool = False


def grouped_block_m(rows: int, n_experts: int) -> int:
    """Rows per tile: 16 where the mean rows per expert fit, else 32. Not 64: Triton 3.6 fails to compile this
    kernel at 64 rows (``TritonGPUOptimizeDotOperands``, 4 and 8 warps, on an H200; 16 and 32 compile and give the
    same bits)."""
    return 16 if rows / max(n_experts, 1) <= 16 else 32


def grouped_config(rows: int, n_experts: int, dtype: torch.dtype) -> GroupedConfig:
    """:func:`fp4_grouped_gemm`'s default launch for ``rows`` activation rows over ``n_experts`` experts, by the
    mean rows per expert (other ranks' rows counted: no host sync). Measured on an H200 (``python -m
    bench.fp4_moe_bench --tokens 32 512 4096 --mx``, V4-Flash D 4096, top-6 of 256): bf16 from 8 rows per expert
    through Triton's microscaled product, activations as the left operand, 64-row tiles below 48 rows per expert
    (512 tokens: 2866 against 3002 us at tp2, 1005 / 1030 at tp8) and 128-row tiles above (4096 tokens: 4634
    against 11720 us at tp2, 2388 / 4185 at tp8, 2435 / 4136 at ep8); fewer rows (decode batches past the
    CUDA-core kernels' 64 tokens) and float16 on our W4A16 kernel. moe=ep's rows count other ranks' pairs: at 512
    tokens over 32 local experts that picks the 128-row tiles (1066 us against 948 for 64 rows, 990 ours)."""
    mean = rows / max(n_experts, 1)
    if dtype != torch.bfloat16 or mean < 8:
        return GroupedConfig()
    if mean < 48:
        return GroupedConfig(64, 128, 128, 8, 8, 3, mx=True)
    return GroupedConfig(128, 128, 128, 8, 8, 3, mx=True)


def fp4_grouped_gemm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, offsets: torch.Tensor,
                     fused_act: bool = False, limit: float | None = None, config: GroupedConfig | None = None
                     ) -> torch.Tensor:
    """Per expert e, out[rows of e] = a[rows of e] @ dequantized(w[e]).T (W4A16, float32 accumulation, rounded to
    a's dtype); with ``fused_act`` w[e]'s rows are gate, then up, and out = act(gate, up) (``limit``: see
    :func:`fp4_moe_experts`).

    Parameters
    ----------
    a : torch.Tensor
        [rows, K] bfloat16 / float16 grouped by expert (contiguous rows), last dim contiguous.
    w, w_scale : torch.Tensor
        [E, N, K / 2] uint8 packed e2m1, [E, N, cdiv(K, 32)] uint8 (ue8m0) or float32.
    offsets : torch.Tensor
        [E] int32, inclusive cumulative rows per expert (read on the device; no host sync).
    fused_act : bool
        Write act(gate, up) [rows, N / 2] instead of the product [rows, N].
    limit : float or None
    config : GroupedConfig, optional

    Returns
    -------
    torch.Tensor
        [rows, N] (or [rows, N / 2] with ``fused_act``) of a's dtype; rows past ``offsets[-1]`` are left unwritten
        (as ``torch._grouped_mm``).
    """
    require(w.dim() == 3, f"w [E, N, K / 2] uint8 (packed e2m1); got {_shape(w)}")
    n_experts, n, kb = w.shape
    kd = 2 * kb
    require(a.dim() == 2 and a.shape[1] == kd and a.dtype in DOT_DTYPES and a.stride(-1) == 1,
            f"a [rows, K = {kd}] bfloat16 / float16, last dim contiguous; got {_shape(a)}. Fix: a.to(torch.bfloat16)")
    rows = a.shape[0]
    ue8m0 = _check_fp4("w", w, w_scale, (n_experts,), n, kd)
    require(tuple(offsets.shape) == (n_experts,) and offsets.dtype == torch.int32 and offsets.is_contiguous(),
            f"offsets [E = {n_experts}] int32 (inclusive cumulative rows per expert), contiguous; got "
            f"{_shape(offsets)}. Fix: counts.cumsum(0).to(torch.int32)")
    require(not fused_act or n % 2 == 0, f"fused_act: w's rows gate, then up (an even count); got N = {n}")
    act = _act_code(limit, fused_act)
    n_out = n // 2 if fused_act else n
    out = torch.empty(rows, n_out, dtype=a.dtype, device=a.device)
    if rows == 0 or n_out == 0 or n_experts == 0:
        return out
    c = config or grouped_config(rows, n_experts, a.dtype)
    bm = c.block_m or grouped_block_m(rows, n_experts)
    bms = (16, 32, 64, 128) if c.mx else (16, 32)
    require(bm in bms and c.block_n in (16, 32, 64, 128) and c.block_k in (64, 128, 256)
            and c.group_m >= 1, f"GroupedConfig block_m in {bms} (64 does not compile with Triton 3.6 without mx), "
            f"block_n in 16, 32, 64, 128, block_k in 64, 128, 256, group_m >= 1; got {c}")
    require(not c.mx or a.dtype == torch.bfloat16, f"GroupedConfig(mx=True) takes bfloat16 activations (Triton's "
            f"microscaled product widens to bf16); got {a.dtype}. Fix: GroupedConfig(mx=False)")
    # the most row tiles any routing of these rows can take: sum over e of cdiv(n_e, bm) <= rows / bm + E
    max_tiles = min(triton.cdiv(rows, bm) + n_experts, rows)
    slots = triton.cdiv(max_tiles, c.group_m) * c.group_m
    k._fp4_grouped_gemm_kernel[(slots * triton.cdiv(n_out, c.block_n),)](
        a, w, w_scale, out, offsets, n_experts, n, kd, n_out, float(limit or 0.0), a.stride(0), w.stride(0),
        w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0), E_P2=triton.next_power_of_2(n_experts),
        BLOCK_M=bm, BLOCK_N=c.block_n, BLOCK_K=_block_k(c.block_k, kd), GROUP_M=c.group_m, ACT=act,
        BS_UE8M0=ue8m0, MX=c.mx, num_warps=c.num_warps, num_stages=c.num_stages)
    return out


def fp4_grouped_expert_mlp(xs: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                           down: torch.Tensor, down_scale: torch.Tensor, offsets: torch.Tensor,
                           act: Callable[[torch.Tensor], torch.Tensor] | None = None, limit: float | None = None,
                           config: GroupedConfig | None = None) -> torch.Tensor:
    """Every expert's gated MLP over its rows of ``xs`` from packed fp4 weights: the contract of
    ``runtime.model.deepseek.moe.grouped_expert_mlp`` (prefill / many tokens), two W4A16 grouped GEMMs, no host
    sync (CUDA-graph capturable: the expert of each row tile is found on the device).

    Parameters
    ----------
    xs : torch.Tensor
        [rows, D] bfloat16 / float16 grouped by expert, last dim contiguous.
    gate_up, gate_up_scale : torch.Tensor
        [E, 2 I, D / 2] uint8, [E, 2 I, cdiv(D, 32)] uint8 (ue8m0) or float32.
    down, down_scale : torch.Tensor
        [E, D, I / 2] uint8, [E, D, cdiv(I, 32)] uint8 (ue8m0) or float32.
    offsets : torch.Tensor
        [E] int32, inclusive cumulative rows per expert.
    act : callable, optional
        [n, 2 I] -> [n, I] in xs's dtype (the contract's form: the gate/up product is written, then ``act``);
        None: the activation fused into the first GEMM, chosen by ``limit``.
    limit : float or None
        With ``act=None``: None silu(gate) * up (V3), a float V4's clamped SwiGLU.
    config : GroupedConfig, optional
        Both GEMMs' tiles.

    Returns
    -------
    torch.Tensor
        [rows, D] in xs's dtype; rows past ``offsets[-1]`` (other ranks' pairs) are left unwritten: the caller
        masks them.
    """
    require(gate_up.dim() == 3 and down.dim() == 3, f"gate_up [E, 2 I, D / 2] and down [E, D, I / 2]; got gate_up "
            f"{_shape(gate_up)}, down {_shape(down)}")
    n_experts, two_i, half_d = gate_up.shape
    require(down.shape[1] == 2 * half_d, f"down's rows D = {2 * half_d} (gate_up [E, 2 I, D / 2] = "
            f"{_shape(gate_up)}); got down {_shape(down)}")
    _check_fp4("down", down, down_scale, (n_experts,), 2 * half_d, two_i // 2)
    if act is None:
        h = fp4_grouped_gemm(xs, gate_up, gate_up_scale, offsets, True, limit, config)
    else:
        h = act(fp4_grouped_gemm(xs, gate_up, gate_up_scale, offsets, config=config))
        require(h.shape == (xs.shape[0], two_i // 2) and h.dtype == xs.dtype,
                f"act(h [rows, 2 I]) -> [rows, I = {two_i // 2}] of xs's dtype; got {_shape(h)}")
    return fp4_grouped_gemm(h.contiguous(), down, down_scale, offsets, config=config)
