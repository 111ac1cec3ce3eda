"""Errors a user or an engine can act on. Each message says what, what we got, what we expected, and the fix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One reason a configuration cannot run."""

    what: str
    got: str
    expected: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: got {self.got}; expected {self.expected}. Fix: {self.fix}"


class ConfigError(ValueError):
    """Raised once, before anything is allocated, with every problem found in the configuration."""

    header = "configuration refused"

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        n = len(self.problems)
        lines = [f"{self.header} ({n} problem{'s' if n != 1 else ''}):"]
        lines += [f"  {i}. {p}" for i, p in enumerate(self.problems, 1)]
        super().__init__("\n".join(lines))


class CheckpointError(ConfigError):
    """A checkpoint folder cannot be served (missing or truncated shard, missing tensor, wrong shape or dtype);
    each problem names the file and the tensor. Raised before any weight is loaded, except for stored values a
    header cannot show (an fp4 scale past what the kernels take), found as their tensor is read."""

    header = "checkpoint refused"


class PoolExhausted(RuntimeError):
    """A KV/request pool cannot satisfy an allocation. The engine catches it and queues or retracts."""

    def __init__(self, pool: str, requested: int, available: int, unit: str):
        self.pool, self.requested, self.available, self.unit = pool, requested, available, unit
        super().__init__(
            f"{pool} exhausted: requested {requested} {unit}, {available} free. "
            f"Fix: finish or retract requests, or raise the pool size (kv.num_pages / kv.max_requests)."
        )


class HookMismatch(TypeError):
    """A backend was given a hook object that does not implement the hook's Protocol."""
