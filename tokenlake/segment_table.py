"""Per-segment numeric state in flat arrays indexed by ``Node.idx``.

Plan building gathers every prefix page of every request with one numpy indexing op instead
of walking Python objects; the prefix tree keeps these arrays in step with its nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenlake.errors import InvalidArgumentError


class SegmentTable:
    """``rep_inst[idx, r]`` / ``rep_slot[idx, r]``: replica ``r`` of segment ``idx`` (``-1``
    past ``num_replicas[idx]``); ``access[idx]``: its decayed access count, scaled (see
    :class:`tokenlake.balancer.AccessStats`)."""

    def __init__(self, max_replicas: int, capacity: int = 1024) -> None:
        if max_replicas < 1:
            raise InvalidArgumentError(f"max_replicas: expected >= 1, got {max_replicas}")
        self.max_replicas = max_replicas
        self.rep_inst = np.full((capacity, max_replicas), -1, dtype=np.int32)
        self.rep_slot = np.full((capacity, max_replicas), -1, dtype=np.int32)
        self.num_replicas = np.zeros(capacity, dtype=np.int32)
        self.access = np.zeros(capacity, dtype=np.float64)
        self._free = list(range(capacity - 1, -1, -1))
        self._live = np.zeros(capacity, dtype=bool)

    @property
    def capacity(self) -> int:
        return len(self.num_replicas)

    @property
    def num_live(self) -> int:
        return int(self._live.sum())

    def alloc(self) -> int:
        if not self._free:
            self._grow()
        idx = self._free.pop()
        self._live[idx] = True
        self.num_replicas[idx] = 0
        self.access[idx] = 0.0
        self.rep_inst[idx] = -1
        self.rep_slot[idx] = -1
        return idx

    def free(self, idx: int) -> None:
        if not self._live[idx]:
            raise InvalidArgumentError(f"idx: segment {idx} is not allocated")
        self._live[idx] = False
        self.num_replicas[idx] = 0
        self._free.append(idx)

    def set_replicas(self, idx: int, replicas: Sequence[tuple[int, int]]) -> None:
        n = len(replicas)
        if n > self.max_replicas:
            raise InvalidArgumentError(f"replicas: at most {self.max_replicas}, got {n}")
        self.num_replicas[idx] = n
        self.rep_inst[idx] = -1
        self.rep_slot[idx] = -1
        for r, (instance_id, slot_id) in enumerate(replicas):
            self.rep_inst[idx, r] = instance_id
            self.rep_slot[idx, r] = slot_id

    def _grow(self) -> None:
        old = self.capacity
        new = old * 2
        self.rep_inst = np.concatenate([self.rep_inst, np.full_like(self.rep_inst, -1)])
        self.rep_slot = np.concatenate([self.rep_slot, np.full_like(self.rep_slot, -1)])
        self.num_replicas = np.concatenate([self.num_replicas, np.zeros(old, dtype=np.int32)])
        self.access = np.concatenate([self.access, np.zeros(old)])
        self._live = np.concatenate([self._live, np.zeros(old, dtype=bool)])
        self._free.extend(range(new - 1, old - 1, -1))
