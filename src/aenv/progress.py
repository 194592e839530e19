"""A terminal progress bar for long work (template builds, pulls). Plain lines when not a TTY."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, label: str, total: float = 100.0, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(total, 1e-9)
        self.stream = stream or sys.stderr
        self.done = 0.0
        self.started = time.monotonic()
        self._tty = self.stream.isatty()
        self._last_line_pct = -10

    def update(self, done: float, note: str = "") -> None:
        self.done = min(max(done, self.done), self.total)
        pct = int(100 * self.done / self.total)
        elapsed = time.monotonic() - self.started
        if self._tty:
            width = 30
            fill = int(width * self.done / self.total)
            bar = "#" * fill + "-" * (width - fill)
            self.stream.write(f"\r{self.label} [{bar}] {pct:3d}% {elapsed:5.1f}s {note[:40]:<40}")
            self.stream.flush()
        elif pct >= self._last_line_pct + 10:
            self._last_line_pct = pct - pct % 10
            self.stream.write(f"{self.label}: {pct}% ({elapsed:.1f}s) {note}\n")
            self.stream.flush()

    def finish(self, note: str = "done") -> None:
        self.update(self.total, note)
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()
