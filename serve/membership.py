"""Instance membership at serving time: an engine that died is dropped from the pool and the
data plane, and the running requests whose KV was only there are recomputed; an engine that
rejoined is given back to the pool, empty."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from tokenlake.engines.model.engine import ModelEngine
from tokenlake.scheduler import ElasticScheduler

log = logging.getLogger(__name__)


class Membership:
    """Applies instance losses and rejoins for the runtime loop (on its thread).

    ``end_all(error)`` ends every live request with ``error`` (when the last live instance
    died); ``counters`` counts ``instance_failures``, ``instances_rejoined`` and
    ``recomputed_requests``.
    """

    def __init__(
        self,
        scheduler: ElasticScheduler,
        engine: ModelEngine,
        counters: collections.Counter,
        end_all: Callable[[str], None],
    ) -> None:
        self.scheduler, self.engine, self.counters = scheduler, engine, counters
        self._end_all = end_all

    def poll(self) -> None:
        """Apply the engine's news (a distributed engine reports dead and rejoined instances;
        a local one has none)."""
        changes = getattr(self.engine, "membership_changes", None)
        for instance_id, alive in changes() if changes is not None else ():
            if not alive:
                self.fail_over(instance_id)
            elif instance_id not in self.scheduler.pool.live_instances:
                self.scheduler.pool.restore_instance(instance_id)
                self.counters["instances_rejoined"] += 1
                log.info("runtime: instance %d rejoined", instance_id)

    def fail_over(self, instance_id: int) -> None:
        """An instance died (no iteration in flight): drop it from the pool and the engine;
        running requests whose KV was only there are recomputed from what is still cached
        (their streams go on: a recomputed request yields the token it would have)."""
        pool = self.scheduler.pool
        if instance_id not in pool.live_instances:
            return
        self.counters["instance_failures"] += 1
        if len(pool.live_instances) == 1:  # nothing left to serve on
            log.error("runtime: the last live instance %d failed", instance_id)
            self._end_all(f"instance {instance_id} failed")
            return
        failed = pool.drop_instance(instance_id)
        self.engine.mark_lost(instance_id)
        for rid in failed:
            self.scheduler.preempt(rid)
        self.counters["recomputed_requests"] += len(failed)
        log.warning("runtime: instance %d lost; %d requests recomputed", instance_id, len(failed))
