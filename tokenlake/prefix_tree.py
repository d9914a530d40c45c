"""The global index of segments: a prefix tree keyed by chained segment keys.

Nodes are sealed segments (``C`` tokens) or tails (a finished request's last partial segment,
fewer than ``C`` tokens, always a leaf). Each node lists its replicas (instance, slot). Inserts
are two-phase — ``reserve`` while the KV is being written, then ``commit`` (deduplicating
against an identical committed segment) or ``abort`` — and readers never see reservations.
Eviction is LRU over replicas; it never removes a pinned node's last copy nor any copy of a
node an in-flight iteration reads, and removes a last copy only from a leaf, so the tree stays
prefix-closed. An eviction can be journaled and undone (:meth:`PrefixTree.restore`): the pool
evicts tentatively while planning and restores the victims when an iteration is aborted before
anything was written into their slots.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from tokenlake.errors import InvalidArgumentError
from tokenlake.keys import SegmentHasher, as_tokens
from tokenlake.segment_table import SegmentTable
from tokenlake.tree_types import (
    CommitResult,
    Location,
    Node,
    PendingInsert,
    PrefixMatch,
    common_prefix_len,
)

__all__ = [
    "CommitResult",
    "Evicted",
    "Location",
    "Node",
    "PendingInsert",
    "PrefixMatch",
    "PrefixTree",
    "common_prefix_len",
]


class Evicted(NamedTuple):
    """Undo record of one eviction: enough to put the replica (and, for a last copy, the
    node) back exactly where it was, LRU position and access count included."""

    node: Node
    location: Location
    stamp: int  # the replica's LRU stamp
    parent: Node | None  # the node's parent when this was its last copy, else None
    access: float  # raw (scaled) access count of a node that left the tree
    access_scale: float  # the table's access scale then
    position: int  # the replica's index among the node's replicas


class PrefixTree:
    """Global prefix tree over segments of ``segment_len`` tokens.

    The replica LRU maps ``(key, instance_id)`` to a stamp from one clock; its order is the
    stamps' order, so an undone eviction goes back to its exact place.
    """

    def __init__(self, segment_len: int, hasher: SegmentHasher, max_replicas: int = 8) -> None:
        self.segment_len = segment_len
        self.hasher = hasher
        self.table = SegmentTable(max_replicas)
        self.root = Node(hasher.root_key, None, as_tokens([]), -1)
        self._nodes: dict[int, Node] = {}
        self._by_idx: dict[int, Node] = {}
        self._pending: dict[int, PendingInsert] = {}
        self._insert_ids = itertools.count()
        self._lru: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._clock = 0

    # ---- reading -------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def num_replicas(self) -> int:
        return len(self._lru)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_evictable(self) -> int:
        """Replicas repeated eviction can free now (see :class:`SegmentTable`)."""
        return self.table.num_evictable

    @property
    def clock(self) -> int:
        """The LRU clock: stamps handed out so far."""
        return self._clock

    def lru_order(self) -> list[tuple[int, int, int]]:
        """``(key, instance_id, stamp)`` of every replica, least recently used first."""
        return [(key, inst, stamp) for (key, inst), stamp in self._lru.items()]

    def get(self, key: int) -> Node | None:
        return self._nodes.get(key)

    def node_at(self, idx: int) -> Node:
        """The node in segment-table row ``idx``."""
        return self._by_idx[idx]

    def nodes(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def match(self, token_ids: Iterable[int] | np.ndarray, touch: bool = False) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``: full segments, then a partial continuation.

        ``touch`` marks the matched nodes as accessed now (for LRU).
        """
        tokens = as_tokens(token_ids)
        seg = self.segment_len
        node, nodes, pos = self.root, [], 0
        while pos + seg <= len(tokens):
            chunk = tokens[pos : pos + seg]
            child = node.children.get(self.hasher.key(node.key, chunk))
            if child is None or len(child.tokens) != seg or not np.array_equal(child.tokens, chunk):
                break
            nodes.append(child)
            node, pos = child, pos + seg
        partial, partial_len = None, 0
        if pos < len(tokens):
            rest = tokens[pos : pos + seg]
            for cand in node.by_first.get(int(rest[0]), ()):
                n = common_prefix_len(cand.tokens, rest)
                if n > partial_len:
                    partial, partial_len = cand, n
        if touch:
            self.touch(nodes + ([partial] if partial is not None else []))
        return PrefixMatch(tuple(nodes), partial, partial_len, seg)

    # ---- access and pins -----------------------------------------------------------------
    def touch(self, path: list[Node]) -> None:
        """Mark ``path`` (root-to-leaf order) accessed; ancestors end up more recent than
        descendants so LRU reaches leaves first."""
        for node in reversed(path):
            for loc in node.replicas:
                self._stamp((node.key, loc.instance_id))
            node.last_access = self._clock

    def touch_replicas(self, idx: Iterable[int], instance_ids: Iterable[int]) -> None:
        """Mark replicas (table row, instance) as just read, in order."""
        for i, inst in zip(idx, instance_ids, strict=True):
            node = self._by_idx.get(i)
            if node is not None and (node.key, inst) in self._lru:
                self._stamp((node.key, inst))

    def _stamp(self, entry: tuple[int, int]) -> None:
        self._clock += 1
        self._lru[entry] = self._clock
        self._lru.move_to_end(entry)

    def pin(self, node: Node) -> None:
        self._require_committed(node)
        self.table.pin(node.idx, 1)

    def unpin(self, node: Node) -> None:
        self._require_committed(node)
        if node.pin_count <= 0:
            raise InvalidArgumentError(f"node: {node!r} is not pinned")
        self.table.pin(node.idx, -1)

    def add_readers(self, idx: np.ndarray, delta: int) -> None:
        """Rows ``idx`` (table rows of committed nodes, repeats allowed) are read by one more
        (``delta=1``) or one fewer (``-1``) in-flight iteration per occurrence; a node being
        read keeps every copy (see :meth:`evict_lru`)."""
        self.table.add_readers(np.asarray(idx, dtype=np.int64), delta)

    # ---- private segments (outside the tree) ------------------------------------------------
    def new_private(self, key: int, tokens: np.ndarray, location: Location) -> Node:
        """A sealed segment only its writer uses (after a key collision): a table row for
        plan building, never matched, pinned or evicted."""
        node = Node(key, None, tokens, -1)
        node.idx, node.table = self.table.alloc(in_tree=False), self.table
        self.table.set_replicas(node.idx, [location])
        return node

    def free_private(self, node: Node) -> None:
        self.table.free(node.idx)
        node.idx = -1

    # ---- two-phase insert ----------------------------------------------------------------
    def reserve(
        self, parent: Node | PendingInsert, tokens: np.ndarray, location: Location
    ) -> PendingInsert:
        """Announce a segment being written at ``location`` under ``parent`` (a committed
        node, or a reservation committed before this one); invisible until :meth:`commit`."""
        tokens = np.array(as_tokens(tokens), copy=True)  # the tree owns its tokens
        tokens.flags.writeable = False
        if not 0 < len(tokens) <= self.segment_len:
            raise InvalidArgumentError(
                f"tokens: expected 1..{self.segment_len} tokens, got {len(tokens)}"
            )
        if not isinstance(parent, Node | PendingInsert):
            raise InvalidArgumentError(
                f"parent: expected a Node or PendingInsert, got {type(parent).__name__}"
            )
        key = self.hasher.key(parent.key, tokens)
        pending = PendingInsert(next(self._insert_ids), parent, key, tokens, location)
        self._pending[pending.insert_id] = pending
        return pending

    def abort(self, pending: PendingInsert) -> None:
        self._take_pending(pending).state = "aborted"

    def _take_pending(self, pending: PendingInsert) -> PendingInsert:
        if self._pending.pop(getattr(pending, "insert_id", None), None) is not pending:
            raise InvalidArgumentError(f"pending: {pending!r} is not a live reservation")
        return pending

    def _resolve_parent(self, pending: PendingInsert) -> Node | None:
        parent = pending.parent
        if isinstance(parent, PendingInsert):
            parent = parent.result
        if parent is None or (
            parent is not self.root and self._nodes.get(parent.key) is not parent
        ):
            return None  # parent refused (collision) or gone
        return parent if len(parent.tokens) in (0, self.segment_len) else None

    def commit(self, pending: PendingInsert) -> CommitResult:
        """Make a reserved segment visible, or resolve it to an identical existing one."""
        parent = getattr(pending, "parent", None)
        if isinstance(parent, PendingInsert) and parent.state == "reserved":
            raise InvalidArgumentError("pending: commit its parent reservation first")
        self._take_pending(pending).state = "committed"
        parent = self._resolve_parent(pending)
        if parent is None:
            return CommitResult(None, False)  # keep the segment private
        existing = parent.children.get(pending.key)
        if existing is None and pending.key in self._nodes:
            return CommitResult(None, False)  # same key elsewhere in the tree: a collision
        if existing is not None:
            if not np.array_equal(existing.tokens, pending.tokens):
                return CommitResult(None, False)
            pending.result = existing
            return CommitResult(existing, True)
        node = Node(pending.key, parent, pending.tokens, parent.depth + 1)
        self._attach(node, parent)
        self._add_replica(node, pending.location)
        self.touch([node])
        pending.result = node
        return CommitResult(node, False)

    def insert(self, parent: Node, tokens: np.ndarray, location: Location) -> CommitResult:
        """Reserve and commit at once (the KV at ``location`` is already complete)."""
        return self.commit(self.reserve(parent, tokens, location))

    # ---- replicas and eviction -----------------------------------------------------------
    def add_replica(self, node: Node, location: Location) -> None:
        self._require_committed(node)
        if any(r.instance_id == location.instance_id for r in node.replicas):
            raise InvalidArgumentError(
                f"location: {node!r} already has a replica on instance {location.instance_id}"
            )
        self._add_replica(node, location)

    def _add_replica(
        self, node: Node, location: Location, stamp: int | None = None, position: int = -1
    ) -> None:
        replicas = node.replicas
        replicas.insert(len(replicas) if position < 0 else position, location)
        self.table.set_replicas(node.idx, replicas)
        entry = (node.key, location.instance_id)
        if stamp is None:
            self._stamp(entry)
        else:
            self._lru[entry] = stamp

    def remove_replica(self, node: Node, instance_id: int) -> Location:
        """Drop ``node``'s replica on ``instance_id``; dropping the last one removes the node,
        which must then be a leaf. Returns the freed location."""
        self._require_committed(node)
        replicas = node.replicas
        idx = next((i for i, r in enumerate(replicas) if r.instance_id == instance_id), None)
        if idx is None:
            raise InvalidArgumentError(f"instance_id: {node!r} has no replica on {instance_id}")
        if len(replicas) == 1 and node.children:
            raise InvalidArgumentError(f"node: {node!r} has children; remove them first")
        if len(replicas) == 1 and node.pin_count:
            raise InvalidArgumentError(f"node: {node!r} is pinned; its last copy cannot go")
        loc = replicas.pop(idx)
        self.table.set_replicas(node.idx, replicas)
        del self._lru[(node.key, instance_id)]
        if not replicas:
            self._detach(node)
        return loc

    def _attach(self, node: Node, parent: Node) -> None:
        node.parent = parent
        node.idx, node.table = self.table.alloc(in_tree=True), self.table
        self._by_idx[node.idx] = node
        parent.children[node.key] = node
        parent.by_first.setdefault(int(node.tokens[0]), []).append(node)
        self._nodes[node.key] = node

    def _detach(self, node: Node) -> None:
        parent = node.parent
        del parent.children[node.key]
        siblings = parent.by_first[int(node.tokens[0])]
        siblings.remove(node)
        if not siblings:
            del parent.by_first[int(node.tokens[0])]
        del self._nodes[node.key]
        self.table.free(node.idx)
        del self._by_idx[node.idx]
        node.parent = None
        node.idx = -1

    def evict_lru(
        self, instance_id: int | None = None, journal: list[Evicted] | None = None
    ) -> tuple[Node, Location] | None:
        """Remove the least recently used evictable replica (on ``instance_id`` if given);
        ``None`` if there is none. Any copy of a segment with several may go (pinned or
        not); a last copy goes only from an unpinned leaf; no copy of a segment an in-flight
        iteration reads goes. With ``journal``, an :class:`Evicted` record is appended so
        :meth:`restore` can undo it."""
        table = self.table
        for (key, inst), stamp in self._lru.items():
            if instance_id is not None and inst != instance_id:
                continue
            node = self._nodes[key]
            idx = node.idx
            if table.readers[idx]:
                continue
            if table.num_replicas[idx] > 1 or (not table.pins[idx] and not node.children):
                parent = node.parent if table.num_replicas[idx] == 1 else None
                access = float(table.access[idx]) if parent else 0.0
                position = int(np.flatnonzero(table.rep_inst[idx] == inst)[0])
                loc = self.remove_replica(node, inst)
                if journal is not None:
                    journal.append(
                        Evicted(node, loc, stamp, parent, access, table.access_scale, position)
                    )
                return node, loc
        return None

    def restore(self, evicted: Sequence[Evicted], live: Iterable[int]) -> list[bool]:
        """Undo evictions, latest first (so a parent comes back before its child). A victim
        comes back only if its place is still free: its node (or, for a last copy, its
        parent) is still in the tree, no node took its key, its instance is in ``live``, and
        it has no replica there yet. Returns, per record, whether it was restored; the
        caller frees the slots of the others. Only call this if nothing was written into
        the victims' slots since they were evicted."""
        live = set(live)
        done = [False] * len(evicted)
        reorder = False
        for i in range(len(evicted) - 1, -1, -1):
            node, loc, stamp, parent, access, scale, position = evicted[i]
            if loc.instance_id not in live:
                continue
            if parent is not None:  # the node left the tree with this copy
                attached = parent is self.root or self._nodes.get(parent.key) is parent
                if not attached or node.key in self._nodes or node.idx >= 0:
                    continue
                self._attach(node, parent)
                if scale != self.table.access_scale:  # decayed since: same count, new scale
                    access *= self.table.access_scale / scale
                self.table.access[node.idx] = access
            elif self._nodes.get(node.key) is not node or (
                any(r.instance_id == loc.instance_id for r in node.replicas)
                or node.num_replicas >= self.table.max_replicas
            ):
                continue
            reorder |= stamp < next(reversed(self._lru.values()), 0)
            self._add_replica(node, loc, stamp, position)
            done[i] = True
        if reorder:  # back to stamp order: an undone eviction returns to its old place
            self._lru = OrderedDict(sorted(self._lru.items(), key=lambda item: item[1]))
        return done

    def drop_instance(self, instance_id: int) -> list[Location]:
        """Forget every replica on a lost instance. A node whose only replica was there goes
        with its whole subtree (those prefixes are incomplete now); such nodes must be
        unpinned. Returns the freed locations on other instances."""
        lost = [
            n for n in self._nodes.values() if all(r.instance_id == instance_id for r in n.replicas)
        ]
        doomed: list[Node] = []
        stack = list(lost)
        while stack:
            node = stack.pop()
            doomed.append(node)
            stack.extend(node.children.values())
        pinned = [n for n in doomed if n.pin_count]
        if pinned:
            raise InvalidArgumentError(
                f"instance_id: {len(pinned)} pinned segments would be lost; fail their requests first"
            )
        doomed_keys = {n.key for n in doomed}
        for node in list(self._nodes.values()):
            if node.key not in doomed_keys and any(
                r.instance_id == instance_id for r in node.replicas
            ):
                self.remove_replica(node, instance_id)
        freed: list[Location] = []
        for node in reversed(doomed):  # descendants were pushed after their ancestors
            if self._nodes.get(node.key) is not node:
                continue
            for loc in list(node.replicas):
                self.remove_replica(node, loc.instance_id)
                if loc.instance_id != instance_id:
                    freed.append(loc)
        return freed

    def _require_committed(self, node: Node) -> None:
        if self._nodes.get(node.key) is not node:
            raise InvalidArgumentError(f"node: {node!r} is not in this tree")

    # ---- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        seg, table = self.segment_len, self.table
        seen, stack = 0, [self.root]
        locations: set[Location] = set()
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.key == key and child.parent is node, "child link broken"
                assert self._nodes.get(key) is child, "child missing from the index"
                assert self._by_idx.get(child.idx) is child, "row index drifted"
                assert table.is_live(child.idx) and table.in_tree[child.idx], "row not live"
                assert len(node.tokens) in (0, seg), "a tail (partial segment) has children"
                assert 0 < len(child.tokens) <= seg, "segment length out of range"
                assert child.depth == node.depth + 1, "depth wrong"
                assert child.key == self.hasher.key(node.key, child.tokens), "key mismatch"
                assert child in node.by_first[int(child.tokens[0])], "first-token index missing"
                assert child.replicas, "node without replicas"
                if child.pin_count:
                    assert node is self.root or node.pin_count, "pins not closed under parents"
                if table.readers[child.idx]:
                    assert node is self.root or table.readers[node.idx] or node.pin_count, (
                        "readers not closed under parents"
                    )
                insts = [r.instance_id for r in child.replicas]
                assert len(set(insts)) == len(insts), "two replicas on one instance"
                for loc in child.replicas:
                    assert loc not in locations, f"location {loc} used twice"
                    locations.add(loc)
                    assert (child.key, loc.instance_id) in self._lru, "replica missing from LRU"
                seen += 1
                stack.append(child)
            assert sum(len(v) for v in node.by_first.values()) == len(node.children), "index size"
        assert seen == len(self._nodes) == len(self._by_idx), "unreachable nodes in the index"
        assert len(self._lru) == len(locations), "stale LRU entries"
        stamps = list(self._lru.values())
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps), "LRU out of order"
        assert not stamps or stamps[-1] <= self._clock, "stamp from the future"
        table.check_invariants()
        for pending in self._pending.values():
            assert pending.location not in locations, "reserved location is also committed"
