"""Serving benchmark (what ``sglang.bench_serving`` does): Poisson arrivals against the OpenAI API, streamed.

For each ``--request-rate`` (requests/s; ``inf``: all at once) the same requests are sent with exponential gaps,
each streamed (``/v1/completions``, token-id prompts, ``ignore_eos`` so every request generates exactly its
output length); it prints per rate: TTFT (arrival to first token), inter-token latency (the gap between two
streamed chunks, spread over the tokens they carry) and end-to-end latency p50 / p90 / p99 in ms, request
throughput and output tokens/s. Requests: random input / output lengths (``--input-len`` / ``--output-len`` with
``--range-ratio``), or a prompts file (the JSON lines of ``workload=prompts``: ``prompt_ids`` or ``prompt``,
``max_new_tokens``).

Against a running server: ``python -m bench.serving --url http://127.0.0.1:8000 --request-rate 1 4 16 inf``.
Self-hosted (``python -m runtime.serve`` in its own process on a free port, ``bench/serving_host.py``; overrides as
for ``python -m runtime.serve``; ``--in-process``: the server on a thread of this process instead):
``python -m bench.serving --serve device=cpu --num-prompts 16 --request-rate 8 inf``. With ``--offline`` a
self-hosted run first serves the same requests with the offline engine (``Engine.run``, all at once) and prints
its output tokens/s and prefill / decode step times, the figures the server is compared with (docs/serving.md).
Before the rates, the requests are sent once, all at once and untimed (``--no-warmup`` skips it), as the offline
figures come from a warmed engine. Each rate also prints the server's own mean TTFT and inter-token latency (its
``/metrics`` histograms: arrival at the engine to emission) beside the client's mean TTFT (their difference is HTTP,
the event loop and the client), and the server's prefill forwards and mean decode batch beside the offline run's.
``--plot FILE.png`` plots the latencies and throughput against the rate (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.harness import Ceilings, Table, json_line

# the one-prompt TTFT is also timed after this much GPU idle (a low rate's gap between requests): how much of the
# server's TTFT at a low rate is the GPU waking up rather than the server
IDLE_BEFORE_PROMPT_S = 0.4


@dataclass
class Job:
    prompt: list[int] | str
    output_len: int


@dataclass
class Outcome:
    ok: bool
    ttft: float = math.nan
    itl: list[float] = field(default_factory=list)
    e2e: float = math.nan
    tokens: int = 0
    error: str = ""


def random_jobs(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int, seed: int) -> list[Job]:
    """``n`` requests: lengths uniform in [len * range_ratio, len], prompt ids uniform in [1, vocab)."""
    rng = np.random.default_rng(seed)
    ins = rng.integers(max(1, int(input_len * range_ratio)), input_len + 1, size=n)
    outs = rng.integers(max(1, int(output_len * range_ratio)), output_len + 1, size=n)
    return [Job([int(t) for t in rng.integers(1, vocab, size=i)], int(o)) for i, o in zip(ins, outs)]


def file_jobs(path: str, default_output: int) -> list[Job]:
    jobs = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            obj = json.loads(line)
            jobs.append(Job(obj.get("prompt_ids", obj.get("prompt")), int(obj.get("max_new_tokens", default_output))))
    return jobs


async def _one(client, url: str, model: str, job: Job, headers: dict) -> Outcome:
    import httpx

    body = {"model": model, "prompt": job.prompt, "max_tokens": job.output_len, "stream": True, "ignore_eos": True,
            "temperature": 0}
    start = time.perf_counter()
    out = Outcome(ok=False)
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if not chunk.get("choices"):
                    continue
                c = chunk["choices"][0]
                n = len(c.get("token_ids", ())) or (1 if c.get("text") else 0)
                if n == 0:
                    continue
                now = time.perf_counter()
                if last is None:
                    out.ttft = now - start
                else:
                    out.itl += [(now - last) / n] * n
                last = now
                out.tokens += n
        out.e2e = time.perf_counter() - start
        out.ok = True
    except (httpx.HTTPError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_rate(base_url: str, model: str, jobs: list[Job], rate: float, seed: int, api_key: str | None,
                   max_concurrency: int | None) -> tuple[list[Outcome], float]:
    """Send ``jobs`` with Poisson arrivals at ``rate``; (outcomes, wall seconds from first send to last end)."""
    import httpx

    rng = np.random.default_rng(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(jobs) + 8)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def send(job: Job) -> Outcome:
            if gate is None:
                return await _one(client, f"{base_url}/v1/completions", model, job, headers)
            async with gate:
                return await _one(client, f"{base_url}/v1/completions", model, job, headers)

        start = time.perf_counter()
        tasks = []
        for job in jobs:
            tasks.append(asyncio.create_task(send(job)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        outcomes = await asyncio.gather(*tasks)
        return outcomes, time.perf_counter() - start


def server_sums(url: str, api_key: str | None) -> dict[str, float]:
    """The server's own latency histograms (``GET /metrics``): ``ttft`` / ``itl`` sums of seconds and counts. The
    difference of two readings is one rate's server-side mean: arrival at the engine to the token's emission,
    without the HTTP parsing, the event loop and the client's own SSE reading that the client's figures hold."""
    import httpx

    from runtime.app.serve.metrics import PREFIX

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10.0).text
    names = {"ttft": f"{PREFIX}_time_to_first_token_seconds", "itl": f"{PREFIX}_inter_token_latency_seconds"}
    out = {}
    for key, name in names.items():
        for part in ("sum", "count"):
            m = re.search(rf"^{name}_{part} (\S+)$", text, re.M)
            out[f"{key}_{part}"] = float(m.group(1)) if m else math.nan
    for counter in ("steps_total", "step_requests_total", "step_seconds_sum", "step_seconds_count"):
        for phase in ("prefill", "decode"):  # forwards by phase, their batch sizes summed, their device time
            m = re.search(rf'^{PREFIX}_engine_{counter}{{phase="{phase}"}} (\S+)$', text, re.M)
            out[f"{phase}_{counter}"] = float(m.group(1)) if m else 0.0
    return out


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Server-side mean TTFT / inter-token latency (ms), prefill forwards and the mean decode batch between two
    :func:`server_sums` readings (the offline figures print the same two step counts)."""
    row = {}
    for key in ("ttft", "itl"):
        n = after[f"{key}_count"] - before[f"{key}_count"]
        row[f"server {key} mean ms"] = (after[f"{key}_sum"] - before[f"{key}_sum"]) / n * 1e3 if n > 0 else math.nan
    d = {k: after[k] - before[k] for k in after if k.startswith(("prefill_", "decode_"))}
    row["server prefill steps"] = int(d["prefill_steps_total"])
    row["server decode batch"] = (d["decode_step_requests_total"] / d["decode_steps_total"] if d["decode_steps_total"]
                                  else math.nan)
    for phase in ("prefill", "decode"):  # device time per forward, the offline run's step times' counterpart
        n = d[f"{phase}_step_seconds_count"]
        row[f"server {phase} step mean ms"] = d[f"{phase}_step_seconds_sum"] / n * 1e3 if n > 0 else math.nan
    return row


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else math.nan


