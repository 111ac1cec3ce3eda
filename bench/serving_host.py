"""The self-hosted server of ``python -m bench.serving --serve``: ``python -m runtime.serve`` in its own process.

A deployment runs the server alone in its process; a load generator in the same interpreter would share its GIL
with the engine thread and the HTTP thread, and its SSE parsing of every streamed chunk would be charged to the
server (``sglang.bench_serving`` is a separate process too). ``--in-process`` keeps the thread-hosted server of
:class:`runtime.app.serve.server.Background` (no process start-up; the tests' quick path).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (bound and released: the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m runtime.serve OVERRIDES serve.host=127.0.0.1 serve.port=P`` started on entry and stopped on exit;
    ready once ``GET /health`` answers. Its log (and Hydra's run folder) is ``run_dir`` or a temporary folder, whose
    last lines are in the error when the server exits or does not answer within ``timeout`` seconds."""

    def __init__(self, overrides: list[str], timeout: float = 900.0, python: str = sys.executable,
                 run_dir: str | Path | None = None):
        self.overrides, self.timeout, self.python = list(overrides), timeout, python
        self.run_dir = run_dir  # the log's folder (default: a new temporary one)
        self.url = self.model = ""

    def __enter__(self) -> ServerProcess:
        import httpx

        self.dir = Path(self.run_dir) if self.run_dir else Path(tempfile.mkdtemp(prefix="bench_serving_"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log = self.dir / "server.log"
        port = free_port()
        cmd = [self.python, "-m", "runtime.serve", *self.overrides, "serve.host=127.0.0.1", f"serve.port={port}",
               f"hydra.run.dir={self.dir}", "progress=false"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=Path(__file__).resolve().parents[1])
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before answering:\n{self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"the server did not answer /health within {self.timeout:.0f} s:\n{self._tail()}")
            time.sleep(0.25)
        self.model = httpx.get(f"{self.url}/v1/models", timeout=10.0).json()["data"][0]["id"]
        return self

    def _tail(self, lines: int = 30) -> str:
        text = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(text[-lines:]) + f"\n(log: {self.log})"

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # uvicorn shuts down on SIGTERM, the engine thread with it
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
