"""Hydra composition for the engine benches (bench_engine_decode, profile_engine_step, bench_speculative,
decode_roofline, host_step), and the decode-step periods of a run."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import runtime.core.config  # noqa: F401  (registers the config schemas)

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def compose_config(overrides: list[str]) -> DictConfig:
    """The project's ``config`` composed with ``overrides`` (Hydra override strings)."""
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=overrides)


def fixed_workload(num_requests: int, prompt: int, out_len: int) -> list[str]:
    """Overrides for ``num_requests`` requests, all running at once, of ``prompt`` prompt tokens and ``out_len``
    output tokens each (fixed lengths)."""
    out = [f"workload.num_requests={num_requests}", f"workload.max_running_requests={num_requests}"]
    for key, n in (("prompt_len", prompt), ("output_len", out_len)):
        out += [f"workload.{key}.dist=fixed", f"workload.{key}.mean={n}", f"workload.{key}.min={n}",
                f"workload.{key}.max={n}"]
    return out


def preset_overrides(preset: str, batch: int, layers: int, prompt: int, out_len: int) -> list[str]:
    """A ``+deploy`` preset cut to ``layers`` layers, serving ``batch`` requests of fixed lengths all at once,
    decode graphs captured for exactly ``batch``, a KV pool (64-token pages) that holds them, no checks or
    progress bar: the real-model runs of decode_roofline and host_step."""
    pages = batch * -(-(prompt + out_len + 1) // 64) + 16
    return [f"+deploy={preset}", "check=off", "progress=false", f"model.num_layers={layers}",
            *fixed_workload(batch, prompt, out_len), f"kv.num_pages={pages}", f"kv.max_requests={max(batch, 8)}",
            f"graph.batch_sizes=[{batch}]"]


def decode_periods_us(res, batch: int) -> list[float]:
    """Start-to-start periods (µs) of a run's consecutive decode steps of ``batch`` requests: from their CUDA event
    marks on a GPU (the GPU's period; waits for the device), from the host clock on the CPU."""
    starts = [s.marks[0] for s in res.steps if s.phase == "decode" and s.batch_size == batch]
    if res.gpu_marks:
        import torch

        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e3 for a, b in zip(starts[:-1], starts[1:])]
    return [(b - a) * 1e6 for a, b in zip(starts[:-1], starts[1:])]
