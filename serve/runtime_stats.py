"""The counters ``/metrics`` reads, snapshotted on the runtime thread.

The pool, the scheduler and the data plane are not thread-safe, so the runtime loop copies
what ``/metrics`` shows into plain values that the scrape thread reads: the pool's counters
after each iteration, after requests end between iterations, and every
``POOL_STATS_PERIOD_S`` while idle (a cancel on an idle server shows at once); the engines'
counters at most every ``ENGINE_STATS_PERIOD_S`` (a round trip to every engine process).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from tokenlake.scheduler import ElasticScheduler

log = logging.getLogger(__name__)
ENGINE_STATS_PERIOD_S = 1.0
POOL_STATS_PERIOD_S = 0.5


class StatsSnapshots:
    """``pool_stats``, ``engine_stats`` and ``num_preemptions`` as of the last refresh.

    ``engine_source``: the data plane's ``engine_stats`` callable, or ``None`` when it has
    none (an in-process cluster without counters)."""

    def __init__(
        self, scheduler: ElasticScheduler, engine_source: Callable[[], dict] | None
    ) -> None:
        self._scheduler = scheduler
        self._engine_source = engine_source
        self.pool_stats: dict = self._pool_snapshot()
        self.engine_stats: dict = {}
        self.num_preemptions = 0
        self._pool_at = time.monotonic()
        self._pool_changed = False
        self._engine_at = -math.inf

    def pool_changed(self) -> None:
        """A request ended outside an iteration: the next :meth:`refresh` takes the pool."""
        self._pool_changed = True

    def after_iteration(self) -> None:
        """An iteration committed: take the pool's counters now."""
        self.pool_stats = self._pool_snapshot()
        self._pool_changed, self._pool_at = False, time.monotonic()

    def refresh(self) -> None:
        """Called by the loop on every turn, busy or idle."""
        now = time.monotonic()
        self.num_preemptions = self._scheduler.num_preemptions
        if self._pool_changed or now - self._pool_at >= POOL_STATS_PERIOD_S:
            self._pool_changed, self._pool_at = False, now
            self.pool_stats = self._pool_snapshot()
        if self._engine_source is None or now - self._engine_at < ENGINE_STATS_PERIOD_S:
            return
        self._engine_at = now
        try:
            self.engine_stats = self._engine_source()
        except Exception as e:  # metrics must never stop serving
            log.warning("runtime: engine stats unavailable: %s", e)

    def _pool_snapshot(self) -> dict:
        pool = self._scheduler.pool
        return {**pool.get_stats(), "free_capacity": pool.free_capacity()}
