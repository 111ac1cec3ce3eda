"""Launchers of the block-fp8 MoE expert kernels (:mod:`backends.kernels.gemm.fp8_moe_kernels`): DeepSeek-V3's fp8
experts computed from their storage format (e4m3 weights, one float32 scale per 128 x 128 block), without a bf16
copy of the weights.

* :func:`fp8_moe_experts`: decode at few tokens (T <= 16), the routed experts' weighted sum plus the shared
  experts in two kernels, with :func:`backends.kernels.gemm.skinny.moe_experts`'s semantics and rounding.
* :func:`fp8_grouped_expert_mlp`: prefill, ``runtime.model.deepseek.moe.grouped_expert_mlp``'s contract (rows
  grouped by expert, inclusive int32 offsets, an ``act`` callable), as W8A8 grouped GEMMs with per-token, 128-column
  activation scales (:func:`quantize_rows_fp8`), or W8A16 ones on the 16-bit rows (``model.fp8_compute=w8a16``);
  with ``tokens`` (the dispatch's) the first GEMM reads each grouped row from x itself (no gathered copy).

Layout (DeepSeek-V3's checkpoints, experts stacked): gate_up [E, 2 I, D] e4m3 (gate rows, then up rows) with
scales [E, 2 I / 128, cdiv(D, 128)]; down [E, D, I] e4m3 with scales [E, cdiv(D, 128), I / 128]; the shared
experts [2 I_s, D] / [D, I_s] with 2-D scales. I and I_s must be multiples of 128 (true of every DeepSeek-V3
width and of its TP / EP slices): the gate/up boundary is then a scale-block boundary.

CUDA-graph safe (outputs from ``torch.empty``, grids from shapes, no host sync). fp8 e4m3 in Triton needs an
sm89+ GPU (Ada, Hopper, Blackwell) or Triton's CPU interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from backends.kernels.checks import interpreted, require
from backends.kernels.gemm import fp8_moe_kernels as k
from backends.kernels.gemm.fp8_gemm_configs import tma_serves
from backends.kernels.pdl import use_pdl

#: the most tokens :func:`fp8_moe_experts` takes (one 16-row tensor-core tile per pair)
MAX_TOKENS = 16
#: rows / columns of one scale block
BLOCK = 128
FP8 = torch.float8_e4m3fn
DOT_DTYPES = (torch.bfloat16, torch.float16)


def _shape(t: torch.Tensor | None) -> object:
    return None if t is None else (tuple(t.shape), str(t.dtype).removeprefix("torch."))


def check_few_tokens(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, grouped: str,
                     most: int = MAX_TOKENS) -> tuple[int, int, int]:
    """The few-token expert kernels' routing inputs: x [T <= most, D] 16-bit with a contiguous last dim, ids
    [T, k] int64 and weights [T, k] float32, contiguous (``grouped``: the launcher to use for more tokens).
    Returns (T, D, k)."""
    t, d = x.shape
    top_k = ids.shape[1]
    require(t <= most and x.dtype in DOT_DTYPES and x.stride(-1) == 1,
            lambda: f"x [T <= {most}, D] bfloat16 / float16, last dim contiguous; got {_shape(x)}, strides "
                    f"{x.stride()}. Fix: more tokens take {grouped}")
    require(ids.shape == (t, top_k) and ids.dtype == torch.int64 and ids.is_contiguous()
            and weights.shape == (t, top_k) and weights.dtype == torch.float32 and weights.is_contiguous(),
            lambda: f"ids [T, k] int64 and weights [T, k] float32, contiguous, T = {t}; got ids {_shape(ids)}, weights "
                    f"{_shape(weights)}. Fix: .contiguous(), weights.float()")
    return t, d, top_k


def _check_fp8(name: str, w: torch.Tensor, scale: torch.Tensor, lead: tuple[int, ...], rows: int,
               cols: int) -> None:
    """w [*lead, rows, cols] e4m3 contiguous, scale [*lead, cdiv(rows, 128), cdiv(cols, 128)] float32 with
    contiguous last dim."""
    want = (*lead, triton.cdiv(rows, BLOCK), triton.cdiv(cols, BLOCK))
    require(tuple(w.shape) == (*lead, rows, cols) and w.dtype == FP8 and w.is_contiguous(),
            lambda: f"{name} {list((*lead, rows, cols))} float8_e4m3fn, contiguous; got {_shape(w)}, contiguous "
                    f"{w.is_contiguous()}. Fix: pass the checkpoint's e4m3 tensor (.contiguous())")
    require(tuple(scale.shape) == want and scale.dtype == torch.float32 and scale.stride(-1) == 1,
            lambda: f"{name}_scale {list(want)} float32 (one scale per 128 x 128 block), last dim contiguous; got "
                    f"{_shape(scale)}. Fix: pass the checkpoint's float32 weight_scale_inv (ue8m0 scales: .float() "
                    f"them)")


def _check_inter(name: str, inter: int) -> None:
    require(inter % BLOCK == 0 and inter > 0,
            lambda: f"{name} intermediate width a positive multiple of {BLOCK} (the gate/up boundary and the down "
                    f"projection's reduction blocks on scale-block boundaries; every DeepSeek-V3 width and TP/EP slice "
                    f"is); got {inter}. Fix: dequantize odd-width experts to bf16 and use skinny.moe_experts")


@dataclass(frozen=True)
class Fp8ExpertConfig:
    """:func:`fp8_moe_experts` launches: gate/up rows per program and 128-wide blocks per loop step of the first
    kernel, output columns per program of the second, warps and pipeline stages of both.

    Defaults chosen from skinny's bf16 measurements (``skinny.ExpertConfig``: 32-row up blocks over 256 bf16
    columns, 64-column down blocks, 4 stages) with the same bytes per step: an fp8 row is half a bf16 row, so
    the up kernel reads 2 x 128 fp8 columns per step. ``fma``: the CUDA-core kernels (float32 products; a pair
    is one token), whose down kernel reads ``down_sub_i`` 128-wide blocks of the intermediate dim per step (the
    tensor-core one reads one). The defaults of :func:`fp8_moe_experts` come from :func:`expert_config`, swept on
    an H200 (``python -m bench.fp8_moe_bench --no-libs --tokens 1 --sweep``); not swept on an H100."""

    up_block_i: int = 32
    up_sub_k: int = 2
    down_block_d: int = 64
    num_warps: int = 4
    num_stages: int = 4
    fma: bool = False
    down_sub_i: int = 1
    down_unroll: bool = True  # fma: the down kernel unrolls its slots where one chunk holds the intermediate dim


def expert_config(inter: int) -> Fp8ExpertConfig:
    """The default launch: the CUDA-core kernels (every pair is one token). Measured at one token on an H200
    (``python -m bench.fp8_moe_bench --no-libs --tokens 1 --sweep``, 21 configs): the TP8 slice (I 256) best at 16
    gate/up rows x 512 inputs and 32 down rows x 256, 8 warps (31.5 us; the tensor-core kernels 75.5, bf16 36.0);
    the EP slice (I 2048) at 8 x 512 and 16 x 512, 4 warps (97.5 us; tensor cores 336.2, bf16 166.5)."""
    if inter <= 512:
        return Fp8ExpertConfig(16, 4, 32, 8, 3, True, 2)
    return Fp8ExpertConfig(8, 4, 16, 4, 3, True, 4)


def fp8_moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    gate_up_scale: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                    shared_gate_up: torch.Tensor | None = None, shared_gate_up_scale: torch.Tensor | None = None,
                    shared_down: torch.Tensor | None = None, shared_down_scale: torch.Tensor | None = None,
                    pdl: bool = False, config: Fp8ExpertConfig | None = None) -> torch.Tensor:
    """The routed experts' weighted sum plus the shared experts for few tokens, from fp8 block-scaled weights.

    Every (token, slot) pair streams its expert's fp8 rows once, widened in registers; no sort, no grouped GEMM,
    no combine pass. Semantics and rounding as :func:`backends.kernels.gemm.skinny.moe_experts` on the dequantized
    weights (each GEMM output, SiLU, the product, the float32 weighted sum in slot order, the shared add).

    Parameters
    ----------
    x : torch.Tensor
        [T, D] bfloat16 or float16, T <= 16, last dim contiguous.
    ids : torch.Tensor
        [T, k] int64 local expert ids, contiguous; ``E`` (= gate_up.shape[0]) marks other ranks' experts, which
        add 0.
    weights : torch.Tensor
        [T, k] float32 routing weights, contiguous.
    gate_up, gate_up_scale : torch.Tensor
        [E, 2 I, D] float8_e4m3fn (gate rows, then up rows), [E, 2 I / 128, cdiv(D, 128)] float32.
    down, down_scale : torch.Tensor
        [E, D, I] float8_e4m3fn, [E, cdiv(D, 128), I / 128] float32.
    shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale : torch.Tensor or None
        The shared experts [2 I_s, D] / [2 I_s / 128, cdiv(D, 128)] and [D, I_s] / [cdiv(D, 128), I_s / 128],
        all four or none.
    pdl : bool
        Launch with programmatic dependent launch (Hopper+, compiled only).
    config : Fp8ExpertConfig, optional
        Tile sizes; default :func:`expert_config` of the wider intermediate width.

    Returns
    -------
    torch.Tensor
        [T, D] in x's dtype.
    """
    require(x.dim() == 2 and ids.dim() == 2 and weights.dim() == 2 and gate_up.dim() == 3,
            lambda: f"x [T, D], ids / weights [T, k], gate_up [E, 2 I, D]; got x {_shape(x)}, ids {_shape(ids)}, "
                    f"weights {_shape(weights)}, gate_up {_shape(gate_up)}")
    t, d, top_k = check_few_tokens(x, ids, weights, "fp8_grouped_expert_mlp")
    n_local, two_i = gate_up.shape[:2]
    inter = two_i // 2
    _check_inter("routed experts'", inter)
    _check_fp8("gate_up", gate_up, gate_up_scale, (n_local,), two_i, d)
    _check_fp8("down", down, down_scale, (n_local,), d, inter)
    shared = (shared_gate_up, shared_gate_up_scale, shared_down, shared_down_scale)
    has_shared = shared_gate_up is not None
    require(all((s is not None) == has_shared for s in shared),
            lambda: f"the shared experts' four tensors (gate_up, its scale, down, its scale) all given or all None; "
                    f"got {[_shape(s) for s in shared]}")
    s_inter = 0
    if has_shared:
        require(shared_gate_up.dim() == 2, lambda: f"shared_gate_up [2 I_s, D]; got {_shape(shared_gate_up)}")
        s_inter = shared_gate_up.shape[0] // 2
        _check_inter("shared experts'", s_inter)
        _check_fp8("shared_gate_up", shared_gate_up, shared_gate_up_scale, (), 2 * s_inter, d)
        _check_fp8("shared_down", shared_down, shared_down_scale, (), d, s_inter)
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if t == 0 or d == 0:
        return out
    c = config or expert_config(max(inter, s_inter))
    low = (4, 8) if c.fma else ()
    pow2 = (*low, 16, 32, 64, 128)
    require(c.up_block_i in pow2 and c.down_block_d in pow2 and c.up_sub_k in (1, 2, 4, 8)
            and c.down_sub_i in (1, 2, 4, 8),
            lambda: f"Fp8ExpertConfig up_block_i / down_block_d in {', '.join(map(str, pow2))} (dividing the 128-row "
                    f"scale block{'; 4 and 8 with fma' if not c.fma else ''}), up_sub_k / down_sub_i in 1, 2, 4, 8; "
                    f"got {c}")
    n_pairs = t * top_k
    h = torch.empty(n_pairs + (t if has_shared else 0), max(inter, s_inter), dtype=x.dtype, device=x.device)
    sgu, sgus, sdn, sdns = shared if has_shared else (gate_up, gate_up_scale, down, down_scale)
    up, down_k = ((k._fp8_moe_up_fma_kernel, k._fp8_moe_down_fma_kernel) if c.fma
                  else (k._fp8_moe_up_kernel, k._fp8_moe_down_kernel))
    one_chunk = c.down_unroll and c.down_sub_i * BLOCK >= max(inter, s_inter)
    down_extra = {"SUB_I": c.down_sub_i, "ONE_CHUNK": one_chunk} if c.fma else {}
    p = use_pdl(pdl, up, x.device)
    up[(h.shape[0], triton.cdiv(h.shape[1], c.up_block_i))](
        x, ids, gate_up, gate_up_scale, sgu, sgus, h, n_pairs, d, inter, s_inter, n_local, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0), gate_up_scale.stride(1), sgu.stride(-2),
        sgus.stride(-2), h.stride(0), TOPK=max(top_k, 1), BLOCK_I=c.up_block_i, SUB_K=c.up_sub_k, PDL=p,
        launch_pdl=p, num_warps=c.num_warps, num_stages=c.num_stages)
    down_k[(t, triton.cdiv(d, c.down_block_d))](
        h, ids, weights, down, down_scale, sdn, sdns, out, n_pairs, d, inter, s_inter, n_local, h.stride(0),
        down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1), sdn.stride(-2),
        sdns.stride(-2), out.stride(0), TOPK=top_k, TOPK_P2=triton.next_power_of_2(max(top_k, 1)),
        HAS_SHARED=has_shared, BLOCK_D=c.down_block_d, **down_extra, PDL=p, launch_pdl=p, num_warps=c.num_warps,
        num_stages=c.num_stages)
    return out


def quantize_rows_fp8(x: torch.Tensor, eps: float = 1e-10, limit: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, 128-column activation quantization (DeepSeek-V3's W8A8 activations).

    Parameters
    ----------
    x : torch.Tensor
        [M, K] bfloat16 / float16 / float32, last dim contiguous.
    eps : float
        Least amax (an all-zero group gets scale eps / 448, not 0).
    limit : torch.Tensor, optional
        A 1-element int32 / int64 tensor: quantize only the first ``limit`` rows (read on the device); the
        others of q and s are left unwritten.

    Returns
    -------
    (torch.Tensor, torch.Tensor)
        q [M, K] float8_e4m3fn = e4m3(x / s) and s [M, cdiv(K, 128)] float32 = max(amax of the group, eps) / 448,
        so that q * s is x up to e4m3 rounding.
    """
    require(x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (*DOT_DTYPES, torch.float32),
            lambda: f"x [M, K] bfloat16 / float16 / float32, last dim contiguous; got {_shape(x)}")
    require(limit is None or (limit.numel() == 1 and limit.dtype in (torch.int32, torch.int64)),
            lambda: f"limit a 1-element int32 / int64 tensor or None; got {_shape(limit)}")
    m, kd = x.shape
    q = torch.empty(m, kd, dtype=FP8, device=x.device)
    s = torch.empty(m, triton.cdiv(kd, BLOCK), dtype=torch.float32, device=x.device)
    if m and kd:
        block_m = 16
        k._quantize_groups_kernel[(triton.cdiv(m, block_m), s.shape[1])](
            x, q, s, limit if limit is not None else s, m, kd, x.stride(0), q.stride(0), s.stride(0), float(eps),
            BLOCK_M=block_m, HAS_LIMIT=limit is not None, ROUND_FIRST=interpreted(k._quantize_groups_kernel),
            num_warps=4)
    return q, s


