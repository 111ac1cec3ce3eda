"""Launchers of the few-row matrix-product kernels (:mod:`backends.kernels.gemm.skinny_kernels`): the linear layers
and the routed + shared experts of a decode step at small batch.

CUDA-graph safe (outputs from ``torch.empty``, grids from shapes, no host sync). The torch equivalents, which
the tests compare against: ``F.linear`` for :func:`linear` and :func:`linear_f32`, and
:func:`runtime.model.deepseek.moe.routed_expert_sum` plus the shared experts' MLP for :func:`moe_experts`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from backends.kernels.checks import require
from backends.kernels.gemm import skinny_kernels as k
from backends.kernels.pdl import use_pdl
from backends.kernels.sm_count import sm_count

#: the most rows :func:`linear` takes (one 16-row tensor-core tile)
MAX_ROWS = 16
DOT_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TileConfig:
    """A launch: output columns per program (``block_n``), reduction step (``block_k``), warps, pipeline stages.
    (TMA weight loads were measured on an H100 and dropped: no faster at any TP8 shape, qkv_a 17.8 against
    15.9 us; ``docs/kernels.md``.)"""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


#: SMs assumed off the GPU (an H100's), so the CPU tests see the configs an H100 gets
CPU_SM_COUNT = 132


def default_config(n: int, k_dim: int, device: torch.device) -> TileConfig:
    """64 weight rows x 256 per step when that still gives half the SMs a program, else 32 x 512; 4 stages in
    flight. From ``python -m bench.gemv_bench --sweep`` on an H100 at DeepSeek-V3's TP8 shapes, timed in CUDA graphs
    over more weight bytes than L2 holds: 32 x 512 read qkv_a (N 2112) in 15.9 us (4 stages) and q_b (N 3072) in
    7.7 us (3 stages), against 17.3 / 9.2 us with 16 x 512 and 4. Splitting the reduction over more programs
    (split-K with a fixed-order sum) was slower at every shape measured (qkv_a 18.1 us, o 18.2 against 14.4 us),
    so it is not offered."""
    if triton.cdiv(n, 64) * 2 >= sm_count(device, CPU_SM_COUNT):
        block_n, block_k = 64, 256
    else:
        block_n, block_k = 32, 512
    return TileConfig(block_n, min(block_k, triton.next_power_of_2(max(k_dim, 16))), 4, 4)


def linear(x: torch.Tensor, w: torch.Tensor, config: TileConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N] in x's dtype, float32 accumulation, M <= 16. bf16 / fp16 through one
    16-row tensor-core tile per program, float32 one program per row (no TF32)."""
    _check_linear(x, w, (*DOT_DTYPES, torch.float32))
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    if x.dtype == torch.float32 and y.numel():
        return _rows(x, w, y, config or default_config(w.shape[0], x.shape[1], x.device), pdl)
    return _dot(x, w, y, None, 0.0, config, pdl)


def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                config: TileConfig | None = None, pdl: bool = False) -> torch.Tensor:
    """``linear(rms_norm(x, norm_weight, eps), w)`` in one launch (the q LoRA's q_a_layernorm and q_b_proj at
    decode): each program norms the rows as the fused RMSNorm kernel rounds, then streams its weight rows. x [M, K]
    (rows may be strided), norm_weight [K], w [N, K], bf16 / fp16, M <= 16 -> [M, N]."""
    _check_linear(x, w, DOT_DTYPES)
    require(norm_weight.shape == (x.shape[1],) and norm_weight.dtype == x.dtype and norm_weight.is_contiguous(),
            lambda: f"norm_weight [K] of x's dtype, contiguous; got {tuple(norm_weight.shape)} {norm_weight.dtype}")
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    return _dot(x, w, y, norm_weight, eps, config, pdl)


