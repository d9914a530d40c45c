"""The discrete-event core: a time-ordered queue of callbacks."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """``at(t, fn)`` runs ``fn()`` at simulated time ``t``; ties run in scheduling order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        if t < self.now:
            raise ValueError(f"t: cannot schedule at {t} before now={self.now}")
        heapq.heappush(self._queue, (t, next(self._seq), fn))

    def run(self, until: float = float("inf")) -> None:
        """Run events up to time ``until`` (inclusive)."""
        while self._queue and self._queue[0][0] <= until:
            t, _, fn = heapq.heappop(self._queue)
            self.now = t
            self.num_events += 1
            fn()

    @property
    def empty(self) -> bool:
        return not self._queue
