"""Minimal progress line for long runs (no extra dependency)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Redraws one line on a terminal; writes a line every ``every_s`` seconds to a log."""

    def __init__(self, total: int, label: str, stream=sys.stderr, every_s: float | None = None):
        self.tty = stream.isatty()
        self.every_s = every_s if every_s is not None else (0.5 if self.tty else 10.0)
        self.total, self.label, self.stream = total, label, stream
        self.start = self._last = time.perf_counter()
        self.done = 0

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        self.done = done
        now = time.perf_counter()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        pct = 100.0 * done / self.total if self.total else 100.0
        line = f"{self.label}: {done}/{self.total} ({pct:5.1f}%) {now - self.start:6.1f}s {extra}"
        self.stream.write("\r" + line if self.tty else line + "\n")
        self.stream.flush()

    def close(self, extra: str = "") -> None:
        self.update(self.done, extra, force=True)
        if self.tty:
            self.stream.write("\n")
