"""The run report: a console table and ``report.json``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from runtime.app.spec_compare import summary_line
from runtime.engine.engine import RunResult


def memory_plan(container) -> dict:
    """Every device buffer the runtime built, in bytes."""
    ledger = container.workspace_ledger()
    index_keys, hisparse = container.index_key_pool(), container.hisparse_coordinator()
    kv, v4 = container.kv_pool(), container.dsv4_pools()
    sizes = {
        "kv_pool_bytes": kv.nbytes if kv is not None else 0,
        # DeepSeek-V4 (0 otherwise): window ring, compressed-entry pools, compressor state, each by name
        **(v4.breakdown() if v4 is not None else {}),
        "index_key_bytes": index_keys.nbytes if index_keys is not None else 0,
        "hisparse_device_bytes": hisparse.device_bytes if hisparse is not None else 0,
        "request_state_bytes": sum(pool.nbytes for pool in container.request_states()),
        "req_to_token_bytes": container.req_to_token_pool().nbytes,
        "weights_bytes": container.model().weight_bytes,
        # the speculative draft's own KV pool (its weights are the target's)
        "draft_kv_pool_bytes": container.draft_kv_pool().nbytes if container.config.speculative.enabled() else 0,
    }
    weights = container.model().weights
    plan = container.memory_budget()  # what was predicted before anything was allocated (docs/memory.md)
    measured = container.memory_reader().peak(container.device())
    return {**sizes, "plan": {**plan.as_dict(), "measured_peak_bytes": measured},
            "workspaces": ledger.report(), "workspace_consumers": ledger.consumers(),
            "weights_by_dtype": weights.bytes_by_dtype(), "total_bytes": sum(sizes.values()) + ledger.total_bytes}


SPEC_PHASES = ("draft_decode", "target_verify", "draft_extend")


def _ms_stats(ms: np.ndarray, graphed: int) -> dict:
    n = len(ms)
    return {
        "steps": n, "graphed_steps": graphed,
        "mean_step_ms": float(ms.mean()) if n else 0.0,
        "p50_step_ms": float(np.percentile(ms, 50)) if n else 0.0,
        "p99_step_ms": float(np.percentile(ms, 99)) if n else 0.0,
        "seconds": float(ms.sum() / 1e3),
    }


def _step_stats(steps: list) -> dict:
    return _ms_stats(np.array([s.seconds * 1e3 for s in steps]), sum(1 for s in steps if s.graphed))


def _round_ms(steps: list) -> np.ndarray:
    """Milliseconds of each speculative round: its draft decode (if any), verify and draft extend phases
    (a round ends with its draft extend)."""
    rounds, acc = [], 0.0
    for s in steps:
        if s.phase in SPEC_PHASES:
            acc += s.seconds * 1e3
            if s.phase == "draft_extend":
                rounds.append(acc)
                acc = 0.0
    return np.array(rounds)


def _phases(res: RunResult) -> dict:
    """Prefill and decode. With speculation, decode is the rounds: its tokens are the tokens the rounds
    emitted and its time the sum of their draft, verify and draft-extend phases (one "step" = one round)."""
    pre = [s for s in res.steps if s.phase == "prefill"]
    pre_tokens, pre_s = sum(s.tokens for s in pre), sum(s.seconds for s in pre)
    verify = [s for s in res.steps if s.phase == "target_verify"]
    if verify:  # speculative
        dec_tokens = sum(s.tokens for s in verify)
        stats = _ms_stats(_round_ms(res.steps), sum(1 for s in verify if s.graphed))
    else:
        dec = [s for s in res.steps if s.phase == "decode"]
        dec_tokens = sum(s.tokens for s in dec)
        stats = _step_stats(dec)
    return {
        "prefill": {
            "steps": len(pre), "tokens": pre_tokens, "seconds": pre_s,
            "tokens_per_s": pre_tokens / pre_s if pre_s > 0 else 0.0,
        },
        "decode": {
            **stats, "tokens": dec_tokens,
            "tokens_per_s": dec_tokens / stats["seconds"] if stats["seconds"] > 0 else 0.0,
        },
    }


def speculative_section(res: RunResult, stats, baseline: RunResult | None) -> dict:
    """Acceptance, per-phase step times, and decode tokens/s with and without speculation."""
    phases = {p: _step_stats([s for s in res.steps if s.phase == p])
              for p in ("draft_prefill", "draft_bootstrap", *SPEC_PHASES)}
    out = {
        "rounds": stats.rounds, "acceptance_length": stats.acceptance_length,
        "acceptance_rate": stats.acceptance_rate, "accepted_histogram": list(stats.accept_hist),
        "phases": phases, "decode_tokens_per_s": _phases(res)["decode"]["tokens_per_s"],
    }
    if baseline is not None:
        base = _phases(baseline)["decode"]["tokens_per_s"]
        out["baseline_decode_tokens_per_s"] = base
        out["speedup"] = out["decode_tokens_per_s"] / base if base > 0 else 0.0
    return out


def shared_kv_indices_section(container, mode: str) -> dict:
    """The multi-step draft's shared kv-indices pass: how often it ran and how often it was skipped because
    every draft step backend builds its own kv indices (``capabilities.builds_own_kv_indices``)."""
    kv_pass, draft = container.draft_kv_indices(), container.draft_attention()
    steps = draft.step_backends
    own = all(type(b).capabilities.builds_own_kv_indices for b in steps)
    why = ("every draft step backend builds its own kv indices" if own
           else "a draft step backend reads batch.kv_page_table") if steps else "no draft decode steps"
    return {"mode": mode, "runs": kv_pass.runs if kv_pass is not None else 0,
            "skipped": draft.kv_indices_skipped, "injected": kv_pass is not None, "why": why}


def kernel_section(backend_cfg: dict) -> dict | None:
    """Which kernel implementation ran, for backends with a ``kernel`` switch; an emulation says so plainly."""
    impl = backend_cfg.get("kernel")
    if impl is None or backend_cfg.get("impl") not in (None, "flashinfer"):  # dsv4: kernel only with impl=flashinfer
        return None
    if impl == "emulate":
        return {"impl": "emulate", "emulated": True,
                "note": "EMULATION: a torch implementation of the kernel's calling contract ran instead of the "
                        "vendor kernel; the hardware gate (GPU family, packages, dtypes) was lifted; timings "
                        "say nothing about the kernel"}
    return {"impl": impl, "emulated": False}


def _hisparse(container) -> dict | None:
    """Device vs host KV bytes and swap-in counters. ``dense_equivalent_bytes``: a dense device pool holding as
    many tokens as the host pool (what HiSparse saves); ``device_kv_bytes``: the device page pool (prefill) plus
    the per-request buffers."""
    c = container.hisparse_coordinator()
    if c is None:
        return None
    st = c.stats()
    kv, v4 = container.kv_pool(), container.dsv4_pools()
    # the device pool beside the buffers: V3.2's latent pool (prefill); V4's CSA pool without its entries
    # (indexer keys and the entry table; the HCA pool and window ring are in the memory plan's dsv4 rows)
    pool = kv.nbytes if kv is not None else v4.csa.nbytes
    device = pool + st["device_buffer_bytes"]
    dense = st["host_tokens"] * st["row_bytes"] * st["layers"]
    return {"device_kv_bytes": device, "device_pool_bytes": pool, **st, "dense_equivalent_bytes": dense,
            "device_over_dense": device / dense if dense else 0.0}


def sparse_prefill_section(container) -> dict | None:
    """A sparse model's prefill (DeepSeek-V3.2, issue 48): key rows its sparse layers read per layer (each prompt
    token its own indexer top-k, min(top_k, position + 1) rows) against a dense prefill of the same steps; None
    for a model without a sparse backend."""
    sparse = container.sparse_decode()
    if sparse is None:
        return None
    st = sparse.prefill_stats()
    return {"top_k": st["top_k"], "tokens": st["tokens"], "rows_read": st["sparse"], "dense_rows": st["dense"],
            "fraction_of_dense": st["sparse"] / st["dense"] if st["dense"] else 0.0}


def _kv_cache(container) -> dict:
    """Storage dtype and scale of the latent cache, bytes per token (all cached layers) and the tokens the
    pool holds, and (fp8) how many written values clipped at +-448 x scale: the device counters, read once."""
    kv = container.kv_pool()
    if kv is None:  # DeepSeek-V4: no latent cache; its pools are in the memory plan
        v4 = container.dsv4_pools()
        return {"kv_dtype": "auto", "cache_dtype": str(v4.window.dtype).removeprefix("torch."), "scale": 1.0,
                "values_written": 0, "values_clipped": 0, "clipped_fraction": 0.0, "pool_bytes": v4.nbytes,
                "bytes_per_token": 0, "pool_tokens": 0, "dsv4_pools": v4.breakdown()}
    tokens = (len(kv.buffers[0]) - 1) * kv.page_size if kv.buffers else 0  # page 0 is the padding page
    return {**kv.quant_stats(), "pool_bytes": kv.nbytes, "bytes_per_token": kv.bytes_per_token,
            "pool_tokens": tokens}


def _graphs(runner) -> dict:
    return {name: {"graphed": m.decision.graphed, "sizes": sorted(m.graphs), "replays": m.replays,
                   "reason": m.decision.reason} for name, m in runner.modes.items()}


def fp8_compute(runtime) -> str | None:
    """How the model's stored block-fp8 weights meet activations above 16 rows: its decoder ops' ``fp8_compute``
    (``"w8a8"``: e4m3 activations, ``"w8a16"``: 16-bit ones) when it holds fp8 weights (MLA and DeepSeek-V4
    layers alike multiply them through those ops), else None."""
    w = runtime.container.model().weights
    if "float8_e4m3fn" not in w.bytes_by_dtype():
        return None
    return runtime.container.decoder_ops().fp8_compute


def _model(runtime) -> dict:
    """Name, dtype (the compute dtype), layers, and where the weights came from: ``source`` (random, or the
    checkpoint folder), ``stored_dtypes`` (checkpoint dtype -> tensors read in it), ``weights`` (model.weights:
    stored fp8 kept as fp8, or dequantized to ``dtype``), ``fp8_compute`` (:func:`fp8_compute`), ``weight_bytes``
    (dtype -> bytes as held on the device), ``unquantized_bytes`` (weight group -> bytes of the weights held in a
    float dtype), ``load_seconds`` and ``peak_host_bytes`` (the process's peak resident memory after loading)."""
    m = runtime.config["model"]
    w = runtime.container.model().weights
    return {"name": m["name"], "model_type": m.get("model_type"), "dtype": m["dtype"], "layers": m["num_layers"],
            "mlp": m.get("mlp"), "source": w.source, "stored_dtypes": w.stored_dtypes, "weights": m.get("weights"),
            "fp8_compute": fp8_compute(runtime),
            "weight_bytes": w.bytes_by_dtype(), "unquantized_bytes": w.unquantized_bytes(),
            "load_seconds": w.load_seconds, "peak_host_bytes": w.peak_host_bytes}


def _outputs(res: RunResult, workload) -> list[dict]:
    """One entry per request, in input order: prompt length, generated ids, why it ended, and the decoded
    text when the workload has a tokenizer (cut before the first of the request's stop strings, as the server
    shows it: the ids keep the tokens that completed it)."""
    out = []
    for rid in sorted(res.outputs):
        ids, spec = res.outputs[rid], workload.specs[rid]
        entry = {"rid": rid, "prompt_tokens": len(spec.prompt), "output_ids": ids,
                 "finish_reason": res.finish_reasons.get(rid, "length")}
        text = workload.decode(ids)
        if text is not None:
            stops = spec.sampling.stop if spec.sampling is not None else ()
            entry["text"] = text[:min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))]
        out.append(entry)
    return out


