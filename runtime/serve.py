"""`python -m runtime.serve [overrides]`: the OpenAI-compatible HTTP server (docs/serving.md).

The same Hydra config as `python -m runtime`, plus the `serve` group (`serve.host`, `serve.port`,
`serve.max_queued_requests`, `serve.api_key`, `serve.served_model_name`). Needs the `serve` extra:
`pip install -e '.[serve]'`. The scheduler limits (running requests, tokens per batch, chunked prefill) come from the
`workload` group as offline; without a `workload=` override the server takes `workload=chat` (64 running requests,
8192 tokens per batch) instead of the batch runs' `smoke` (4 running).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

import runtime.core.config  # noqa: F401  (registers the schemas in the ConfigStore)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        from runtime.app.serve import server
    except ImportError as e:
        print(f"python -m runtime.serve needs the server's packages ({e.name} is missing). "
              "Fix: pip install -e '.[serve]'", file=sys.stderr)
        sys.exit(2)
    code = server.main(cfg)
    if code:
        sys.exit(code)


def serving_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` with ``workload=chat`` appended when none of them picks a workload (the server's scheduler
    limits; the batch runs' default ``smoke`` runs 4 requests at a time)."""
    if any(a.startswith(("workload=", "+workload=")) for a in overrides):
        return list(overrides)
    return [*overrides, "workload=chat"]


if __name__ == "__main__":
    sys.argv[1:] = serving_overrides(sys.argv[1:])
    main()
