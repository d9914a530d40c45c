"""The host tier's blocks: which of its ``num_blocks`` segment-sized blocks are free, the
order of the segments in it and the loads in flight. What a segment's state in the tier means
and how it changes: :mod:`tokenlake.tree.host_tier`."""

from __future__ import annotations

import heapq
from collections import Counter

from tokenlake.errors import InvalidArgumentError
from tokenlake.tree.replica_lru import ReplicaLRU

TIER = -1  # the instance id of the tier's entries in its LRU and in journal locations


class HostTier:
    """``num_blocks`` blocks of one segment each (``0``: no tier, the pool forgets what it
    evicts). ``lru`` orders the segments in the tier (``(key, TIER)`` entries), least
    recently demoted first; ``loading`` counts the promotions in flight per segment key."""

    def __init__(self, num_blocks: int = 0) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks: expected an int >= 0, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a valid heap already
        self._used = bytearray(num_blocks)
        self.lru = ReplicaLRU()
        self.loading: Counter[int] = Counter()

    @property
    def enabled(self) -> bool:
        return self.num_blocks > 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_segments(self) -> int:
        """Segments in the tier (complete, not in the pool)."""
        return len(self.lru)

    def allocate(self) -> int | None:
        if not self._free:
            return None
        block = heapq.heappop(self._free)
        self._used[block] = 1
        return block

    def take(self, block: int) -> None:
        """Take a free ``block`` back (an undone tier eviction)."""
        if self.is_used(block):
            raise InvalidArgumentError(f"block: {block} is in use")
        self._free.remove(block)
        heapq.heapify(self._free)
        self._used[block] = 1

    def free(self, block: int) -> None:
        if not self.is_used(block):
            raise InvalidArgumentError(f"block: {block} is not an allocated block")
        self._used[block] = 0
        heapq.heappush(self._free, block)

    def is_used(self, block: int) -> bool:
        return 0 <= block < self.num_blocks and bool(self._used[block])

    def check_invariants(self) -> None:
        assert len(set(self._free)) == len(self._free), "block on the free list twice"
        assert all(not self._used[b] for b in self._free), "free-listed block marked used"
        assert sum(self._used) + len(self._free) == self.num_blocks, "blocks lost"
        assert all(n > 0 for n in self.loading.values()), "a finished load still counted"
        self.lru.check_invariants()
