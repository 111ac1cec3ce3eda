"""What kernel launchers check: their arguments (unlike ``assert``, :func:`require` survives ``python -O``), and
whether a kernel runs in Triton's CPU interpreter."""

from __future__ import annotations

from collections.abc import Callable


def require(condition: bool, requirement: str | Callable[[], str]) -> None:
    """Raise ValueError naming the requirement a launcher argument broke (what was expected; the fix is to
    pass arguments of that form, as the launcher's docstring gives them).

    ``requirement`` may be a function returning the text, called only when the check fails: the launchers on a
    prefill's path pass ``lambda: f"..."``, since formatting shapes and dtypes into every message costs ~2 µs a
    check on the host (a 16-layer eager prefill runs several hundred checks, and below ~4096 tokens it waits on
    the host)."""
    if not condition:
        text = requirement() if callable(requirement) else requirement
        raise ValueError(f"kernel launcher argument check failed: expected {text}")


def interpreted(kernel) -> bool:
    """Whether a ``@triton.jit`` kernel was built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` when it was
    decorated): launchers then pick interpreter-friendly tiles and skip GPU-only paths."""
    return kernel.__class__.__name__ == "InterpretedFunction"