def make_report(runtime, res: RunResult, parity: dict | None, dumps: dict[str, str],
                speculative: dict | None = None) -> dict:
    cfg = runtime.config
    generated = sum(len(v) for v in res.outputs.values())
    return {
        "backend": cfg["backend"]["name"],
        "kernel": kernel_section(cfg["backend"]),
        "device": {"kind": runtime.device.kind, "name": runtime.device.name},
        "model": _model(runtime),
        "workload": cfg["workload"]["name"],
        "outputs": _outputs(res, runtime.container.workload()),
        "build_order": runtime.build_order,
        "memory": memory_plan(runtime.container),
        "phases": _phases(res),
        "requests": {
            "total": len(res.outputs), "finished": res.finished, "retracted": res.retracted,
            "queued_for_memory": res.queued_for_memory, "lost": res.lost,
            "prompt_tokens": res.prompt_tokens, "generated_tokens": generated,
            "outputs_sha1": hashlib.sha1(json.dumps(sorted(res.outputs.items())).encode()).hexdigest(),
        },
        "graphs": _graphs(runtime.container.graph_runner()),
        "speculative": speculative,
        "hisparse": _hisparse(runtime.container),
        "sparse_prefill": sparse_prefill_section(runtime.container),
        "kv_cache": _kv_cache(runtime.container),
        "parity": parity if parity is not None else {"reference": None, "ok": None},
        "oom_events": [e.as_dict() for e in res.oom_events],  # steps that ran out of memory and were retracted
        "dumps": dumps,
    }


