"""The global index of segments: a prefix tree keyed by chained segment keys.

Nodes are sealed segments (``C`` tokens) or tails (a finished request's last partial segment,
fewer than ``C`` tokens, always a leaf). Each node lists its replicas (instance, slot). Inserts
are two-phase — ``reserve`` while the KV is being written, then ``commit`` (deduplicating
against an identical committed segment) or ``abort`` — and readers never see reservations.
Eviction is LRU over replicas; it never removes a pinned node's last copy, and removes a last
copy only from a leaf, so the tree stays prefix-closed.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator

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
    "Location",
    "Node",
    "PendingInsert",
    "PrefixMatch",
    "PrefixTree",
    "common_prefix_len",
]


class PrefixTree:
    """Global prefix tree over segments of ``segment_len`` tokens."""

    def __init__(self, segment_len: int, hasher: SegmentHasher, max_replicas: int = 8) -> None:
        self.segment_len = segment_len
        self.hasher = hasher
        self.table = SegmentTable(max_replicas)
        self.root = Node(hasher.root_key, None, as_tokens([]), -1)
        self._nodes: dict[int, Node] = {}
        self._by_idx: dict[int, Node] = {}
        self._pending: dict[int, PendingInsert] = {}
        self._insert_ids = itertools.count()
        self._lru: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._clock = 0
        self._num_evictable = 0  # all copies but pinned nodes' last: repeated eviction frees them

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
        return self._num_evictable

    def get(self, key: int) -> Node | None:
        return self._nodes.get(key)

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
            self._clock += 1
            node.last_access = self._clock
            for loc in node.replicas:
                self._lru.move_to_end((node.key, loc.instance_id))

    def touch_replica(self, idx: int, instance_id: int) -> None:
        """Mark one replica (of the node in table row ``idx``) as just read."""
        self._lru.move_to_end((self._by_idx[idx].key, instance_id))

    def pin(self, node: Node) -> None:
        self._require_committed(node)
        if node.pin_count == 0:
            self._num_evictable -= 1  # its last copy is protected now
        node.pin_count += 1

    def unpin(self, node: Node) -> None:
        self._require_committed(node)
        if node.pin_count <= 0:
            raise InvalidArgumentError(f"node: {node!r} is not pinned")
        node.pin_count -= 1
        if node.pin_count == 0:
            self._num_evictable += 1

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
        node.idx = self.table.alloc()
        self._by_idx[node.idx] = node
        parent.children[node.key] = node
        parent.by_first.setdefault(int(node.tokens[0]), []).append(node)
        self._nodes[node.key] = node
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

    def _add_replica(self, node: Node, location: Location) -> None:
        node.replicas.append(location)
        self.table.set_replicas(node.idx, node.replicas)
        self._lru[(node.key, location.instance_id)] = None
        self._num_evictable += 1  # a new copy is either unpinned or an extra one

    def remove_replica(self, node: Node, instance_id: int) -> Location:
        """Drop ``node``'s replica on ``instance_id``; dropping the last one removes the node,
        which must then be a leaf. Returns the freed location."""
        self._require_committed(node)
        idx = next((i for i, r in enumerate(node.replicas) if r.instance_id == instance_id), None)
        if idx is None:
            raise InvalidArgumentError(f"instance_id: {node!r} has no replica on {instance_id}")
        if len(node.replicas) == 1 and node.children:
            raise InvalidArgumentError(f"node: {node!r} has children; remove them first")
        if len(node.replicas) == 1 and node.pin_count:
            raise InvalidArgumentError(f"node: {node!r} is pinned; its last copy cannot go")
        self._num_evictable -= 1  # unpinned, or an extra copy of a pinned node
        loc = node.replicas.pop(idx)
        self.table.set_replicas(node.idx, node.replicas)
        del self._lru[(node.key, instance_id)]
        if not node.replicas:
            self._detach(node)
        return loc

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

    def evict_lru(self, instance_id: int | None = None) -> tuple[Node, Location] | None:
        """Remove the least recently used evictable replica (on ``instance_id`` if given);
        ``None`` if there is none. Any copy of a segment with several may go (pinned or
        not); a last copy goes only from an unpinned leaf. Callers that chose a replica
        before evicting must re-check it (see ``Pool.gen_plans``)."""
        for key, inst in self._lru:
            node = self._nodes[key]
            if instance_id is not None and inst != instance_id:
                continue
            if len(node.replicas) > 1 or (node.pin_count == 0 and not node.children):
                return node, self.remove_replica(node, inst)
        return None

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
        seg = self.segment_len
        seen, stack = 0, [self.root]
        locations: set[Location] = set()
        evictable = 0
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.key == key and child.parent is node, "child link broken"
                assert self._nodes.get(key) is child, "child missing from the index"
                assert len(node.tokens) in (0, seg), "a tail (partial segment) has children"
                assert 0 < len(child.tokens) <= seg, "segment length out of range"
                assert child.depth == node.depth + 1, "depth wrong"
                assert child.key == self.hasher.key(node.key, child.tokens), "key mismatch"
                assert child in node.by_first[int(child.tokens[0])], "first-token index missing"
                assert child.pin_count >= 0, "negative pin count"
                assert child.replicas, "node without replicas"
                table = self.table
                n = int(table.num_replicas[child.idx])
                assert n == len(child.replicas), "segment table replica count drifted"
                assert list(
                    zip(table.rep_inst[child.idx, :n], table.rep_slot[child.idx, :n], strict=True)
                ) == [tuple(r) for r in child.replicas], "segment table replicas drifted"
                insts = [r.instance_id for r in child.replicas]
                assert len(set(insts)) == len(insts), "two replicas on one instance"
                for loc in child.replicas:
                    assert loc not in locations, f"location {loc} used twice"
                    locations.add(loc)
                    assert (child.key, loc.instance_id) in self._lru, "replica missing from LRU"
                evictable += len(child.replicas) - (1 if child.pin_count else 0)
                seen += 1
                stack.append(child)
            assert sum(len(v) for v in node.by_first.values()) == len(node.children), "index size"
        assert seen == len(self._nodes), "unreachable nodes in the index"
        assert len(self._lru) == len(locations), "stale LRU entries"
        assert evictable == self._num_evictable, "evictable counter drifted"
        for pending in self._pending.values():
            assert pending.location not in locations, "reserved location is also committed"
