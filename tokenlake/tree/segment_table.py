"""Per-segment state in flat arrays indexed by ``Node.idx``: the one place replicas, pins,
in-flight readers and access counts live.

Plan building gathers every prefix page of every request with one numpy indexing op instead
of walking Python objects, and an iteration registers its readers with one vectorized update;
:class:`tokenlake.tree.node.Node` reads its replicas and pins from here.

**Evictable replicas.** ``num_evictable`` counts the replicas that repeated LRU eviction can
free without touching anything in use: every replica of a row in the tree, except none of a
row an in-flight iteration reads (``readers > 0``) and except the last copy of a pinned row.
It is exact because "pinned or read" is closed under ancestors (a request pins and reads
its whole prefix, a copy-on-extend source is pinned with its path, a replication source is
read with its whole path), so a row neither pinned nor read never has a pinned or read
descendant, and its whole subtree can go leaf by leaf.

**The host tier.** ``tier_block[idx]`` is the host-tier block of a segment evicted from the
pool into the tier (``-1``: none), ``tier_ready[idx]`` whether its copy there is complete
(a demotion's copy runs with the iteration that evicted it). Such a row has no replica; see
:mod:`tokenlake.tree.host_tier`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenlake import _C
from tokenlake.errors import InvalidArgumentError


class SegmentTable:
    """``rep_inst[idx, r]`` / ``rep_slot[idx, r]``: replica ``r`` of segment ``idx`` (``-1``
    past ``num_replicas[idx]``); ``pins[idx]``: running requests pinning it;
    ``readers[idx]``: in-flight iterations reading it; ``access[idx] / access_scale``: its
    decayed access count (see :class:`tokenlake.cluster.balancer.AccessStats`)."""

    def __init__(self, max_replicas: int, capacity: int = 1024) -> None:
        if max_replicas < 1:
            raise InvalidArgumentError(f"max_replicas: expected >= 1, got {max_replicas}")
        self.max_replicas = max_replicas
        self.rep_inst = np.full((capacity, max_replicas), -1, dtype=np.int32)
        self.rep_slot = np.full((capacity, max_replicas), -1, dtype=np.int32)
        self.num_replicas = np.zeros(capacity, dtype=np.int32)
        self.pins = np.zeros(capacity, dtype=np.int32)
        self.readers = np.zeros(capacity, dtype=np.int32)
        self.in_tree = np.zeros(capacity, dtype=bool)  # private rows never count as evictable
        self.evictable = np.zeros(capacity, dtype=np.int32)  # this row's share of num_evictable
        self.access = np.zeros(capacity, dtype=np.float64)
        self.tier_block = np.full(capacity, -1, dtype=np.int32)
        self.tier_ready = np.zeros(capacity, dtype=bool)
        self.access_scale = 1.0
        self.num_evictable = 0
        self._free = list(range(capacity - 1, -1, -1))
        self._live = np.zeros(capacity, dtype=bool)

    @property
    def capacity(self) -> int:
        return len(self.num_replicas)

    @property
    def num_live(self) -> int:
        return int(self._live.sum())

    def is_live(self, idx: int) -> bool:
        return 0 <= idx < self.capacity and bool(self._live[idx])

    def alloc(self, in_tree: bool) -> int:
        if not self._free:
            self._grow()
        idx = self._free.pop()
        self._live[idx] = True
        self.in_tree[idx] = in_tree
        self.num_replicas[idx] = 0
        self.pins[idx] = 0
        self.readers[idx] = 0
        self.evictable[idx] = 0
        self.access[idx] = 0.0
        self.tier_block[idx] = -1
        self.tier_ready[idx] = False
        self.rep_inst[idx] = -1
        self.rep_slot[idx] = -1
        return idx

    def free(self, idx: int) -> None:
        if not self._live[idx]:
            raise InvalidArgumentError(f"idx: segment {idx} is not allocated")
        if self.pins[idx] or self.readers[idx]:
            raise InvalidArgumentError(f"idx: segment {idx} is pinned or read")
        if self.tier_block[idx] >= 0:
            raise InvalidArgumentError(f"idx: segment {idx} still holds a host-tier block")
        self.num_evictable -= int(self.evictable[idx])
        self._live[idx] = False
        self.in_tree[idx] = False
        self.num_replicas[idx] = 0
        self.evictable[idx] = 0
        self._free.append(idx)

    # ---- replicas --------------------------------------------------------------------------
    def replicas(self, idx: int) -> list[tuple[int, int]]:
        n = int(self.num_replicas[idx])
        return list(
            zip(self.rep_inst[idx, :n].tolist(), self.rep_slot[idx, :n].tolist(), strict=True)
        )

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
        self.refresh(idx)

    # ---- pins and readers --------------------------------------------------------------------
    def pin(self, idx: int, delta: int) -> None:
        self.pins[idx] += delta
        self.refresh(idx)

    def add_readers(self, idx: np.ndarray, delta: int) -> None:
        """Every row in ``idx`` (int64, repeats allowed) gains ``delta`` readers per
        occurrence; their evictable shares follow (one C++ pass)."""
        self.num_evictable += _C.add_readers(
            idx, delta, self.readers, self.evictable, self.pins, self.num_replicas, self.in_tree
        )

    def refresh(self, idx: int) -> None:
        """Recompute row ``idx``'s share of :attr:`num_evictable` after a change."""
        n = int(self.num_replicas[idx])
        new = 0
        if self.in_tree[idx] and not self.readers[idx]:
            new = max(n - 1, 0) if self.pins[idx] else n
        self.num_evictable += new - int(self.evictable[idx])
        self.evictable[idx] = new

    def _grow(self) -> None:
        old = self.capacity
        new = old * 2
        for name in ("rep_inst", "rep_slot", "tier_block"):
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.full_like(arr, -1)]))
        for name in ("num_replicas", "pins", "readers", "in_tree", "evictable", "access",
                     "tier_ready", "_live"):  # fmt: skip
            arr = getattr(self, name)
            setattr(self, name, np.concatenate([arr, np.zeros_like(arr)]))
        self._free.extend(range(new - 1, old - 1, -1))

    def check_invariants(self) -> None:
        live = self._live
        assert (self.pins[live] >= 0).all() and (self.readers[live] >= 0).all(), "negative count"
        assert not self.readers[~live].any() and not self.pins[~live].any(), "count on a free row"
        rows = np.flatnonzero(live)
        pinned = (self.pins[rows] > 0).astype(np.int32)
        keep = self.in_tree[rows] & (self.readers[rows] == 0)
        want = np.where(keep, np.maximum(self.num_replicas[rows] - pinned, 0), 0)
        assert np.array_equal(want, self.evictable[rows]), "evictable share drifted"
        assert int(want.sum()) == self.num_evictable, "evictable total drifted"
        assert len(set(self._free)) == len(self._free) == int((~live).sum()), "free rows drifted"
