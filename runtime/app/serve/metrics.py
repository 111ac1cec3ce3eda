"""Prometheus metrics of the server (``GET /metrics``), in a registry of its own per server.

Gauges are read when scraped (running / queued requests, KV pages used / free); counters and histograms are
fed by the engine thread (:class:`~runtime.engine.live.Observer`) and the HTTP handlers (rejections, aborts).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "mla"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)


class Metrics:
    """The server's metrics; ``live`` is the LiveEngine whose state the gauges read."""

    def __init__(self, live=None):
        self.registry = r = CollectorRegistry()
        self.running = Gauge(f"{PREFIX}_requests_running", "requests in the engine's batch", registry=r)
        self.queued = Gauge(f"{PREFIX}_requests_queued", "requests waiting for the engine", registry=r)
        self.pages_free = Gauge(f"{PREFIX}_kv_pages_free", "free KV pages", registry=r)
        self.pages_used = Gauge(f"{PREFIX}_kv_pages_used", "KV pages held by requests", registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", "tokens generated and sent", registry=r)
        self.requests = Counter(f"{PREFIX}_requests", "requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter(f"{PREFIX}_requests_rejected", "requests refused before the engine, by HTTP status",
                                ["status"], registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", "time between tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.steps = Counter(f"{PREFIX}_engine_steps", "forwards the engine launched, by phase", ["phase"],
                             registry=r)
        self.step_requests = Counter(f"{PREFIX}_engine_step_requests", "requests in those forwards (batch sizes "
                                     "summed), by phase", ["phase"], registry=r)
        self.step_tokens = Counter(f"{PREFIX}_engine_step_tokens", "tokens those forwards processed, by phase",
                                   ["phase"], registry=r)
        self.step_seconds = Histogram(f"{PREFIX}_engine_step_seconds", "device time of those forwards (start to end "
                                      "event), by phase", ["phase"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        if live is not None:
            self.running.set_function(lambda: live.running)
            self.queued.set_function(lambda: live.queued)
            self.pages_free.set_function(lambda: live.pages[0])
            self.pages_used.set_function(lambda: live.pages[1] - live.pages[0])

    # --- Observer (engine thread)
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, n: int) -> None:
        for _ in range(n):
            self.itl.observe(seconds)

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.e2e.observe(seconds)

    def step(self, phase: str, requests: int, tokens: int) -> None:
        self.steps.labels(phase).inc()
        self.step_requests.labels(phase).inc(requests)
        self.step_tokens.labels(phase).inc(tokens)

    def step_time(self, phase: str, seconds: float) -> None:
        self.step_seconds.labels(phase).observe(seconds)

    # --- handlers
    def aborted(self, completion_tokens: int) -> None:
        self.requests.labels("abort").inc()
        self.generation_tokens.inc(completion_tokens)

    def reject(self, status: int) -> None:
        self.rejected.labels(str(status)).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
