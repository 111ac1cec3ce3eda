"""The parity check: replay the candidate's tokens through the torch reference (float32 math) and compare.

The reference runs the same workload with the same scheduler, fed the candidate's tokens (so sequences
stay aligned even where a bf16 near-tie flips a greedy choice). It reports whether its own greedy choices
equal the candidate's tokens, how many differ only at near-ties, and the max relative error of the final
hidden states.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from runtime.core.model_spec import DSV4_MODEL_TYPE
from runtime.engine.engine import RunResult
from runtime.engine.hisparse import host_page_count

# Max relative error of final hidden states, and the logit margin under which a flipped choice is a tie,
# by the candidate model's dtype.
TOLERANCE = {"float64": 1e-6, "float32": 1e-4, "float16": 5e-2, "bfloat16": 5e-2}
TIE_MARGIN = {"float64": 1e-6, "float32": 1e-4, "float16": 5e-2, "bfloat16": 5e-2}
# A 16-bit model whose block-fp8 weights multiply e4m3-quantized activations above the few-row path (stored fp8,
# model.fp8_compute=w8a8, DeepSeek's own recipe: one scale per token and 128 inputs) carries that rounding too: one
# W8A8 product is 2.6e-2 off float64 against 1.7e-3 for W8A16 (bench.fp8_gemm_bench, H200). Measured on an H200
# (h100_triton_tp8, 4 layers, 64 chat requests, scripts/fp8_parity_device.sh): max / median request error
# 5.98e-2 / 4.48e-2 with W8A8 against 3.76e-2 / 2.10e-2 with W8A16 on the same weights (bf16 weights 3.04e-2).
# The W8A8 bound keeps the 16-bit tolerance's headroom over what a correct run measures (5e-2 over ~3e-2);
# a wrong scale block or expert is off by 0.3 and more.
TOLERANCE_W8A8 = {"float16": 1e-1, "bfloat16": 1e-1}
# A model that makes discrete choices inside its forward (MoE expert routing, the sparse indexer's top-k) turns a
# 16-bit rounding difference into a different expert or token set, and from there into a greedy flip that is not
# a near-tie of the final logits (measured on an H100 with the 4-layer DeepSeek-V3 preset in bf16: 1 such flip of
# 170 tokens against the float32 reference, with the hidden states still within tolerance). Such models may
# flip this fraction of their generated tokens beyond near-ties (at least ROUTING_FLIPS_MIN); the report counts
# them. Others, and every float32/float64 run, get none.
ROUTING_FLIP_FRACTION = 1 / 40
ROUTING_FLIPS_MIN = 4


@dataclass
class ParityReport:
    reference: str
    tokens_equal: bool
    mismatches: int
    near_tie_mismatches: int
    max_rel_err: float
    tolerance: float
    ok: bool
    activations: str  # "e4m3 above 16 rows (w8a8)" where the tolerance is TOLERANCE_W8A8, else the model dtype
    routing_flip_budget: int = 0  # flips beyond near-ties allowed (discrete routing in 16-bit; see above)
    # where the error is: the median request's relative error, the worst request and, in it, the position whose
    # hidden state differs most (one position far above the median: a discrete choice flipped there)
    median_rel_err: float = 0.0
    worst_request: int | None = None
    worst_position: int | None = None
    worst_position_rel_err: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def reference_config(plain: dict) -> dict:
    """The candidate's config with the float32 torch reference, no graphs, no dumps, and plain greedy
    decoding (speculation is lossless, so its tokens must equal plain greedy's).

    A DeepSeek-V4 model gets the ``dsv4`` backend in float32 (its torch implementation is the oracle). A model
    with sparse layers gets the same sparse model on the dsa backend's torch impl, without HiSparse (its
    KV all in the paged pool, as many pages as the candidate's host pool). Where contexts exceed top-k, the
    indexer's choice is discrete: rounding differences that move a score across the k-th one change which
    tokens are attended to. A float32 run then matches this reference to 1e-4; a bf16 run need not (measured on
    an H100, top-64 of up to 324 tokens, 182 generated, two weight seeds: the Triton kernels flipped 6 and 2 tokens
    beyond near-ties, max rel err 4.5e-2; this reference's own impl run in bf16 flipped 4 and 0, 4.8e-2)."""
    ref = copy.deepcopy(plain)
    if plain["model"].get("model_type") == DSV4_MODEL_TYPE:  # V4: the dsv4 backend's torch math in float32
        ref["backend"] = {"name": "dsv4", "compute_dtype": "float32", "impl": "torch", "kernel": "real",
                          "workspace_bytes": plain["backend"].get("workspace_bytes", 1)}
        ref["hisparse"]["enabled"] = False  # every CSA entry in the device pool (same token pages)
    elif "sparse" in [str(k) for k in plain["model"]["layer_pattern"]]:
        ref["backend"] = {"name": "dsa", "impl": "torch", "max_splits": 1, "indexer_prefill_mib": 0}
        if plain["hisparse"]["enabled"]:  # the reference keeps everything in its device pool: as many pages
            pages = plain["kv"]["num_pages"]  # (auto: its own memory plan sizes it)
            ref["kv"]["num_pages"] = pages if pages == "auto" else host_page_count(
                pages, plain["hisparse"]["host_to_device_ratio"])
            ref["hisparse"]["enabled"] = False
    else:
        ref["backend"] = {"name": "torch_mla", "compute_dtype": "float32"}
    ref["model"]["dtype"] = "float32"
    ref["graph"]["enabled"] = False
    ref["speculative"]["enabled"] = False
    ref["attention"]["linear_impl"] = "torch"
    ref["dump_dir"] = None
    return ref


def unquantized_config(plain: dict) -> dict:
    """The candidate's config with ``kv.dtype=auto`` (the cache in the model dtype), same backend and model:
    run fed the candidate's tokens, it shows what the fp8 cache alone changes."""
    ref = copy.deepcopy(plain)
    ref["kv"]["dtype"] = "auto"
    ref["graph"]["enabled"] = False
    ref["speculative"]["enabled"] = False
    ref["dump_dir"] = None
    return ref


def quantization_effect(candidate: RunResult, unquantized: RunResult, logits) -> dict:
    """Token agreement and logit error of an fp8-cache run against the same run with an unquantized cache
    (both fed the candidate's tokens). ``logits``: float32 host [N, hidden] -> [N, vocab] float32 (the model's
LM head, in the model dtype on its device).

    Returns greedy-choice agreement (fraction of generated positions where both runs pick the same token),
    the max relative error of the logits (norm over a request's positions) and the max absolute logit error."""
    same = total = 0
    max_rel = max_abs = 0.0
    for rid in candidate.outputs:
        a, b = candidate.argmax[rid], unquantized.argmax[rid]
        same += sum(x == y for x, y in zip(a, b))
        total += min(len(a), len(b))
        ha, hb = candidate.hidden[rid], unquantized.hidden[rid]
        if hb.numel():
            la, lb = logits(ha).double(), logits(hb).double()
            rel = (torch.linalg.vector_norm(la - lb) / torch.linalg.vector_norm(lb).clamp_min(1e-30)).item()
            max_rel = max(max_rel, rel if rel == rel else float("inf"))
            max_abs = max(max_abs, (la - lb).abs().max().item())
    return {"reference": "same config, kv.dtype=auto", "positions": total,
            "token_agreement": same / total if total else 1.0, "logit_max_rel_err": max_rel,
            "logit_max_abs_err": max_abs}


def routing_flip_budget(generated: int, dtype: str, discrete_routing: bool) -> int:
    """Greedy flips beyond near-ties allowed to a run of ``generated`` tokens: ``ROUTING_FLIP_FRACTION`` of them
    (at least ``ROUTING_FLIPS_MIN``) for a 16-bit model with discrete routing, else none."""
    if not discrete_routing or dtype not in ("float16", "bfloat16"):
        return 0
    return max(ROUTING_FLIPS_MIN, int(generated * ROUTING_FLIP_FRACTION))


def compare(candidate: RunResult, reference: RunResult, dtype: str,
            reference_name: str = "torch_mla/float32", discrete_routing: bool = False,
            w8a8: bool = False) -> ParityReport:
    """Parity of ``candidate`` against ``reference`` (which replayed the candidate's tokens).

    ``discrete_routing``: the model routes tokens to experts or selects KV with a top-k (see
    ``ROUTING_FLIP_FRACTION``); in a 16-bit dtype it may then flip a bounded number of tokens beyond near-ties.
    ``w8a8``: the candidate's block-fp8 products quantize their activations to e4m3 (``TOLERANCE_W8A8``)."""
    w8a8 = w8a8 and dtype in TOLERANCE_W8A8
    tol, tie = (TOLERANCE_W8A8 if w8a8 else TOLERANCE)[dtype], TIE_MARGIN[dtype]
    generated = sum(len(t) for t in candidate.outputs.values())
    budget = routing_flip_budget(generated, dtype, discrete_routing)
    mismatches = near_ties = 0
    rels: dict[int, float] = {}
    for rid in candidate.outputs:  # its own greedy choices: its tokens, unless the request sampled
        for pos, (tok, ref_tok) in enumerate(zip(candidate.argmax[rid], reference.argmax[rid])):
            if tok != ref_tok:
                mismatches += 1
                near_ties += reference.margins[rid][pos] <= tie
        a, b = candidate.hidden[rid], reference.hidden[rid]
        if b.numel():
            rel = (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()
            rels[rid] = rel if rel == rel else float("inf")  # NaN never passes
    max_rel = max(rels.values(), default=0.0)
    ok = mismatches - near_ties <= budget and max_rel <= tol and candidate.lost == 0
    report = ParityReport(reference_name, mismatches == 0, mismatches, near_ties, max_rel, tol, ok,
                          "e4m3 above 16 rows (w8a8)" if w8a8 else dtype, budget)
    if rels:
        worst = max(rels, key=rels.get)
        a, b = candidate.hidden[worst].double(), reference.hidden[worst].double()
        per_pos = torch.linalg.vector_norm(a - b, dim=-1) / torch.linalg.vector_norm(b, dim=-1).clamp_min(1e-30)
        per_pos = torch.nan_to_num(per_pos, nan=float("inf"))
        report.median_rel_err = float(torch.tensor(list(rels.values())).median())
        report.worst_request, report.worst_position = worst, int(per_pos.argmax())
        report.worst_position_rel_err = float(per_pos.max())
    return report