def write_report(report: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2))
    return path


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _output_lines(outputs: list[dict], shown: int = 3, width: int = 60) -> str:
    """The first ``shown`` outputs, one line each (text when decoded, else ids), clipped to ``width``."""
    lines = []
    for o in outputs[:shown]:
        body = repr(o["text"]) if "text" in o else " ".join(map(str, o["output_ids"]))
        lines.append(_clip(f"#{o['rid']} ({len(o['output_ids'])} tok, {o['finish_reason']}): {body}", width))
    if len(outputs) > shown:
        lines.append(f"… {len(outputs) - shown} more in report.json")
    return "\n".join(lines)


def _parallel_line(pl: dict) -> str:
    """tp, moe, backend; per phase: collectives per step, KiB per step, ms per step (eager, or the probe's for
    graphed steps); weights per rank."""
    parts = [f"tp {pl['tp']} (moe {pl['moe']}, {pl['backend']})"]
    for phase, c in pl["collectives"].items():
        ms = [f"{c['ms_per_eager_step']:.3f} ms eager" if c["ms_per_eager_step"] is not None else "",
              f"{c['probe_ms_per_graphed_step']:.3f} ms graphed (probe)" if c["probe_ms_per_graphed_step"] is not None
              else ""]
        parts.append(f"{phase}: {c['count_per_step']:.1f} collectives, {c['bytes_per_step'] / 1024:.1f} KiB per step"
                     + "".join(f", {m}" for m in ms if m))
    parts.append("weights per rank " + ", ".join(_mib(m["weights_bytes"]) for m in pl["memory_per_rank"]))
    return "; ".join(parts)


