"""The iterations in flight: epochs handed out, each iteration by epoch in planning order,
and which request each one holds."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from tokenlake.errors import StalePlanError
from tokenlake.iteration.record import Iteration
from tokenlake.plans import Plans
from tokenlake.validate import fail


class InFlight:
    """Iterations between ``gen_plans`` and ``commit``/``abort`` of the pool ``pool_id``."""

    def __init__(self, pool_id: str) -> None:
        self.pool_id = pool_id
        self.last_epoch = 0  # the last epoch handed out; epochs are never reused
        self._by_epoch: dict[int, Iteration] = {}  # in planning order
        self._epoch_of: dict[int | str, int] = {}  # request id -> epoch in flight
        self._busy: frozenset[int] | None = frozenset()  # None: to recompute (read per plan)

    def __iter__(self) -> Iterator[Iteration]:
        return iter(self._by_epoch.values())

    def __len__(self) -> int:
        return len(self._by_epoch)

    def __contains__(self, epoch: object) -> bool:
        return epoch in self._by_epoch

    @property
    def epochs(self) -> tuple[int, ...]:
        """Oldest first."""
        return tuple(self._by_epoch)

    @property
    def newest(self) -> int | None:
        return next(reversed(self._by_epoch), None)

    @property
    def busy_requests(self) -> Mapping[int | str, int]:
        """Request id -> the epoch in flight that holds it (read-only view)."""
        return self._epoch_of

    @property
    def busy_instances(self) -> frozenset[int]:
        """Compute instances running an iteration in flight (its sub-batches' origins)."""
        if self._busy is None:
            self._busy = frozenset(i for it in self._by_epoch.values() for i in it.origins)
        return self._busy

    @property
    def deciding_replication(self) -> bool:
        """Whether an iteration in flight carries a replication decision."""
        return any(it.decided_replication for it in self._by_epoch.values())

    def next_epoch(self) -> int:
        return self.last_epoch + 1

    def add(self, it: Iteration) -> None:
        self.last_epoch = it.epoch
        self._by_epoch[it.epoch] = it
        self._busy = None
        self._epoch_of.update(dict.fromkeys(it.chunk_set.request_ids, it.epoch))

    def take(self, plans: Plans) -> Iteration:
        """The iteration ``plans`` belong to, removed from the set; the very Plans object
        ``gen_plans`` returned, or :class:`StalePlanError`."""
        if not isinstance(plans, Plans):
            raise fail("plans", "a Plans returned by this pool's gen_plans", plans)
        if plans.pool_id != self.pool_id:
            raise StalePlanError(
                f"plans: made by another pool ({plans.pool_id or 'none'}), not this one"
            )
        it = self._by_epoch.get(plans.epoch)
        if it is None:
            raise StalePlanError(
                f"plans: epoch {plans.epoch} is not in flight (in flight: {self.epochs})"
            )
        if it.plans is not plans:
            raise StalePlanError(
                f"plans: not the Plans object gen_plans returned for epoch {plans.epoch}"
            )
        del self._by_epoch[plans.epoch]
        self._busy = None
        for rid in it.chunk_set.request_ids:
            del self._epoch_of[rid]
        return it

    def using(self, instance_id: int, lost_keys: set[int], lost_rows: np.ndarray) -> list[int]:
        """Epochs that run on, read or write ``instance_id``, or pin a segment in ``lost_keys``
        or read one of ``lost_rows`` (the table rows of those segments)."""
        return [
            it.epoch
            for it in self._by_epoch.values()
            if instance_id in it.instances
            or any(n.key in lost_keys for n in it.pinned_nodes())
            or np.isin(it.all_read_idx(), lost_rows).any()
        ]

    def total_load(self, base: np.ndarray) -> np.ndarray:
        """``base`` plus the load every iteration in flight puts on each instance (a copy)."""
        load = base.copy()
        for it in self._by_epoch.values():
            load += it.traffic.load
        return load