def summarize(rate: float, outcomes: list[Outcome], seconds: float) -> dict:
    ok = [o for o in outcomes if o.ok]
    itl = [x for o in ok for x in o.itl]
    row = {"rate": rate if math.isfinite(rate) else "inf", "done": len(ok), "failed": len(outcomes) - len(ok),
           "req/s": len(ok) / seconds, "out tok/s": sum(o.tokens for o in ok) / seconds}
    for name, vals in (("ttft", [o.ttft for o in ok]), ("itl", itl), ("e2e", [o.e2e for o in ok])):
        for q in (50, 90, 99):
            row[f"{name} p{q} ms"] = _pct(vals, q)
    row["ttft mean ms"] = float(np.mean([o.ttft for o in ok])) * 1e3 if ok else math.nan
    return row


def offline_figures(plain: dict, jobs: list[Job]) -> dict:
    """The same requests through the offline engine (all queued at once), timed on a second run after a warm-up
    run of the same requests (as the server is warm when the first request comes): output tokens/s, step times;
    then the first prompt alone for one token, five times back to back and five times after
    ``IDLE_BEFORE_PROMPT_S`` of idle."""
    import containers
    from runtime.app.memory_checks import release
    from runtime.engine.workload import RequestSpec, Workload

    rt = containers.build(plain)
    engine = rt.engine
    tok = engine.requests.tokenizer
    specs = tuple(RequestSpec(tuple(j.prompt if isinstance(j.prompt, list) else tok.encode(j.prompt).ids),
                              j.output_len) for j in jobs)
    engine.requests = Workload(specs, frozenset(), tok)  # no EOS: every request generates its full length
    engine.run(record_hidden=False)  # warm-up, as the server's start: graph captures, JIT builds, allocator growth
    start = time.perf_counter()
    res = engine.run(record_hidden=False)
    seconds = time.perf_counter() - start
    steps = {ph: [s.seconds for s in res.steps if s.phase == ph] for ph in ("prefill", "decode")}
    decode_batches = [s.batch_size for s in res.steps if s.phase == "decode"]
    out_tokens = sum(len(v) for v in res.outputs.values())
    engine.requests = Workload((RequestSpec(specs[0].prompt, 1),), frozenset(), tok)  # one prompt: TTFT's match
    alone, walls, idle_walls = [], [], []  # its prefill's device time; wall time to its one token (host too)
    for i in range(10):
        if i >= 5:  # as at a low request rate: the GPU idle before the prompt comes
            time.sleep(IDLE_BEFORE_PROMPT_S)
        t0 = time.perf_counter()
        one = engine.run(record_hidden=False)
        (walls if i < 5 else idle_walls).append(time.perf_counter() - t0)
        if i < 5:
            alone.append(sum(s.seconds for s in one.steps if s.phase == "prefill"))
    release(rt)  # the server's memory plan reads the device after this
    return {"offline out tok/s": out_tokens / seconds,
            "offline prefill step p50 ms": _pct(steps["prefill"], 50),
            "offline decode step p50 ms": _pct(steps["decode"], 50), "offline seconds": seconds,
            "offline prefill steps": len(steps["prefill"]),
            "offline decode batch": float(np.mean(decode_batches)) if decode_batches else math.nan,
            "offline one-prompt prefill ms": _pct(alone, 50), "offline one-prompt TTFT ms": _pct(walls, 50),
            "offline one-prompt TTFT after idle ms": _pct(idle_walls, 50)}


