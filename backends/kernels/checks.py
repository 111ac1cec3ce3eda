"""Argument checks for kernel launchers: unlike ``assert`` they survive ``python -O``."""

from __future__ import annotations


def require(condition: bool, requirement: str) -> None:
    """Raise ValueError naming the requirement a launcher argument broke (what was expected; the fix is to
    pass arguments of that form, as the launcher's docstring gives them)."""
    if not condition:
        raise ValueError(f"kernel launcher argument check failed: expected {requirement}")
