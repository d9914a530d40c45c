"""The replica LRU: ``(key, instance_id)`` entries stamped from one clock.

The order is the stamps' order, so an entry put back with its old stamp (an undone
eviction) returns to its exact place once :meth:`ReplicaLRU.resort` ran.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, KeysView

Entry = tuple[int, int]  # (segment key, instance id)


class ReplicaLRU:
    def __init__(self) -> None:
        self._stamps: OrderedDict[Entry, int] = OrderedDict()
        self._clock = 0
        self._version = 0  # bumped by every change (a resumed eviction scan checks it)

    def __len__(self) -> int:
        return len(self._stamps)

    def __contains__(self, entry: Entry) -> bool:
        return entry in self._stamps

    @property
    def clock(self) -> int:
        """Stamps handed out so far."""
        return self._clock

    @property
    def version(self) -> int:
        """Changes made so far (stamps, puts, removals, resorts)."""
        return self._version

    def entries(self) -> KeysView[Entry]:
        """A live read-only view of the entries (membership tests at C speed)."""
        return self._stamps.keys()

    def stamp_of(self, entry: Entry) -> int:
        return self._stamps[entry]

    @property
    def last_stamp(self) -> int:
        """The stamp of the most recent entry, 0 if empty."""
        return next(reversed(self._stamps.values()), 0)

    def items(self) -> Iterator[tuple[Entry, int]]:
        """``(entry, stamp)``, least recently used first (a live view: do not mutate while
        iterating past the entry you act on)."""
        return iter(self._stamps.items())

    def stamp(self, entry: Entry) -> int:
        """Make ``entry`` the most recent with a new stamp."""
        self._clock += 1
        self._version += 1
        self._stamps[entry] = self._clock
        self._stamps.move_to_end(entry)
        return self._clock

    def put(self, entry: Entry, stamp: int) -> None:
        """Add ``entry`` with an old stamp (last in order until :meth:`resort`)."""
        self._version += 1
        self._stamps[entry] = stamp

    def remove(self, entry: Entry) -> None:
        self._version += 1
        del self._stamps[entry]

    def resort(self) -> None:
        """Back to stamp order after :meth:`put` of older stamps."""
        self._version += 1
        self._stamps = OrderedDict(sorted(self._stamps.items(), key=lambda item: item[1]))

    def check_invariants(self) -> None:
        stamps = list(self._stamps.values())
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps), "LRU out of order"
        assert not stamps or stamps[-1] <= self._clock, "stamp from the future"
