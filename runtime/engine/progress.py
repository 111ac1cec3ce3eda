"""A progress bar over generated tokens: rich on a terminal, silent otherwise."""

from __future__ import annotations

import sys

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total: int, enabled: bool):
        self._bar = None
        if enabled and sys.stdout.isatty():
            self._bar = RichProgress(
                TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), transient=True
            )
            self._task = self._bar.add_task("tokens", total=total)

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def advance(self, n: int) -> None:
        if self._bar is not None and n:
            self._bar.advance(self._task, n)
