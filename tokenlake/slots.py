"""Per-instance slot allocator: which of an instance's ``num_slots`` segment slots are free."""

from __future__ import annotations

from tokenlake.errors import InvalidArgumentError


class SlotAllocator:
    """A free list over slot ids ``0..num_slots-1``; lowest ids are handed out first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise InvalidArgumentError(f"num_slots: expected > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
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
        slot = self._free.pop()
        self._used[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._used[slot]:
            raise InvalidArgumentError(f"slot: {slot} is not an allocated slot")
        self._used[slot] = 0
        self._free.append(slot)

    def is_used(self, slot: int) -> bool:
        return bool(self._used[slot])

    def check_invariants(self) -> None:
        assert len(set(self._free)) == len(self._free), "slot on the free list twice"
        assert all(not self._used[s] for s in self._free), "free-listed slot marked used"
        assert sum(self._used) + len(self._free) == self.num_slots, "slots lost or duplicated"