@dataclass(frozen=True)
class GroupedConfig:
    """:func:`fp8_grouped_gemm` launch: rows per tile (``block_m``; default from the mean rows per expert),
    columns per tile, tile slots per swept column block (``group_m``), warps, stages, ``tma``: the weight tiles
    loaded by the tensor memory accelerator (None: up to :data:`TMA_ROWS` rows, by default every size, on a
    Hopper+ GPU where K is a multiple of 16). The k step is the 128-wide scale block. Defaults as sglang's
    block-fp8 fused MoE (64 x 128 x 128, 4 warps, 3 stages)."""

    block_m: int | None = None
    block_n: int = 128
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    tma: bool | None = None


#: (token, expert) rows up to which the grouped GEMM loads its weight tiles by TMA by default (None: every size).
#: On an H200 (``python -m bench.fp8_moe_bench``, CUDA graphs) TMA took moe=tp from 359.9 to 328.2 µs at 32
#: tokens (256 rows), 663.3 to 613.0 at 512 and 1563.5 to 1505.7 at 4096; in a 16-layer eager fp8 prefill
#: (``python -m bench.prefill_bench --kernels``) the GPU's kernel time with it was 15.9 / 23.6 / 40.3 / 73.2 ms at
#: 1024 / 2048 / 4096 / 8000 tokens against 17.2 / 23.6 / 40.7 / 73.7 without. (The prefill's wall time differs
#: by more, both ways: at up to 2048 tokens it waits on the host's launches, docs/kernels.md.)
TMA_ROWS: int | None = None


