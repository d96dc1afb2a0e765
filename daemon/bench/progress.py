"""The progress line of the long benchmarks (``bench serve``: requests, ``bench sweep``: cells):
``label: done/total`` redrawn in place on stderr.

Invariants: nothing of the line is written unless the stream is a TTY, so logs, pipes and
captured output see only the benchmarks' own lines; a line printed through ``note`` while the
count is shown lands above it, never inside it.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_S = 0.1  # at most ten redraws a second; the last count is always drawn
CLEAR = "\r\x1b[K"


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.shown = self.stream.isatty()
        self.label = label
        self.total = total
        self.done = 0
        self._drawn_at = -REDRAW_S
        self._draw()

    def advance(self, count: int = 1) -> None:
        self.done += count
        if self.done >= self.total or time.monotonic() - self._drawn_at >= REDRAW_S:
            self._draw()

    def note(self, line: str) -> None:
        """Print ``line`` on the stream (TTY or not), the count redrawn below it."""
        self.stream.write((CLEAR if self.shown else "") + line + "\n")
        self.stream.flush()
        self._draw()

    def close(self) -> None:
        """End the count's line; the stream is left at the start of a fresh line."""
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False

    def _draw(self) -> None:
        if self.shown:
            self.stream.write(f"{CLEAR}{self.label}: {self.done}/{self.total}")
            self.stream.flush()
            self._drawn_at = time.monotonic()
