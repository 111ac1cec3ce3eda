"""`python -m runtime [overrides]`: compose the Hydra config, validate, build, run the workload, report."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import runtime.core.config  # noqa: F401  (registers the schemas in the ConfigStore)
from runtime.app import cli


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    code = cli.run(cfg, Path(HydraConfig.get().runtime.output_dir))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
