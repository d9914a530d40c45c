"""Progress of long runs: a tqdm bar on a terminal, a plain log line every ``every_s``
seconds otherwise (CI logs, pipes), so stdout stays the command's output."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("tokenlake.progress")


class Progress:
    """``update(done)`` with the number of items done out of ``total``; ``close()`` at the end."""

    def __init__(self, total: int, label: str, stream=None, every_s: float | None = None):
        stream = sys.stderr if stream is None else stream
        self.tty = stream.isatty()
        self.every_s = every_s if every_s is not None else (0.5 if self.tty else 10.0)
        self.total, self.label = total, label
        self.start = self._last = time.perf_counter()
        self.done = 0
        self._logged_done: int | None = None  # done in the last plain line written
        self._bar = None
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, file=stream, mininterval=self.every_s)

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        if self._bar is not None:
            self._bar.update(done - self.done)
            if extra:
                self._bar.set_postfix_str(extra, refresh=False)
            self.done = done
            return
        self.done = done
        now = time.perf_counter()
        if not force and now - self._last < self.every_s:
            return
        self._last, self._logged_done = now, done
        pct = 100.0 * done / self.total if self.total else 100.0
        log.info("%s: %d/%d (%.1f%%) %.1fs %s", self.label, done, self.total, pct,
                 now - self.start, extra)  # fmt: skip

    def close(self, extra: str = "") -> None:
        if self._bar is not None:
            if extra:
                self._bar.set_postfix_str(extra)
            self._bar.close()
            return
        if self._logged_done is not None and (self._logged_done != self.done or extra):
            self.update(self.done, extra, force=True)  # the last line, unless just written
