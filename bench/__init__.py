"""Benchmarks (GPU): each runs as ``python -m bench.<name>`` (or ``python bench/<name>.py``) on one harness,
:mod:`bench.harness`, and ends with a result table and a ``BENCH_JSON`` line. ``python -m bench.run_all --quick``
runs them all."""
