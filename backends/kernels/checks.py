"""What kernel launchers check: their arguments (unlike ``assert``, :func:`require` survives ``python -O``), and
whether a kernel runs in Triton's CPU interpreter."""

from __future__ import annotations


def require(condition: bool, requirement: str) -> None:
    """Raise ValueError naming the requirement a launcher argument broke (what was expected; the fix is to
    pass arguments of that form, as the launcher's docstring gives them)."""
    if not condition:
        raise ValueError(f"kernel launcher argument check failed: expected {requirement}")


def interpreted(kernel) -> bool:
    """Whether a ``@triton.jit`` kernel was built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` when it was
    decorated): launchers then pick interpreter-friendly tiles and skip GPU-only paths."""
    return kernel.__class__.__name__ == "InterpretedFunction"
