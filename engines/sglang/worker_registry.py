"""Which SGLang worker process holds each instance of a shared pool, for the control service
(:mod:`.control_service`), which calls it from its one thread.

* A worker claims its instance with its process id; an instance a live worker holds is refused
  to any other process, by name (two servers given one ``instance_id``).
* A worker that dies (its process is gone) has its iterations in flight aborted (the service's
  callback) and its instance dropped (``Pool.drop_instance``, its engines stopped) as soon as no
  other worker's iteration in flight still reads it; the other workers go on.
* A worker that died, or was refused, can join its instance again without restarting the
  host: a dropped instance comes back empty (fresh engines, ``Pool.restore_instance``). Its
  engines' endpoints change, so :attr:`version` counts restarts, and every worker re-reads the
  endpoints when the version it knows is older (:mod:`.shared_runtime`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from tokenlake.engines.transport.peers import LauncherId
from tokenlake.errors import InvalidArgumentError, IterationStateError


class WorkerRegistry:
    """The workers of ``pool``'s instances (``cluster``: the host's ``MPCluster``)."""

    def __init__(self, pool, cluster, stats: Counter) -> None:
        self.pool, self.cluster, self.stats = pool, cluster, stats
        self.workers: dict[int, LauncherId] = {}
        self.dropping: set[int] = set()
        self.lost: set[int] = set()
        self.version = 0  # instances restarted so far (their engines' endpoints changed)
        self.last_rejoin_s: float | None = None  # the host's side of the last rejoin

    def check_usable(self, instance: int) -> None:
        """An instance requests may address: neither dropped nor being dropped."""
        if instance in self.lost or instance in self.dropping:
            raise InvalidArgumentError(
                f"instance: {instance} was dropped (its worker died); a worker joins it again "
                "with attach"
            )

    def claim(self, instance: int, pid: object) -> None:
        """Process ``pid`` holds ``instance`` from now on, unless another live one does."""
        if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
            raise InvalidArgumentError(f"pid: expected a positive int, got {pid!r}")
        holder = self.workers.get(instance)
        if holder is not None and holder.pid != pid and holder.alive():
            self.stats["refused_live_instance"] += 1
            raise InvalidArgumentError(
                f"instance: {instance} is held by a live worker (pid {holder.pid}); give this "
                "worker another instance_id, or stop that worker first"
            )
        self.workers[instance] = LauncherId.of(pid)

    def leave(self, instance: int, pid: object, abort_plans_of: Callable[[int], None]) -> None:
        """Process ``pid`` gives ``instance`` up (its backend closed; the process may live
        on): what it had in flight is undone; the instance, its data intact, is free."""
        holder = self.workers.get(instance)
        if holder is not None and holder.pid == pid:
            del self.workers[instance]
            abort_plans_of(instance)

    def rejoin(self, instance: int) -> None:
        """Make a dropped ``instance`` usable again, empty, for a worker joining it."""
        if instance in self.dropping:
            raise IterationStateError(
                f"instance: {instance} is still being dropped (another worker's forward reads "
                "it); join again in a moment"
            )
        if instance in self.lost:
            start = time.monotonic()
            self.cluster.restart(instance)
            self.pool.restore_instance(instance)
            self.lost.discard(instance)
            self.version += 1
            self.stats["instances_rejoined"] += 1
            self.last_rejoin_s = time.monotonic() - start

    def watch(self, abort_plans_of: Callable[[int], None]) -> None:
        """Lose every worker whose process is gone; drop what can be dropped now."""
        for instance, who in list(self.workers.items()):
            if not who.alive():
                del self.workers[instance]
                abort_plans_of(instance)
                self.dropping.add(instance)
        for instance in sorted(self.dropping):
            try:
                self.pool.drop_instance(instance)
            except IterationStateError:
                continue  # another worker's forward reads it; try again after its commit
            except InvalidArgumentError:  # the last live instance: nothing left to serve
                self.dropping.discard(instance)
                self.stats["last_instance_lost"] += 1
                continue
            self.dropping.discard(instance)
            self.lost.add(instance)
            self.cluster.mark_lost(instance)
            self.stats["instances_dropped"] += 1
