"""What `python -m runtime.serve` does: compose, validate (the runtime's checks and the server's), build the
runtime, start the engine thread, and serve HTTP with uvicorn until interrupted.

One engine per process. Refused: ``parallel.tp`` > 1 (ranks stepping together behind one HTTP front is not built)
and speculative decoding (its rounds accept greedily; sampled requests would need a sampled verify).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from containers import build, to_plain
from runtime.app.serve.app import ServeState, create_app
from runtime.app.serve.chat import ChatTemplate, template_folders
from runtime.app.serve.metrics import Metrics
from runtime.app.serve.protocol import Limits
from runtime.core.errors import ConfigError, Problem
from runtime.engine.live import LiveEngine


def serve_problems(plain: dict) -> list[Problem]:
    """Everything in the config that the server cannot run (besides what `build` checks)."""
    out = []
    s = plain["serve"]
    if not 0 <= s["port"] <= 65535:
        out.append(Problem("serve.port", str(s["port"]), "a TCP port in [0, 65535] (0: any free port)", "serve.port=8000"))
    if s["max_queued_requests"] < 1:
        out.append(Problem("serve.max_queued_requests", str(s["max_queued_requests"]), "an integer >= 1",
                           "serve.max_queued_requests=256"))
    if plain["parallel"]["tp"] != 1:
        out.append(Problem("parallel.tp", str(plain["parallel"]["tp"]), "1 (the server runs one engine, one rank)",
                           "parallel.tp=1; tensor-parallel serving is not built yet"))
    if plain["speculative"]["enabled"]:
        out.append(Problem("speculative.enabled", "true", "false (speculative rounds accept greedily; sampled "
                           "requests need a sampled verify, not built)", "speculative=off"))
    if s["api_key"] is not None and not str(s["api_key"]).strip():
        out.append(Problem("serve.api_key", "an empty key", "a non-empty key, or null (no key)", "serve.api_key=null"))
    return out


@dataclass
class Server:
    """A built server: its state (engine thread started) and the FastAPI app."""

    state: ServeState
    app: object
    host: str
    port: int

    def close(self) -> None:
        self.state.live.stop()


def make_server(cfg: DictConfig | dict) -> Server:
    """Validate, build the runtime and the app, start the engine thread. Raises ConfigError with every problem."""
    plain = to_plain(cfg)
    if plain["workload"]["kind"] == "synthetic":  # its requests are not served, only its scheduler limits are used:
        one = {"dist": "fixed", "mean": 1, "std": 0, "min": 1, "max": 1}  # validation then checks what is served
        plain["workload"] = {**plain["workload"], "num_requests": 1, "prompt_len": one, "output_len": one}
    problems = serve_problems(plain)
    if problems:
        raise ConfigError(problems)
    runtime = build(plain)
    engine = runtime.engine
    work, model = plain["workload"], plain["model"]
    tokenizer = engine.requests.tokenizer
    live = LiveEngine(engine, tokenizer, engine.requests.eos_ids, plain["serve"]["max_queued_requests"])
    metrics = Metrics(live)
    live.observer = metrics
    pages = engine.slots.pages
    limits = Limits(model["vocab_size"], model["max_context"], pages.capacity * pages.page_size, pages.page_size)
    chat = ChatTemplate.load(template_folders(model.get("path"), work.get("tokenizer")))
    name = plain["serve"]["served_model_name"] or (Path(model["path"]).name if model.get("path") else model["name"])
    state = ServeState(live, tokenizer, chat, limits, metrics, name, plain["serve"]["api_key"])
    live.start()
    return Server(state, create_app(state), plain["serve"]["host"], plain["serve"]["port"])


class Background:
    """uvicorn serving ``server`` on a thread (tests, the benchmark's self-hosted mode); ``port`` is the bound one."""

    def __init__(self, server: Server, port: int | None = None):
        import uvicorn

        self.server = server
        config = uvicorn.Config(server.app, host=server.host, port=server.port if port is None else port,
                                log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, name="uvicorn", daemon=True)

    def __enter__(self) -> Background:
        self.thread.start()
        while not self.uvicorn.started:
            if not self.thread.is_alive():
                raise RuntimeError("the HTTP server did not start (see the log above)")
            self.thread.join(0.02)
        sock = self.uvicorn.servers[0].sockets[0]
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.server.host}:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.server.close()


def main(cfg: DictConfig) -> int:
    try:
        server = make_server(cfg)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    import uvicorn

    print(f"serving {server.state.model_name} on http://{server.host}:{server.port} (OpenAI API: /v1/completions, "
          "/v1/chat/completions, /v1/models; /health, /metrics)", flush=True)
    try:
        uvicorn.run(server.app, host=server.host, port=server.port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        server.close()
    return 0
