"""Per-instance slot allocator: which of an instance's ``num_slots`` segment slots are free."""

from __future__ import annotations

import heapq

from tokenlake.errors import InvalidArgumentError


class SlotAllocator:
    """A free heap over slot ids ``0..num_slots-1``; the lowest free id is handed out first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise InvalidArgumentError(f"num_slots: expected > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a valid heap already
        self._used = bytearray(num_slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def allocate(self) -> int | None:
        """A free slot id, or ``None`` when the instance is full (an expected miss)."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        if not self.is_used(slot):
            raise InvalidArgumentError(f"slot: {slot} is not an allocated slot")
        self._used[slot] = 0
        heapq.heappush(self._free, slot)

    def free_slots(self) -> list[int]:
        """The free slot ids, in no particular order."""
        return list(self._free)

    def is_used(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and bool(self._used[slot])

    def check_invariants(self) -> None:
        assert len(set(self._free)) == len(self._free), "slot on the free list twice"
        assert all(not self._used[s] for s in self._free), "free-listed slot marked used"
        assert sum(self._used) + len(self._free) == self.num_slots, "slots lost or duplicated"