def grouped_config(rows: int, n_experts: int, k_dim: int) -> GroupedConfig:
    """Default tiles of a grouped GEMM over ``rows`` rows, ``n_experts`` experts and K = ``k_dim``: 256 columns and
    2 stages where each program has at most two 128-input steps over a 16-row tile (the TP8 slices' down GEMM, K
    256, at decode batches): its programs are short, so fewer, wider ones; else :class:`GroupedConfig`'s. Swept on
    an H200 (``python -m bench.fp8_moe_bench --cases tp --grouped-sweep``, 13 tiles): the down GEMM at 32 / 64 /
    128 / 512 tokens 98.5 / 127.2 / 143.8 / 191.0 -> 90.9 / 116.6 / 128.1 / 165.4 µs (71.5 -> 77.5% of copy at 32),
    the best of the 13 each time; at 4096 tokens (64-row tiles) the default stays (591.5 against 656.6); the gate_up
    GEMM's best is the default at 32 tokens (159.0 µs, 88.6% of copy)."""
    if grouped_block_m(rows, n_experts) == 16 and k_dim <= 2 * BLOCK:
        return GroupedConfig(block_n=256, num_stages=2)
    return GroupedConfig()


def grouped_block_m(rows: int, n_experts: int) -> int:
    """Rows per tile: the smallest of 16, 32, 64 that holds the mean rows per expert (64 from there up), so a
    decode-sized batch spread over many experts does not pad every expert's tile to 64 rows."""
    mean = rows / max(n_experts, 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def fp8_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
                     offsets: torch.Tensor, out_dtype: torch.dtype, config: GroupedConfig | None = None,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """Per expert e, out[rows of e] = (a * a_scale)[rows of e] @ (w[e] * w_scale[e]).T, float32 accumulation,
    rounded to ``out_dtype``: W8A8 (fp8 ``a`` with its scales), or W8A16 (16-bit ``a``, ``a_scale`` None).

    Parameters
    ----------
    a, a_scale : torch.Tensor
        W8A8: [rows, K] float8_e4m3fn grouped by expert (contiguous rows), [rows, cdiv(K, 128)] float32
        (:func:`quantize_rows_fp8`). W8A16: [rows, K] bfloat16 / float16 grouped by expert, and None.
        With ``rows``: [T, K] (and [T, cdiv(K, 128)]) per token, read through ``rows``.
    w, w_scale : torch.Tensor
        [E, N, K] float8_e4m3fn contiguous, [E, cdiv(N, 128), cdiv(K, 128)] float32.
    offsets : torch.Tensor
        [E] int32, inclusive cumulative rows per expert (read on the device; no host sync).
    out_dtype : torch.dtype
        bfloat16 / float16 / float32.
    config : GroupedConfig, optional
        Default: :func:`grouped_config`.
    rows : torch.Tensor, optional
        [R] int64, the token (row of ``a``) of each grouped row (``moe_dispatch``'s tokens): the kernel gathers
        them, so the grouped rows need no copy.

    Returns
    -------
    torch.Tensor
        [rows, N] of ``out_dtype`` (R rows with ``rows``); rows past ``offsets[-1]`` are left unwritten (as
        ``torch._grouped_mm``).
    """
    require(w.dim() == 3, lambda: f"w [E, N, K] float8_e4m3fn; got {_shape(w)}")
    n_experts, n, kd = w.shape
    require(rows is None or (rows.dim() == 1 and rows.dtype == torch.int64 and rows.is_contiguous()),
            lambda: f"rows [R] int64, contiguous (the token of each grouped row) or None; got {_shape(rows)}")
    tokens = a.shape[0] if a.dim() == 2 else -1
    a_fp8 = a_scale is not None
    kinds = "float8_e4m3fn (W8A8)" if a_fp8 else "bfloat16 / float16 (W8A16: a_scale None)"
    require(a.dim() == 2 and a.shape[1] == kd and a.dtype in ((FP8,) if a_fp8 else DOT_DTYPES)
            and a.stride(-1) == 1, lambda: f"a [rows, K = {kd}] {kinds}, last dim contiguous; got {_shape(a)}")
    require(not a_fp8 or (tuple(a_scale.shape) == (tokens, triton.cdiv(kd, BLOCK)) and a_scale.dtype ==
                          torch.float32 and a_scale.stride(-1) == 1),
            lambda: f"a_scale [{tokens}, {triton.cdiv(kd, BLOCK)}] float32; got {_shape(a_scale)}. Fix: "
                    f"quantize_rows_fp8(x)")
    rows_out = tokens if rows is None else rows.shape[0]
    _check_fp8("w", w, w_scale, (n_experts,), n, kd)
    require(tuple(offsets.shape) == (n_experts,) and offsets.dtype == torch.int32 and offsets.is_contiguous(),
            lambda: f"offsets [E = {n_experts}] int32 (inclusive cumulative rows per expert), contiguous; got "
                    f"{_shape(offsets)}. Fix: counts.cumsum(0).to(torch.int32)")
    require(out_dtype in (*DOT_DTYPES, torch.float32), lambda: f"out_dtype bfloat16 / float16 / float32; got "
                                                               f"{out_dtype}")
    out = torch.empty(rows_out, n, dtype=out_dtype, device=a.device)
    if rows_out == 0 or n == 0 or n_experts == 0:
        return out
    c = config or grouped_config(rows_out, n_experts, kd)
    bm = c.block_m or grouped_block_m(rows_out, n_experts)
    require(bm in (16, 32, 64, 128) and c.block_n in (16, 32, 64, 128, 256) and c.group_m >= 1,
            lambda: f"GroupedConfig block_m in 16, 32, 64, 128, block_n in 16 .. 256 (powers of two), group_m >= 1; "
                    f"got {c}")
    # the most row tiles any routing of these rows can take: sum over e of cdiv(n_e, bm) <= rows / bm + E
    max_tiles = min(triton.cdiv(rows_out, bm) + n_experts, rows_out)
    slots = triton.cdiv(max_tiles, c.group_m) * c.group_m
    grid = (slots * triton.cdiv(n, c.block_n),)
    scales = a_scale if a_fp8 else w_scale  # W8A16: a pointer the kernel never reads
    tma = ((TMA_ROWS is None or rows_out <= TMA_ROWS) and tma_serves(a.device, kd)) if c.tma is None else c.tma
    require(not tma or kd % 16 == 0, lambda: f"GroupedConfig.tma needs K a multiple of 16 (16-byte weight rows); got K "
                                             f"= {kd}. Fix: tma=None")
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        b_desc = TensorDescriptor(w.view(n_experts * n, kd), [n_experts * n, kd], [kd, 1], [c.block_n, BLOCK])
    k._fp8_grouped_gemm_kernel[grid](
        a, scales, w, b_desc if tma else w, w_scale, out, offsets, rows if rows is not None else offsets, n_experts,
        n, kd, a.stride(0),
        scales.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0),
        E_P2=triton.next_power_of_2(n_experts), BLOCK_M=bm, BLOCK_N=c.block_n, GROUP_M=c.group_m, A_FP8=a_fp8,
        GATHER=rows is not None, TMA=tma, num_warps=c.num_warps, num_stages=c.num_stages)
    return out