def goal_ratios(rows: list[dict], meta: dict) -> dict:
    """The three comparisons docs/serving.md states: output tokens/s at the highest rate against the offline
    engine's, TTFT p50 at the lowest rate against one prompt's offline time to first token (the wall time of the
    engine running that prompt alone for one token: host planning and launches too, as a served request pays
    them; its prefill forwards' device time is printed beside it), inter-token p50 at the highest
    rate against the offline decode step (the offline run decodes the same requests at once)."""
    if "offline out tok/s" not in meta or not rows:
        return {}
    low, high = min(rows, key=lambda r: float(r["rate"])), max(rows, key=lambda r: float(r["rate"]))
    return {"server/offline tok/s (highest rate)": high["out tok/s"] / meta["offline out tok/s"],
            "TTFT p50 (lowest rate) / offline one-prompt TTFT": low["ttft p50 ms"] / meta["offline one-prompt TTFT ms"],
            "ITL p50 (highest rate) / decode step": high["itl p50 ms"] / meta["offline decode step p50 ms"]}


def plot(rows: list[dict], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    finite = [r for r in rows if r["rate"] != "inf"]
    if not finite:
        return None
    x = [r["rate"] for r in finite]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("ttft p50 ms", "ttft p99 ms", "itl p50 ms", "itl p99 ms", "e2e p50 ms"):
        a.plot(x, [r[key] for r in finite], marker="o", label=key)
    a.set_xlabel("request rate (req/s)"), a.set_ylabel("ms"), a.set_yscale("log"), a.legend()
    b.plot(x, [r["out tok/s"] for r in finite], marker="o")
    b.set_xlabel("request rate (req/s)"), b.set_ylabel("output tokens/s")
    fig.tight_layout()
    fig.savefig(path)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--serve", nargs="*", help="self-host: Hydra overrides of runtime.serve (e.g. device=cpu)")
    ap.add_argument("--request-rate", nargs="+", type=float, default=[math.inf], help="requests/s; inf: at once")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=1.0, help="lengths uniform in [len * ratio, len]")
    ap.add_argument("--prompts-file", help="JSON lines as for workload=prompts (instead of random prompts)")
    ap.add_argument("--max-concurrency", type=int, nargs="+", default=[None],
                    help="requests in flight at once; several values: each rate at each (a batch-size sweep: 1 32 128)")
    ap.add_argument("--waves", type=int, default=None, help="with --max-concurrency C: send min(num-prompts, "
                    "WAVES * C) requests at that concurrency (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--offline", action="store_true", help="self-hosted: also the offline engine's figures")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed first pass of the "
                    "requests (all at once) that warms the server as the offline run is warmed")
    ap.add_argument("--server-dir", help="self-hosted in its own process: the server's log and Hydra folder here "
                    "(default: a temporary folder)")
    ap.add_argument("--in-process", action="store_true", help="self-hosted on a thread of this process (default: "
                    "python -m runtime.serve in its own process)")
    ap.add_argument("--plot", help="write the rate sweep plot here (matplotlib)")
    ap.add_argument("--quick", action="store_true", help="self-hosted on the default config (unless --url / --serve "
                    "say otherwise): 16 prompts of 64 tokens, 16 out, rates 4 and inf, with the offline figures")
    return ap


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    import runtime.core.config  # noqa: F401  (registers the schemas)
    from runtime.serve import serving_overrides

    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose("config", overrides=[*serving_overrides(overrides), "serve.port=0"])


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if args.quick:
        if args.url is None and args.serve is None:
            args.serve = []
        args.num_prompts, args.input_len, args.output_len = 16, 64, 16
        args.request_rate, args.offline = [4.0, math.inf], args.url is None
    if (args.url is None) == (args.serve is None):
        raise SystemExit("give exactly one of --url (a running server) and --serve [OVERRIDES] (self-hosted)")
    meta: dict = {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len}
    server = None
    if args.serve is not None:
        from containers import to_plain
        from runtime.app.serve.server import Background, make_server

        cfg = _compose(args.serve)
        vocab = to_plain(cfg)["model"]["vocab_size"] or 32000
        jobs = _jobs(args, vocab)
        if args.offline:
            meta.update(offline_figures(to_plain(cfg), jobs))
        if args.in_process:
            server = Background(make_server(cfg)).__enter__()
            url, model = server.url, server.server.state.model_name
        else:
            from bench.serving_host import ServerProcess
            from runtime.serve import serving_overrides

            server = ServerProcess(serving_overrides(args.serve), run_dir=args.server_dir).__enter__()
            url, model = server.url, server.model
            note(f"server up (log: {server.log})")
    else:
        import httpx

        url = args.url.rstrip("/")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(f"{url}/v1/models", headers=headers).json()["data"]
        model, vocab = models[0]["id"], models[0].get("vocab_size", 32000)
        jobs = _jobs(args, vocab)
    rows = []
    try:
        sweep = len(args.max_concurrency) > 1
        if args.warmup:  # as the offline figures' warm-up run: graph captures, JIT builds, allocator growth
            outcomes, _ = asyncio.run(run_rate(url, model, jobs, math.inf, args.seed, args.api_key,
                                               _widest(args.max_concurrency)))
            failed = [o.error for o in outcomes if not o.ok]
            if failed:
                print(f"warm-up: {len(failed)} failed, e.g. {failed[0]}")
            note(f"warm-up: {len(jobs)} requests")
        for c in args.max_concurrency:
            sent = jobs if c is None or args.waves is None else jobs[: args.waves * c]
            for i, rate in enumerate(args.request_rate):
                before = server_sums(url, args.api_key)
                outcomes, seconds = asyncio.run(run_rate(url, model, sent, rate, args.seed + i, args.api_key, c))
                row = {"concurrency": c if c else "all"} if sweep else {}
                rows.append({**row, **summarize(rate, outcomes, seconds),
                             **server_means(before, server_sums(url, args.api_key))})
                failed = [o.error for o in outcomes if not o.ok]
                if failed:
                    print(f"concurrency {c}, rate {rate}: {len(failed)} failed, e.g. {failed[0]}")
                note(f"concurrency {c or 'all'}, rate {rate}: {len(sent)} requests in {seconds:.1f} s, "
                     f"{rows[-1]['out tok/s']:.1f} out tok/s")
    finally:
        if server is not None:
            server.__exit__(None, None, None)
    fmt = {k: ".1f" for r in rows for k in r if k.endswith(("ms", "/s", "batch"))}
    print(Table(rows, title=f"serving: {len(jobs)} requests, model {model}", formats=fmt).render())
    for k, v in meta.items():
        if k.startswith("offline"):
            print(f"{k}: {v:.1f}")
    ratios = goal_ratios(rows, meta)
    meta.update(ratios)
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    if args.plot:
        path = plot(rows, args.plot)
        print(f"plot: {path}" if path else "plot: skipped (matplotlib is not installed; pip install -e '.[plot]')")
    print(json_line("serving", Ceilings("client", math.nan, math.nan), Table(rows), meta))
    return rows


_START = time.perf_counter()


def note(msg: str) -> None:
    """A progress line (seconds since the bench started), flushed: a long self-hosted run shows where it is."""
    print(f"[bench.serving {time.perf_counter() - _START:.0f} s] {msg}", flush=True)


def _widest(levels: list[int | None]) -> int | None:
    """The warm-up's concurrency: the widest level of a sweep (None: unlimited)."""
    return None if None in levels else max(levels)


def _jobs(args, vocab: int) -> list[Job]:
    if args.prompts_file:
        return file_jobs(args.prompts_file, args.output_len)[: args.num_prompts]
    return random_jobs(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, args.seed)


if __name__ == "__main__":
    main()