def _check_linear(x: torch.Tensor, w: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    m, kd = x.shape
    n = w.shape[0]
    require(m <= MAX_ROWS and w.shape == (n, kd) and w.dtype == x.dtype and x.stride(-1) == 1
            and w.stride(-1) == 1 and x.dtype in dtypes,
            lambda: f"x [M <= {MAX_ROWS}, K] and w [N, K] of one dtype ({', '.join(str(d)[6:] for d in dtypes)}), last "
                    f"dims contiguous; got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")


def _dot(x, w, y, norm_weight, eps, config: TileConfig | None, pdl: bool) -> torch.Tensor:
    """The 16-row tensor-core kernel into y [M, N] (norm_weight None: no RMSNorm of x first)."""
    (m, kd), n = x.shape, w.shape[0]
    if m == 0 or n == 0:
        return y
    cfg = config or default_config(n, kd, x.device)
    p = use_pdl(pdl, k._linear_dot_kernel, x.device)
    norm = norm_weight is not None
    k._linear_dot_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, y, norm_weight if norm else w, m, n, kd, x.stride(0), w.stride(0), y.stride(0), float(eps),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NORM=norm, PDL=p, launch_pdl=p, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y


def head_linear(x: torch.Tensor, w: torch.Tensor, pdl: bool = False, block_n: int | None = None) -> torch.Tensor:
    """Per head, x [M, H, K] @ w [H, K, N] -> [M, H, N] in x's dtype, float32
    accumulation, M <= 16, bf16 / fp16: the absorbed MLA's ``q_nope @ w_uk`` and ``o_lat @ w_uv`` at decode, one
    launch over (column block, head) instead of a batched GEMM. Rows of x may be strided (q_nope is a view of q);
    the last dims of x and w are contiguous. ``block_n``: output columns per program (a power of two >= 16;
    default :func:`head_block_n`)."""
    m, h, kd = x.shape
    n = w.shape[2]
    require(m <= MAX_ROWS and w.shape == (h, kd, n) and w.dtype == x.dtype and x.dtype in DOT_DTYPES
            and x.stride(-1) == 1 and w.stride(-1) == 1,
            lambda: f"x [M <= {MAX_ROWS}, H, K] and w [H, K, N] of one dtype (bf16, fp16), last dims contiguous; got x "
                    f"{tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    out = torch.empty(m, h, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_n = block_n or head_block_n(n, h)
    block_k = min(128, triton.next_power_of_2(max(kd, 16)))
    p = use_pdl(pdl, k._head_dot_kernel, x.device)
    k._head_dot_kernel[(triton.cdiv(n, block_n), h)](
        x, w, out, m, n, kd, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=p, launch_pdl=p, num_warps=4, num_stages=3)
    return out


def head_block_n(n: int, heads: int) -> int:
    """Output columns per program of :func:`head_linear`: the widest of 64 and 32 that gives at least 64 programs,
    else 16. On an H100 at 16 heads (``python -m bench.gemv_bench``, graph-timed): q_nope @ w_uk (N 512) 3.94 us
    with 64 against 4.00 / 4.13 with 32 / 16; o_lat @ w_uv (N 128) 4.68 us with 32 against 4.81 / 4.94 with
    16 / 64 (cuBLAS's batched GEMM: 4.33 and 4.52 us; ours keeps the PDL chain of the fused kernels unbroken)."""
    return next((b for b in (64, 32) if triton.cdiv(n, b) * heads >= 64), 16)


def linear_f32(x: torch.Tensor, w: torch.Tensor, config: TileConfig | None = None,
               pdl: bool = False) -> torch.Tensor:
    """``F.linear(x.float(), w.float())`` for few rows (the MoE router: bf16 hidden states, float32 weights)
    without the cast kernels: x [M, K] any float dtype, w [N, K] -> [M, N] float32."""
    m, kd = x.shape
    n = w.shape[0]
    require(w.shape == (n, kd) and x.stride(-1) == 1 and w.stride(-1) == 1 and x.is_floating_point()
            and w.is_floating_point(), lambda: f"x [M, K] and w [N, K] floating point, last dims contiguous; got x "
                                               f"{tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}")
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    return _rows(x, w, y, config or TileConfig(2 if n <= 1024 else 16, 1024), pdl)


def _rows(x, w, y, cfg: TileConfig, pdl: bool) -> torch.Tensor:
    m, kd = x.shape
    n = w.shape[0]
    p = use_pdl(pdl, k._linear_rows_kernel, x.device)
    k._linear_rows_kernel[(triton.cdiv(n, cfg.block_n), m)](
        x, w, y, n, kd, x.stride(0), w.stride(0), y.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=p,
        launch_pdl=p, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


@dataclass(frozen=True)
class ExpertConfig:
    """:func:`moe_experts` launches: gate/up rows and reduction step per program of the first kernel, output
    columns and hidden step per program of the second. Defaults from an H100 at DeepSeek-V3's TP8 shapes (256 experts,
    intermediate 256, top-8 + one shared expert), timed in CUDA graphs over routings L2 does not hold
    (docs/performance.md): at one token both kernels took 42.3 us (78% of copy) with
    32-row up blocks and 4 stages, against 50.4 us with 16 rows and 3; the down kernel alone 15.3 us with 64 x 128
    tiles and 4 stages, against 16.3 us with 32 x 128 and 3 (17.9 us before its loop over experts was flattened)."""

    up_block_i: int = 32
    up_block_k: int = 256
    down_block_d: int = 64
    down_block_i: int = 128
    num_warps: int = 4
    num_stages: int = 4


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, shared_gate_up: torch.Tensor | None, shared_down: torch.Tensor | None,
                config: ExpertConfig | None = None, pdl: bool = False, others: bool = False) -> torch.Tensor:
    """The routed experts' weighted sum plus the shared experts, for few tokens, in two kernels (no sort, no
    grouped GEMM, no combine pass): every (token, slot) pair streams its expert's rows once.

    x [T, D]; ids [T, k] int64 local expert ids (``n_local = gate_up.shape[0]`` marks other ranks' experts, which
    add 0); weights [T, k] float32; gate_up [E, 2 I, D], down [E, D, I]; shared_gate_up [2 I_s, D] and
    shared_down [D, I_s] or both None -> [T, D] in x's dtype, rounded as the grouped-GEMM path with the combine
    kernel rounds (each GEMM output, SiLU, the product, the weighted sum, the shared add). ``others`` (expert
    parallelism: ids may carry n_local): the down kernel branches over other ranks' slots (faster there, slower
    where every expert is local); either way they add 0."""
    t, d = x.shape
    top_k = ids.shape[1] if ids.dim() == 2 else 0
    n_local, two_i, _ = gate_up.shape
    inter = two_i // 2
    has_shared = shared_gate_up is not None
    s_inter = shared_gate_up.shape[0] // 2 if has_shared else 0
    require(ids.shape == (t, top_k) and ids.is_contiguous() and weights.shape == (t, top_k)
            and weights.dtype == torch.float32 and weights.is_contiguous() and x.stride(-1) == 1
            and gate_up.shape[2] == d and down.shape == (n_local, d, inter) and gate_up.is_contiguous()
            and down.is_contiguous() and gate_up.dtype == x.dtype and down.dtype == x.dtype
            and (shared_down is None) == (not has_shared)
            and (not has_shared or (shared_gate_up.shape == (2 * s_inter, d) and shared_down.shape == (d, s_inter)
                                    and shared_gate_up.is_contiguous() and shared_down.is_contiguous())),
            lambda: f"x [T, D], ids / weights [T, k] (int64 / float32, contiguous), gate_up [E, 2 I, D], down [E, D, "
                    f"I], shared [2 I_s, D] / [D, I_s] or None, contiguous, of x's dtype; got x {tuple(x.shape)} "
                    f"{x.dtype}, ids {tuple(ids.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
                    f"shared {None if not has_shared else (tuple(shared_gate_up.shape), tuple(shared_down.shape))}")
    out = torch.empty(t, d, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    n_pairs = t * top_k
    h = torch.empty(n_pairs + (t if has_shared else 0), max(inter, s_inter), dtype=x.dtype, device=x.device)
    sgu = shared_gate_up if has_shared else gate_up
    sdn = shared_down if has_shared else down
    c = config or ExpertConfig()
    p = use_pdl(pdl, k._moe_up_kernel, x.device)
    k._moe_up_kernel[(h.shape[0], triton.cdiv(h.shape[1], c.up_block_i))](
        x, ids, gate_up, sgu, h, n_pairs, d, inter, s_inter, n_local, x.stride(0), gate_up.stride(0),
        gate_up.stride(1), sgu.stride(0), h.stride(0), TOPK=max(top_k, 1), BLOCK_I=c.up_block_i,
        BLOCK_K=c.up_block_k, DOT=x.dtype in DOT_DTYPES, PDL=p, launch_pdl=p, num_warps=c.num_warps,
        num_stages=c.num_stages)
    k._moe_down_kernel[(t, triton.cdiv(d, c.down_block_d))](
        h, ids, weights, down, sdn, out, n_pairs, d, inter, s_inter, n_local, h.stride(0), down.stride(0),
        down.stride(1), sdn.stride(0), out.stride(0), TOPK=top_k, TOPK_P2=triton.next_power_of_2(max(top_k, 1)),
        HAS_SHARED=has_shared,
        BLOCK_D=c.down_block_d, BLOCK_I=min(c.down_block_i, triton.next_power_of_2(max(inter, s_inter, 16))),
        DOT=x.dtype in DOT_DTYPES, SKIP=bool(others), PDL=p, launch_pdl=p, num_warps=c.num_warps,
        num_stages=c.num_stages)
    return out
