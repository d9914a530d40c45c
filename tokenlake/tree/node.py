"""Value types of the prefix tree: locations, nodes, match results and reservations."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from tokenlake.errors import InvalidArgumentError

if TYPE_CHECKING:
    from tokenlake.tree.segment_table import SegmentTable


class Location(NamedTuple):
    instance_id: int
    slot_id: int


class Node:
    """One segment in the tree (or a request's private segment outside it). Mutated only by
    :class:`PrefixTree`; its replicas and pins live in the tree's
    :class:`~tokenlake.tree.segment_table.SegmentTable` row ``idx`` (``-1`` when it has none)."""

    __slots__ = (
        "key",
        "parent",
        "tokens",
        "depth",
        "last_access",
        "children",
        "by_first",
        "idx",
        "table",
        "protected",
    )

    def __init__(self, key: int, parent: Node | None, tokens: np.ndarray, depth: int) -> None:
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.depth = depth  # sealed segments before this one
        self.last_access = 0
        self.children: dict[int, Node] = {}
        self.by_first: dict[int, list[Node]] = {}
        self.idx = -1  # row in ``table`` while the node is live
        self.table: SegmentTable | None = None
        self.protected = False  # eviction class (see tokenlake.tree.policy); kept across a restore

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def replicas(self) -> list[Location]:
        """Where the segment's copies live, oldest first: a fresh list read from the segment
        table (the only place replicas are stored; change them through the tree)."""
        if self.idx < 0:
            return []
        return [Location(i, s) for i, s in self.table.replicas(self.idx)]

    @property
    def num_replicas(self) -> int:
        return 0 if self.idx < 0 else int(self.table.num_replicas[self.idx])

    @property
    def tier_block(self) -> int:
        """Its host-tier block (``-1``: none; see :mod:`tokenlake.tree.host_tier`)."""
        return -1 if self.idx < 0 else int(self.table.tier_block[self.idx])

    @property
    def in_tier(self) -> bool:
        """Only in the host tier, its copy there complete: a hit that a plan loads first."""
        t, i = self.table, self.idx
        return i >= 0 and not t.num_replicas[i] and bool(t.tier_ready[i])

    @property
    def readable(self) -> bool:
        """In the pool, or complete in the host tier: what a match may return (a segment
        whose demotion is in flight is not)."""
        t, i = self.table, self.idx
        return i >= 0 and bool(t.num_replicas[i] or t.tier_ready[i])

    @property
    def pin_count(self) -> int:
        return 0 if self.idx < 0 else int(self.table.pins[self.idx])

    def __repr__(self) -> str:
        tier = f", tier_block={self.tier_block}" if self.tier_block >= 0 else ""
        return f"Node(key={self.key:#x}, depth={self.depth}, len={len(self.tokens)}, replicas={list(self.replicas)}{tier})"


# kinds of :class:`Evicted` records
REPLICA = "replica"  # a replica left the pool (with its node, when it was the last copy)
DEMOTED = "demoted"  # a last copy moved into a host-tier block (the node stays)
TIER_DROP = "tier_drop"  # a segment in the host tier only left it, and the tree
UNDEMOTED = "undemoted"  # a segment this plan was demoting left the tree (block kept)


class Evicted(NamedTuple):
    """Undo record of one eviction: enough to put the replica (and, for a last copy, the
    node) back exactly where it was, LRU position and access count included. ``kind``
    :data:`DEMOTED`: ``block`` is the host-tier block it went to; :data:`TIER_DROP`:
    ``block`` is the block it left, ``stamp`` its place in the tier's LRU, ``location``
    ``(-1, block)``; :data:`UNDEMOTED`: the same for a segment the plan was demoting into
    ``block`` (the block stays the plan's)."""

    node: Node
    location: Location
    stamp: int  # the replica's LRU stamp
    parent: Node | None  # the node's parent when it left the tree with this, else None
    access: float  # raw (scaled) access count of a node that left the tree
    access_scale: float  # the table's access scale then
    position: int  # the replica's index among the node's replicas
    block: int = -1
    kind: str = REPLICA


class PrefixMatch(NamedTuple):
    """Result of :meth:`PrefixTree.match`; a short match is a value, not an error.

    ``nodes`` are the fully matched sealed segments in order; ``partial`` is a child of the last
    one whose first ``partial_len`` tokens continue the match (a tail or a sealed segment).
    """

    nodes: tuple[Node, ...]
    partial: Node | None
    partial_len: int
    segment_len: int

    @property
    def num_tokens(self) -> int:
        return len(self.nodes) * self.segment_len + self.partial_len


class PendingInsert:
    """A reserved segment. ``parent`` is a committed node or an earlier reservation of the
    same writer (a chunk spanning several segments); ``result`` is set by ``commit``."""

    __slots__ = ("insert_id", "parent", "key", "tokens", "location", "result", "state")

    def __init__(self, insert_id, parent, key, tokens, location) -> None:
        self.insert_id: int = insert_id
        self.parent: Node | PendingInsert = parent
        self.key: int = key
        self.tokens: np.ndarray = tokens
        self.location: Location = location
        self.result: Node | None = None
        self.state = "reserved"  # then "committed" or "aborted"


class PendingInserts:
    """The live reservations of a tree, by insert id."""

    def __init__(self) -> None:
        self._live: dict[int, PendingInsert] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[PendingInsert]:
        return iter(self._live.values())

    def add(self, parent: Node | PendingInsert, key: int, tokens, location) -> PendingInsert:
        pending = PendingInsert(self._next_id, parent, key, tokens, location)
        self._next_id += 1
        self._live[pending.insert_id] = pending
        return pending

    def take(self, pending: PendingInsert) -> PendingInsert:
        """Remove a live reservation (to commit or abort it)."""
        if self._live.pop(getattr(pending, "insert_id", None), None) is not pending:
            raise InvalidArgumentError(f"pending: {pending!r} is not a live reservation")
        return pending


class CommitResult(NamedTuple):
    """``node`` is the committed node; ``deduped`` means it already existed and the reserved
    slot is now unused; ``node is None`` means a key collision (keep the segment private)."""

    node: Node | None
    deduped: bool


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
