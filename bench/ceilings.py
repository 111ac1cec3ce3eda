"""Hardware ceilings measured in the same run as a benchmark: a thin alias onto :mod:`bench.harness`.

* copy bandwidth: device-to-device ``copy_`` of a 1 GiB buffer; bytes counted = read + write (2x size).
* matmul: bf16 8192 x 8192 x 8192 ``torch.matmul`` on random data; FLOPs = 2 * 8192^3.

New code should call :func:`bench.harness.measure_ceilings` (a :class:`bench.harness.Ceilings`); this module keeps
the dict-returning :func:`measure_ceilings` for benches written against it.
Run standalone: ``python bench/ceilings.py`` or ``python -m bench.ceilings``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root on the path, for `bench.harness`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.harness import copy_bandwidth_gbs, matmul_tflops  # noqa: E402,F401  (re-exported)
from bench.harness import measure_ceilings as _measure  # noqa: E402


def measure_ceilings(device: str | torch.device = "cuda") -> dict:
    """``{"device": name, "copy_gbs": float, "matmul_tflops": float}`` measured now on ``device``."""
    return _measure(device).as_dict()


def main() -> None:
    import argparse

    argparse.ArgumentParser(description="Measure the copy bandwidth and the bf16 matmul rate now.").parse_args()
    print(_measure("cuda").summary())


if __name__ == "__main__":
    main()
