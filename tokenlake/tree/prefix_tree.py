"""The global index of segments: a prefix tree keyed by chained segment keys.

Nodes are sealed segments (``C`` tokens) or tails (a finished request's last partial segment,
fewer than ``C`` tokens, always a leaf). Each node lists its replicas (instance, slot). Inserts
are two-phase — ``reserve`` while the KV is being written, then ``commit`` (deduplicating
against an identical committed segment) or ``abort`` — and readers never see reservations.
Matching is in :mod:`tokenlake.tree.match`, LRU eviction and its undo in
:mod:`tokenlake.tree.eviction`, the invariants in :mod:`tokenlake.tree.checks`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

import numpy as np

from tokenlake.errors import InvalidArgumentError
from tokenlake.keys import SegmentHasher, as_tokens
from tokenlake.tree import eviction as tree_eviction
from tokenlake.tree.checks import check_tree_invariants
from tokenlake.tree.match import longest_prefix
from tokenlake.tree.node import (
    CommitResult,
    Evicted,
    Location,
    Node,
    PendingInsert,
    PendingInserts,
    PrefixMatch,
    common_prefix_len,
)
from tokenlake.tree.policy import EvictionConfig, EvictionPolicy
from tokenlake.tree.replica_lru import ReplicaLRU
from tokenlake.tree.segment_table import SegmentTable
from tokenlake.tree.tier_blocks import HostTier

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


class PrefixTree:
    """Global prefix tree over segments of ``segment_len`` tokens.

    The replica LRU maps ``(key, instance_id)`` to a stamp from one clock; its order is the
    stamps' order, so an undone eviction goes back to its exact place.
    """

    def __init__(
        self,
        segment_len: int,
        hasher: SegmentHasher,
        max_replicas: int = 8,
        policy: EvictionPolicy | None = None,
        tier: HostTier | None = None,
    ) -> None:
        self.segment_len = segment_len
        self.tier = tier if tier is not None else HostTier(0)  # below the pool (host memory)
        self.policy = policy if policy is not None else EvictionPolicy(EvictionConfig(), 0)
        self.hasher = hasher
        self.table = SegmentTable(max_replicas)
        self.root = Node(hasher.root_key, None, as_tokens([]), -1)
        self._nodes: dict[int, Node] = {}
        self._by_idx: dict[int, Node] = {}
        self.pending = PendingInserts()  # read it; reserve/commit/abort change it
        self.lru = ReplicaLRU()  # read it; the tree stamps, puts and removes
        self.eviction_scan = tree_eviction.EvictionScan()  # evictions into one journal resume

    # ---- reading -------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def num_replicas(self) -> int:
        return len(self.lru)

    @property
    def num_pending(self) -> int:
        return len(self.pending)

    @property
    def num_evictable(self) -> int:
        """Replicas repeated eviction can free now (see :class:`SegmentTable`)."""
        return self.table.num_evictable

    @property
    def clock(self) -> int:
        """The LRU clock: stamps handed out so far."""
        return self.lru.clock

    def lru_order(self) -> list[tuple[int, int, int]]:
        """``(key, instance_id, stamp)`` of every replica, least recently used first."""
        return [(key, inst, stamp) for (key, inst), stamp in self.lru.items()]

    @property
    def node_map(self) -> Mapping[int, Node]:
        """Key -> node, a live read-only view (for loops that look up many keys)."""
        return MappingProxyType(self._nodes)

    def get(self, key: int) -> Node | None:
        return self._nodes.get(key)

    @property
    def num_indexed(self) -> int:
        """Nodes in the row index (equals :attr:`num_nodes` when consistent)."""
        return len(self._by_idx)

    def node_at(self, idx: int) -> Node:
        """The node in segment-table row ``idx``."""
        return self._by_idx[idx]

    def nodes(self) -> Iterator[Node]:
        return iter(self._nodes.values())

    def match(
        self,
        token_ids: Iterable[int] | np.ndarray,
        touch: bool = False,
        resume: PrefixMatch | None = None,
    ) -> PrefixMatch:
        """Longest cached prefix of ``token_ids``: full segments, then a partial continuation.

        ``touch`` marks the matched nodes as accessed now (for LRU); ``resume`` is an earlier
        match of the same tokens to go on from (see :func:`~tokenlake.tree.match.longest_prefix`).
        """
        found = longest_prefix(self, token_ids, resume)
        if touch:
            self.touch(list(found.nodes) + ([found.partial] if found.partial is not None else []))
        return found

    # ---- access and pins -----------------------------------------------------------------
    def touch(self, path: list[Node]) -> None:
        """Mark ``path`` (root-to-leaf order) accessed; ancestors end up more recent than
        descendants so LRU reaches leaves first."""
        for node in reversed(path):
            for loc in node.replicas:
                self.lru.stamp((node.key, loc.instance_id))
            node.last_access = self.lru.clock

    def touch_replicas(self, idx: Iterable[int], instance_ids: Iterable[int]) -> None:
        """Mark replicas (table row, instance) as just read, in order."""
        for i, inst in zip(idx, instance_ids, strict=True):
            node = self._by_idx.get(i)
            if node is not None and (node.key, inst) in self.lru:
                self.lru.stamp((node.key, inst))

    def mark_reused(self, path: list[Node]) -> None:
        """A new request's admitted prefix was read (at commit): the eviction policy's
        reuse signal."""
        self.policy.reused(path, self.lru, self._nodes)

    def forget(self, victims: Iterable[Node]) -> None:
        """Evictions of these nodes' replicas became final (commit, or an abort that could
        not restore them)."""
        self.policy.forgotten(victims, self._nodes)

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
        return self.pending.add(parent, key, tokens, location)

    def abort(self, pending: PendingInsert) -> None:
        self.pending.take(pending).state = "aborted"

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
        self.pending.take(pending).state = "committed"
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
    def add_replica(
        self, node: Node, location: Location, stamp: int | None = None, position: int = -1
    ) -> None:
        """Add a replica, the most recently used; an undone eviction passes its old LRU
        ``stamp`` and its ``position`` among the node's replicas."""
        self._require_committed(node)
        if any(r.instance_id == location.instance_id for r in node.replicas):
            raise InvalidArgumentError(
                f"location: {node!r} already has a replica on instance {location.instance_id}"
            )
        self._add_replica(node, location, stamp, position)

    def _add_replica(
        self, node: Node, location: Location, stamp: int | None = None, position: int = -1
    ) -> None:
        replicas = node.replicas
        replicas.insert(len(replicas) if position < 0 else position, location)
        self.table.set_replicas(node.idx, replicas)
        entry = (node.key, location.instance_id)
        if stamp is None:
            self.lru.stamp(entry)
        else:
            self.lru.put(entry, stamp)

    def remove_replica(self, node: Node, instance_id: int, keep: bool = False) -> Location:
        """Drop ``node``'s replica on ``instance_id``; dropping the last one removes the node,
        which must then be a leaf, unless ``keep`` (it moves to the host tier). Returns the
        freed location."""
        self._require_committed(node)
        replicas = node.replicas
        idx = next((i for i, r in enumerate(replicas) if r.instance_id == instance_id), None)
        if idx is None:
            raise InvalidArgumentError(f"instance_id: {node!r} has no replica on {instance_id}")
        if len(replicas) == 1 and node.children and not keep:
            raise InvalidArgumentError(f"node: {node!r} has children; remove them first")
        if len(replicas) == 1 and node.pin_count:
            raise InvalidArgumentError(f"node: {node!r} is pinned; its last copy cannot go")
        loc = replicas.pop(idx)
        self.table.set_replicas(node.idx, replicas)
        self.lru.remove((node.key, instance_id))
        if not replicas and not keep:
            self._detach(node)
        return loc

    def detach(self, node: Node) -> None:
        """Take a node with no replica (one leaving the host tier) out of the tree; its
        children must be gone and its tier block released."""
        self._require_committed(node)
        if node.children or node.num_replicas or node.tier_block >= 0:
            raise InvalidArgumentError(f"node: {node!r} has children, replicas or a block")
        if node.pin_count:
            raise InvalidArgumentError(f"node: {node!r} is pinned")
        self._detach(node)

    def reattach(self, node: Node, parent: Node, access: float) -> None:
        """Put an evicted node (no replicas yet) back under ``parent`` with its raw access
        count; the caller adds its replica next (see :func:`tree_eviction.restore`)."""
        if node.idx >= 0 or node.key in self._nodes or node.replicas:
            raise InvalidArgumentError(f"node: {node!r} is not a detached node")
        self._attach(node, parent)
        self.table.access[node.idx] = access

    def _attach(self, node: Node, parent: Node) -> None:
        node.parent = parent
        node.idx, node.table = self.table.alloc(in_tree=True), self.table
        self._by_idx[node.idx] = node
        parent.children[node.key] = node
        parent.by_first.setdefault(int(node.tokens[0]), []).append(node)
        self._nodes[node.key] = node
        self.policy.attached(node)

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
        self.policy.detached(node)
        node.parent = None
        node.idx = -1

    def evict_lru(
        self, instance_id: int | None = None, journal: list[Evicted] | None = None
    ) -> tuple[Node, Location] | None:
        """Remove the first evictable replica in the policy's order (least recently used
        first); see :func:`tree_eviction.evict_lru`."""
        return tree_eviction.evict_lru(self, instance_id, journal, self.eviction_scan)

    def restore(self, evicted: Sequence[Evicted], live: Iterable[int]) -> list[bool]:
        """Undo journaled evictions; see :func:`tree_eviction.restore`."""
        return tree_eviction.restore(self, evicted, live)

    def drop_instance(self, instance_id: int) -> list[Location]:
        """Forget every replica on a lost instance; see :func:`tree_eviction.drop_instance`."""
        return tree_eviction.drop_instance(self, instance_id)

    def _require_committed(self, node: Node) -> None:
        if self._nodes.get(node.key) is not node:
            raise InvalidArgumentError(f"node: {node!r} is not in this tree")

    def check_invariants(self) -> None:
        check_tree_invariants(self)
        self.policy.check_invariants(self.nodes())
