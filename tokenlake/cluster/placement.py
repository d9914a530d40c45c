"""Rendezvous (highest-random-weight) placement of segment keys over live instances.

Uniform like plain hashing, and adding or removing an instance moves only keys whose top
choice is that instance. ``rank`` orders all live instances, so a full home falls back to the
next instance in the key's own order instead of a fixed neighbour.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

from tokenlake.errors import InvalidArgumentError

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, vectorised over a uint64 array."""
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Placement:
    """Maps a segment key to its home instance (and a fallback order) among live instances."""

    def __init__(self, instance_ids: Iterable[int], seed: int = 0) -> None:
        self._seed = seed
        self._ids = np.zeros(0, dtype=np.int64)
        self._salts = np.zeros(0, dtype=np.uint64)
        self._live: tuple[int, ...] = ()  # ascending; read on every plan: kept, not rebuilt
        for instance_id in instance_ids:
            self.add(instance_id)
        if not len(self._ids):
            raise InvalidArgumentError("instance_ids: expected at least one instance")

    @property
    def live(self) -> tuple[int, ...]:
        """The live instance ids, ascending."""
        return self._live

    def add(self, instance_id: int) -> None:
        if instance_id in self._ids:
            raise InvalidArgumentError(f"instance_id: {instance_id} is already live")
        salt = xxhash.xxh64_intdigest(f"instance/{instance_id}".encode(), seed=self._seed)
        self._ids = np.append(self._ids, np.int64(instance_id))
        self._salts = np.append(self._salts, np.uint64(salt))
        self._live = tuple(sorted(int(i) for i in self._ids))

    def remove(self, instance_id: int) -> None:
        where = np.nonzero(self._ids == instance_id)[0]
        if not len(where):
            raise InvalidArgumentError(f"instance_id: {instance_id} is not live")
        if len(self._ids) == 1:
            raise InvalidArgumentError("instance_id: cannot remove the last live instance")
        self._ids = np.delete(self._ids, where)
        self._salts = np.delete(self._salts, where)
        self._live = tuple(sorted(int(i) for i in self._ids))

    def _weights(self, key: int) -> np.ndarray:
        return _mix(self._salts ^ np.uint64(key))

    def home(self, key: int) -> int:
        """The live instance with the highest weight for ``key``."""
        return int(self._ids[int(np.argmax(self._weights(key)))])

    def rank(self, key: int) -> list[int]:
        """All live instances, best first, for ``key``."""
        order = np.argsort(self._weights(key))[::-1]
        return [int(i) for i in self._ids[order]]

    def rank_beside(self, key: int, beside: int | None) -> list[int]:
        """:meth:`rank`, with ``beside`` (a live instance) moved first: a request's next
        segment next to its previous one, so that its decode steps read one holder instead
        of one per segment when each remote holder costs a fixed hop."""
        order = self.rank(key)
        if beside is None:
            return order
        if beside not in self._live:
            raise InvalidArgumentError(f"beside: {beside} is not live")
        return [beside] + [i for i in order if i != beside]

    def homes(self, keys: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`home` over a uint64 array of keys → int64 instance ids."""
        weights = _mix(keys.astype(np.uint64)[:, None] ^ self._salts[None, :])
        return self._ids[np.argmax(weights, axis=1)]