def _weight_line(m: dict) -> str:
    """model.weights, bytes per dtype as held, and the largest groups held in a float dtype."""
    by = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(m["weight_bytes"].items(), key=lambda kv: -kv[1]))
    line = f"{m['weights']}: {by}"
    if "float8_e4m3fn" in m["weight_bytes"]:
        line += f" ({m['fp8_compute']} above 16 rows)" if m["fp8_compute"] else ""
        top = sorted(m["unquantized_bytes"].items(), key=lambda kv: -kv[1])
        line += "; in 16 / 32 bits: " + ", ".join(f"{k} {_mib(v)}" for k, v in top[:6])
        if len(top) > 6:
            line += f", {len(top) - 6} more groups {_mib(sum(v for _, v in top[6:]))}"
    return line


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"mla-runtime: {report['backend']} on {report['device']['name']}", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    k = report.get("kernel")
    if k:
        t.add_row("kernel", f"[yellow]{k['impl']}: {k['note']}[/yellow]" if k["emulated"] else k["impl"])
    p, d, r = report["phases"]["prefill"], report["phases"]["decode"], report["requests"]
    m = report["model"]
    stored = ", ".join(f"{k} x{n}" for k, n in sorted(m["stored_dtypes"].items()))
    loaded = (f"; loaded from {m['source']} (stored {stored}) in {m['load_seconds']:.2f} s, peak host memory "
              f"{_mib(m['peak_host_bytes'])}" if m["source"] != "random" else "; seeded random weights")
    t.add_row("model", f"{m['name']} ({m['dtype']}, {m['layers']} layers, mlp {m['mlp']})" + loaded)
    t.add_row("weights", _weight_line(m))
    t.add_row("build order", " -> ".join(report["build_order"]))
    t.add_row("prefill", f"{p['tokens']} tokens in {p['steps']} steps, {p['tokens_per_s']:.1f} tok/s")
    t.add_row("decode", f"{d['tokens']} tokens in {d['steps']} steps; step ms mean {d['mean_step_ms']:.3f} "
              f"p50 {d['p50_step_ms']:.3f} p99 {d['p99_step_ms']:.3f}")
    t.add_row("requests", f"{r['finished']}/{r['total']} finished, {r['retracted']} retracted, "
              f"{r['queued_for_memory']} times queued for memory, {r['lost']} lost")
    if report.get("outputs"):
        t.add_row("outputs", _output_lines(report["outputs"]))
    mem = report["memory"]
    draft = f"draft kv pool {_mib(mem['draft_kv_pool_bytes'])}, " if mem["draft_kv_pool_bytes"] else ""
    t.add_row("memory", f"kv pool {_mib(mem['kv_pool_bytes'])}, {draft}request states {_mib(mem['request_state_bytes'])}, "
              f"weights {_mib(mem['weights_bytes'])}, "
              + ", ".join(f"{k} {_mib(v)}" for k, v in mem["workspaces"].items()))
    plan = mem["plan"]
    measured = f"; measured allocator peak {_mib(plan['measured_peak_bytes'])}" if plan["measured_peak_bytes"] else ""
    t.add_row("memory plan", f"{plan['num_pages']} pages ({'auto' if plan['auto'] else 'kv.num_pages'}) = "
              f"{plan['tokens']} tokens; predicted peak {_mib(plan['peak_bytes'])} of {_mib(plan['free'])} free"
              + measured)
    for e in report.get("oom_events", []):
        t.add_row("out of memory", f"[yellow]step {e['step']} ({e['mode']}, {e['batch_size']} requests, {e['tokens']} "
                  f"tokens): retracted {e['retracted']}, limits now {e['limits']}[/yellow]")
    kvc = report.get("kv_cache")
    if kvc and "dsv4_pools" in kvc:
        t.add_row("dsv4 pools", ", ".join(f"{k.removeprefix('dsv4_')} {_mib(v)}" for k, v in kvc["dsv4_pools"].items()))
    elif kvc:
        clip = (f"; {kvc['values_clipped']} of {kvc['values_written']} values clipped (scale {kvc['scale']:g})"
                if kvc["kv_dtype"] != "auto" else "")
        t.add_row("kv cache", f"{kvc['cache_dtype']}, {kvc['bytes_per_token']} B/token, "
                  f"{kvc['pool_tokens']} tokens in {_mib(kvc['pool_bytes'])}" + clip)
    sp = report.get("speculative")
    if sp:
        ph = sp["phases"]
        base = (f"; without speculation {sp['baseline_decode_tokens_per_s']:.1f} tok/s (x{sp['speedup']:.2f})"
                if "baseline_decode_tokens_per_s" in sp else "")
        t.add_row("speculative", f"{sp['rounds']} rounds, acceptance length {sp['acceptance_length']:.2f} "
                  f"(rate {sp['acceptance_rate']:.2f}); step ms draft {ph['draft_decode']['mean_step_ms']:.3f} "
                  f"verify {ph['target_verify']['mean_step_ms']:.3f} "
                  f"extend {ph['draft_extend']['mean_step_ms']:.3f}; decode {sp['decode_tokens_per_s']:.1f} tok/s"
                  + base)
        if sp.get("vs_baseline"):
            t.add_row("speculative vs plain", summary_line(sp["vs_baseline"]))
        kv = sp.get("shared_kv_indices")
        if kv:
            t.add_row("shared kv-indices pass", f"{kv['runs']} runs, {kv['skipped']} skipped (mode {kv['mode']}: "
                      f"{kv['why']})")
    for mode, g in report["graphs"].items():
        t.add_row(f"{mode} graphs", f"{len(g['sizes'])} sizes captured, {g['replays']} replays" if g["graphed"]
                  else f"eager ({g['reason']})")
    hs = report.get("hisparse")
    if hs:
        t.add_row("hisparse", f"device KV {_mib(hs['device_kv_bytes'])} (pool {_mib(hs['device_pool_bytes'])} + "
                  f"buffers {_mib(hs['device_buffer_bytes'])}) vs host KV {_mib(hs['host_kv_bytes'])}; "
                  f"{hs['device_over_dense']:.2f}x of dense; {hs['swap_ins']} swap-ins, hit rate "
                  f"{hs['hit_rate']:.1%}, {hs['bytes_copied_per_decode_step'] / 1024:.1f} KiB copied per decode step")
    spf = report.get("sparse_prefill")
    if spf and spf["tokens"]:
        t.add_row("sparse prefill", f"{spf['tokens']} prompt tokens read {spf['rows_read']} key rows per sparse layer "
                  f"(top-{spf['top_k']} each) vs {spf['dense_rows']} dense: {spf['fraction_of_dense']:.1%}")
    pl = report.get("parallel")
    if pl and pl["tp"] > 1:
        t.add_row("tensor parallel", _parallel_line(pl))
    par = report["parity"]
    if par.get("reference"):
        verdict = "[green]ok[/green]" if par["ok"] else "[red]FAILED[/red]"
        t.add_row("parity", f"{verdict} vs {par['reference']}: tokens equal {par['tokens_equal']} "
                  f"({par['mismatches']} mismatches, {par['near_tie_mismatches']} at near-ties"
                  + (f", up to {par['routing_flip_budget']} more allowed: discrete routing in 16 bits"
                     if par.get("routing_flip_budget") else "") + "), "
                  f"max rel err {par['max_rel_err']:.2e} (tol {par['tolerance']:.0e}"
                  + (f", {par['activations']} activations" if par.get("activations", "").startswith("e4m3") else "")
                  + ")"
                  + (f"; median request {par['median_rel_err']:.2e}, worst request {par['worst_request']} at "
                     f"position {par['worst_position']} ({par['worst_position_rel_err']:.2e})"
                     if par.get("worst_request") is not None else ""))
        q = par.get("quantization")
        if q:
            t.add_row("fp8 vs unquantized", f"token agreement {q['token_agreement']:.1%} of {q['positions']}, "
                      f"logit max rel err {q['logit_max_rel_err']:.2e}, max abs {q['logit_max_abs_err']:.3f}")
    else:
        t.add_row("parity", f"[yellow]skipped: {par['skipped']}[/yellow]" if par.get("skipped") else "off")
    console.print(t)
