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


class EngineSlots(SlotAllocator):
    """The slots of an instance whose engine allocates them (SGLang's page allocator over
    the same memory): the pool never picks one, it records where the engine wrote a segment
    (:meth:`take`) and tells the engine when a slot it gave up is no longer read.

    ``is_used(slot)``: the pool references the slot (a segment, an open tail). The engine
    hands a slot back with :meth:`release`: free at once if the pool does not reference it,
    else when the pool lets go of it (:meth:`free`), collected by :meth:`drain_reclaimed`.
    """

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._free = []  # nothing for the pool to hand out: the engine allocates
        self._released: set[int] = set()  # given up by the engine, still referenced
        self._reclaimed: list[int] = []

    @property
    def num_used(self) -> int:
        return sum(self._used)

    def allocate(self) -> int | None:
        return None

    def take(self, slot: int) -> None:
        """The engine wrote a new segment of the pool's at ``slot``."""
        if not 0 <= slot < self.num_slots or self._used[slot]:
            raise InvalidArgumentError(
                f"slot: expected a slot in [0, {self.num_slots}) the pool does not reference, "
                f"got {slot}"
            )
        if slot in self._released:
            raise InvalidArgumentError(f"slot: {slot} was released by the engine and not reclaimed")
        self._used[slot] = 1

    def free(self, slot: int) -> None:
        if not self.is_used(slot):
            raise InvalidArgumentError(f"slot: {slot} is not referenced by the pool")
        self._used[slot] = 0
        if slot in self._released:
            self._released.discard(slot)
            self._reclaimed.append(slot)

    def release(self, slot: int) -> bool:
        """The engine gives ``slot`` up; ``True`` if it may reuse it now."""
        if not 0 <= slot < self.num_slots or slot in self._released:
            raise InvalidArgumentError(
                f"slot: expected a slot in [0, {self.num_slots}) not already released, got {slot}"
            )
        if not self._used[slot]:
            return True
        self._released.add(slot)
        return False

    def released_slots(self) -> list[int]:
        """Slots the engine gave up that the pool still references, ascending."""
        return sorted(self._released)

    def drain_reclaimed(self) -> list[int]:
        """Released slots the pool has let go of since the last call: the engine's again."""
        out, self._reclaimed = self._reclaimed, []
        return out

    def check_invariants(self) -> None:
        assert not self._free, "the pool handed out an engine's slot"
        assert all(self._used[s] for s in self._released), (
            "a released slot is waiting though the pool does not reference it"
        )
