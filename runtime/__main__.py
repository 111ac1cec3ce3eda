"""`python -m runtime [overrides]`: compose the Hydra config, validate, build, run the workload, report.

Under torchrun (``RANK`` > 0) Hydra writes nothing for this process: no ``.hydra`` folder, no log file, and,
unless ``hydra.run.dir`` is given (then it is rank 0's folder, which only rank 0 writes into), a throw-away run
folder outside the project. Only rank 0 writes the run folder.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import runtime.core.config  # noqa: F401  (registers the schemas in the ConfigStore)
from runtime.app import cli


def _quiet_hydra_for_other_ranks(argv: list[str]) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        return
    argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    if not any(a.startswith("hydra.run.dir=") for a in argv):
        scratch = tempfile.mkdtemp(prefix="mla_runtime_rank")
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
        argv.append(f"hydra.run.dir={scratch}")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    code = cli.run(cfg, Path(HydraConfig.get().runtime.output_dir))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    _quiet_hydra_for_other_ranks(sys.argv)
    main()