def fp8_grouped_expert_mlp(xs: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor,
                           down: torch.Tensor, down_scale: torch.Tensor, offsets: torch.Tensor,
                           act: Callable[[torch.Tensor], torch.Tensor],
                           config: GroupedConfig | None = None, w8a8: bool = True,
                           tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Every expert's gated MLP over its rows of ``xs`` from fp8 block-scaled weights: the contract of
    ``runtime.model.deepseek.moe.grouped_expert_mlp`` (prefill / many tokens), or with ``tokens`` over
    ``xs[tokens]`` without that copy: the gate_up GEMM reads each grouped row from its token's row, and W8A8
    quantizes each token once (T rows, not T * k; the same bits).

    ``w8a8``: xs is quantized per token and 128 columns (:func:`quantize_rows_fp8`), multiplied by gate_up in one
    W8A8 grouped GEMM (output rounded to xs's dtype), ``act`` maps [n, 2 I] to [n, I] (SiLU(gate) * up), whose
    output is quantized the same way and multiplied by down: four kernels plus ``act``'s. False (W8A16): the
    same two GEMMs on the 16-bit rows, the weights widened in registers (the dequantized model's precision), no
    quantize kernels. No host sync (CUDA-graph capturable: the expert of each row tile is found on the device).

    Parameters
    ----------
    xs : torch.Tensor
        [rows, D] bfloat16 / float16 / float32 grouped by expert, last dim contiguous; with ``tokens`` [T, D] per
        token.
    gate_up, gate_up_scale : torch.Tensor
        [E, 2 I, D] float8_e4m3fn, [E, 2 I / 128, cdiv(D, 128)] float32 (I a multiple of 128).
    down, down_scale : torch.Tensor
        [E, D, I] float8_e4m3fn, [E, cdiv(D, 128), I / 128] float32.
    offsets : torch.Tensor
        [E] int32, inclusive cumulative rows per expert.
    act : callable
        [n, 2 I] -> [n, I] in xs's dtype.
    config : GroupedConfig, optional
        Both GEMMs' tiles (default: each GEMM's :func:`grouped_config`).
    w8a8 : bool
        True: activations quantized to e4m3 per token and 128 inputs (DeepSeek's inference code); False: W8A16.
    tokens : torch.Tensor, optional
        [rows] int64, the token of each grouped row (``moe_dispatch``'s tokens), each in ``0 .. T - 1``.

    Returns
    -------
    torch.Tensor
        [rows, D] in xs's dtype; rows past ``offsets[-1]`` (other ranks' pairs) are left unwritten, as
        ``torch._grouped_mm`` leaves them: the caller masks them (``moe_combine``'s ``limit``).
    """
    require(gate_up.dim() == 3 and down.dim() == 3, lambda: f"gate_up [E, 2 I, D] and down [E, D, I]; got gate_up "
                                                            f"{_shape(gate_up)}, down {_shape(down)}")
    n_experts, two_i, d = gate_up.shape
    _check_inter("routed experts'", two_i // 2)
    _check_fp8("down", down, down_scale, (n_experts,), d, two_i // 2)
    last = offsets[-1:] if offsets.numel() else None  # rows past it (other ranks' pairs) are skipped
    if w8a8:  # per token: every row (a token with no local pair costs one quantized row); grouped: to the last
        q, s = quantize_rows_fp8(xs, limit=None if tokens is not None else last)
    else:
        q, s = xs, None
    h = fp8_grouped_gemm(q, s, gate_up, gate_up_scale, offsets, xs.dtype, config, rows=tokens)
    a = act(h)
    require(a.shape == (h.shape[0], two_i // 2), lambda: f"act(h [rows, 2 I]) -> [rows, I = {two_i // 2}]; got "
                                                         f"{tuple(a.shape)}")
    q, s = quantize_rows_fp8(a.contiguous(), limit=last) if w8a8 else (a.contiguous(), None)
    return fp8_grouped_gemm(q, s, down, down_scale, offsets, xs.dtype, config)
