"""Progress for long checkpoint work: a rich bar, or a caller's callback (the console's).

    with Progress(progress, total_bytes, "synth") as p:
        p.advance(n, "layer 3")

`progress` may be:
- a callable(done, total, label): called instead of drawing a bar (the console uses this);
- None: a rich bar on stderr when stderr is a terminal, nothing otherwise;
- True: always a rich bar (the CLI); False: nothing.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, Optional, Union

ProgressCallback = Callable[[int, int, str], None]
ProgressArg = Union[None, bool, ProgressCallback]


class Progress:
    def __init__(self, progress: ProgressArg, total: int, description: str, *, unit_bytes: bool = True):
        self.total = max(int(total), 1)
        self.done = 0
        self.description = description
        self.label = description
        self._callback: Optional[ProgressCallback] = progress if callable(progress) else None
        self._bar = None
        self._task = None
        self._last_cb = 0.0
        want_bar = progress is True or (progress is None and sys.stderr.isatty())
        if self._callback is None and want_bar:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress as RichProgress,
                                       TextColumn, TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn)

            cols = [TextColumn("[bold]{task.description}"), BarColumn(),
                    *( [DownloadColumn(), TransferSpeedColumn()] if unit_bytes else [MofNCompleteColumn()] ),
                    TimeElapsedColumn(), TimeRemainingColumn()]
            self._bar = RichProgress(*cols, console=Console(stderr=True), transient=False)

    def __enter__(self) -> "Progress":
        if self._bar is not None:
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total)
        self._emit(force=True)
        return self

    def advance(self, n: int, label: str | None = None) -> None:
        self.done = min(self.done + int(n), self.total)
        if label is not None:
            self.label = label
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done,
                             description=f"{self.description} {self.label}" if label else None)
        self._emit()

    def _emit(self, force: bool = False) -> None:
        if self._callback is None:
            return
        now = time.monotonic()
        if force or self.done >= self.total or now - self._last_cb >= 0.05:
            self._last_cb = now
            self._callback(self.done, self.total, self.label)

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.done = self.total
            self._emit(force=True)
        if self._bar is not None:
            if exc_type is None:
                self._bar.update(self._task, completed=self.total)
            self._bar.stop()
