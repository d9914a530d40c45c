"""Instance membership at serving time: an engine that died is dropped from the pool and the
data plane, and the running requests whose KV was only there are recomputed; the instance
is then restarted (when the engine can restart it) and given back to the pool, empty.

A death is seen whichever role it struck and whatever the loop was doing: between
iterations by the engine's own report (``membership_changes``: processes read from
``/proc``), and by an iteration or a retire that failed because of it, whether the error
names the dead peer (``PeerFailedError``) or comes back from a compute process that met it
(``RemoteEngineError``): any engine error is checked against the engine's report first."""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

from tokenlake.engines.dataplane_config import PeerFailedError
from tokenlake.scheduler import ElasticScheduler

log = logging.getLogger(__name__)
# after a loss, how long an engine error waits for the dead process to show in /proc (a
# compute process may report its peer's death a moment before the kernel has reaped it)
DEATH_SETTLE_S = 0.5
# after a loss, the recomputed requests run on the survivors first; then the instance restarts
REJOIN_DELAY_S = 0.5


class Membership:
    """Applies instance losses and rejoins for the runtime loop (on its thread).

    ``engine`` reports deaths and rejoins with ``membership_changes()`` (``[(instance_id,
    alive), ...]``), drops an instance with ``mark_lost(i)`` and, if it can, brings one back
    with ``restart_instance(i)`` (else rejoins arrive as ``(i, True)`` news, as in the Ray
    launch). ``end_all(error)`` ends every live request with ``error`` (when the last live
    instance died); ``counters`` counts ``instance_failures``, ``instances_rejoined`` and
    ``recomputed_requests``.
    """

    def __init__(
        self,
        scheduler: ElasticScheduler,
        engine,
        counters: collections.Counter,
        end_all: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler, self.engine, self.counters = scheduler, engine, counters
        self._end_all = end_all
        self._clock = clock
        self._lost_at: dict[int, float] = {}  # instances to restart here, since when

    def poll(self) -> None:
        """Apply the engine's news, then restart the instances lost long enough ago. Never
        raises: what fails here is seen again at the next poll."""
        try:
            for instance_id in sorted(self._news()):
                self.fail_over(instance_id)
            self._rejoin_due()
        except Exception:
            log.exception("runtime: applying membership changes failed")

    def after_error(self, error: Exception) -> bool:
        """An iteration or retire failed with ``error`` (nothing in flight now): fail over
        the instances whose death explains it. Returns whether any was found (the caller's
        requests are then recomputed); ``False``: the error is the engine's own."""
        dead = set()
        if isinstance(error, PeerFailedError):
            dead.add(error.instance_id)
        deadline = self._clock() + DEATH_SETTLE_S
        while True:
            try:
                dead |= self._news()
            except Exception:
                log.exception("runtime: reading membership changes failed")
            dead &= set(self.scheduler.pool.live_instances)
            if dead or self._clock() >= deadline:
                break
            time.sleep(0.01)
        for instance_id in sorted(dead):
            try:
                self.fail_over(instance_id)
            except Exception:
                log.exception("runtime: failing over instance %d failed", instance_id)
        return bool(dead)

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
        for rid in failed:
            self.scheduler.preempt(rid)
        self.counters["recomputed_requests"] += len(failed)
        if hasattr(self.engine, "restart_instance"):
            self._lost_at[instance_id] = self._clock()
        log.warning("runtime: instance %d lost; %d requests recomputed", instance_id, len(failed))
        self.engine.mark_lost(instance_id)

    def _news(self) -> set[int]:
        """The live instances the engine found dead; rejoins it reports are applied here."""
        changes = getattr(self.engine, "membership_changes", None)
        dead = set()
        for instance_id, alive in changes() if changes is not None else ():
            if not alive:
                dead.add(instance_id)
            elif instance_id not in self.scheduler.pool.live_instances:
                self._restore(instance_id)
        return dead & set(self.scheduler.pool.live_instances)

    def _rejoin_due(self) -> None:
        now = self._clock()
        for instance_id, lost_at in sorted(self._lost_at.items()):
            if now - lost_at < REJOIN_DELAY_S:
                continue
            try:
                self.engine.restart_instance(instance_id)
            except Exception as e:  # tried again later
                log.warning("runtime: restarting instance %d failed: %s", instance_id, e)
                self._lost_at[instance_id] = self._clock()
                continue
            del self._lost_at[instance_id]
            self._restore(instance_id)

    def _restore(self, instance_id: int) -> None:
        self.scheduler.pool.restore_instance(instance_id)
        self.counters["instances_rejoined"] += 1
        log.info("runtime: instance %d rejoined", instance_id)
