"""Taking replicas out of the prefix tree and putting them back: LRU eviction with an undo
journal, the undo itself, and forgetting a lost instance. Functions over the tree's public
methods; :class:`tokenlake.tree.prefix_tree.PrefixTree` exposes them as methods."""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tokenlake.errors import InvalidArgumentError
from tokenlake.tree import host_tier
from tokenlake.tree.node import DEMOTED, REPLICA, TIER_DROP, Evicted, Location, Node

if TYPE_CHECKING:
    from tokenlake.tree.index import TreeIndex


def evict_lru(
    tree: TreeIndex,
    instance_id: int | None = None,
    journal: list[Evicted] | None = None,
    scan: EvictionScan | None = None,
) -> tuple[Node, Location] | None:
    """Remove the first evictable replica in the tree's eviction policy's order (least
    recently used first, see :mod:`tokenlake.tree.policy`) on ``instance_id`` if given;
    ``None`` if there is none. Any copy of a segment with several may go (pinned or not); a
    last copy goes only from an unpinned leaf; no copy of a segment an in-flight iteration
    reads goes. With ``journal``, an :class:`Evicted` record is appended so :func:`restore`
    can undo it; with ``scan`` too (and no ``instance_id``), the search resumes where the
    previous eviction into the same journal stopped (:class:`EvictionScan`)."""
    if scan is not None and journal is not None and instance_id is None:
        return scan.evict(tree, journal)
    mine = host_tier.demoting_keys(journal)
    for (key, inst), stamp in tree.policy.candidates(tree.lru, tree.node_map):
        if instance_id is not None and inst != instance_id:
            continue
        node = tree.get(key)
        if evictable(tree, node, mine):
            return _evict(tree, node, inst, stamp, journal)
    return None


def evictable(tree: TreeIndex, node: Node, mine: Container[int] = ()) -> bool:
    """Whether a replica of ``node`` may go now (see :func:`evict_lru`; ``mine``: the keys
    the evicting plan demotes, see :func:`host_tier.children_in_tier`)."""
    table, idx = tree.table, node.idx
    if table.readers[idx]:
        return False
    if table.num_replicas[idx] > 1:
        return True
    return not table.pins[idx] and (not node.children or host_tier.children_in_tier(node, mine))


def _evict(
    tree: TreeIndex, node: Node, inst: int, stamp: int, journal: list[Evicted] | None
) -> tuple[Node, Location]:
    """Take the replica; a last copy is demoted to the host tier when it has room, else it
    leaves the tree (with its descendants, all in the tier)."""
    table, idx = tree.table, node.idx
    if table.num_replicas[idx] == 1 and tree.tier.enabled:
        loc = host_tier.demote(tree, node, inst, stamp, journal)
        if loc is not None:
            return node, loc
        host_tier.forget_subtree(tree, node, journal)
    parent = node.parent if table.num_replicas[idx] == 1 else None
    access = float(table.access[idx]) if parent else 0.0
    position = int(np.flatnonzero(table.rep_inst[idx] == inst)[0])
    loc = tree.remove_replica(node, inst)
    if journal is not None:
        journal.append(Evicted(node, loc, stamp, parent, access, table.access_scale, position))
    return node, loc


class EvictionScan:
    """The eviction order of one plan, walked once instead of from its start per victim.

    A plan evicts one replica per slot it needs, often hundreds in a row, and every search
    from the head of the order passes the same pinned, read and (first pass) protected
    entries again: O(slots x replicas) per plan. Between two evictions into the same
    journal nothing but those evictions changes the tree (checked: the LRU's and the
    policy's change counters, the journal's length), and an eviction only makes other
    replicas less evictable, except that a node whose last child left may now go. So the
    walk resumes after the last victim, and such a parent, if it lies behind the walk, is
    tried first (in the order's own order): the victims are the ones a search from the
    head would choose (tests/tokenlake/test_eviction_scan.py checks this against it)."""

    def __init__(self) -> None:
        self._journal: list[Evicted] | None = None
        self._signature: tuple[int, int, int] = (0, 0, 0)
        self._walk: Iterator[tuple[tuple[int, int], int]] = iter(())
        self._blocked: list[bool] = []
        self._two_pass = False
        self._at: tuple[int, int] = (0, 0)  # (pass, stamp) of the entry last walked
        self._behind: list[tuple[tuple[int, int], tuple[int, int]]] = []  # heap
        self._mine: set[int] = set()  # keys the journal demotes to the host tier

    def __reduce__(
        self,
    ) -> tuple:  # a copy (of a pool, say) starts a new walk: this is only a cache
        return (EvictionScan, ())

    def _current(self, tree: TreeIndex, journal: list[Evicted]) -> tuple[int, int, int]:
        return (len(journal), tree.lru.version, tree.policy.num_class_changes)

    def evict(self, tree: TreeIndex, journal: list[Evicted]) -> tuple[Node, Location] | None:
        if journal is not self._journal or self._current(tree, journal) != self._signature:
            self._journal, self._behind = journal, []
            self._mine = host_tier.demoting_keys(journal)
            self._two_pass, self._at = tree.policy.splits, (0, 0)
            self._walk = tree.policy.candidates(tree.lru, tree.node_map, list(tree.lru.items()))
            # rows no eviction of this plan can take (a plan only adds readers and pins and
            # drops replicas): skipped without the full check
            t = tree.table
            self._blocked = ((t.readers > 0) | ((t.num_replicas <= 1) & (t.pins > 0))).tolist()
        victim = self._next(tree)
        if victim is None:
            self._signature = self._current(tree, journal)
            return None
        out = _evict(tree, *victim, journal)
        if journal[-1].kind == DEMOTED:
            self._mine.add(journal[-1].node.key)
        parent = _new_leaf(journal[-1])
        if (
            parent is not None
            and parent is not tree.root
            and (not parent.children or host_tier.children_in_tier(parent, self._mine))
        ):
            for loc in parent.replicas:  # a new leaf: behind the walk, it comes first
                entry = (parent.key, loc.instance_id)
                where = (int(self._two_pass and parent.protected), tree.lru.stamp_of(entry))
                if where < self._at:
                    heapq.heappush(self._behind, (where, entry))
        self._signature = self._current(tree, journal)
        return out

    def _next(self, tree: TreeIndex) -> tuple[Node, int, int] | None:
        lru = tree.lru
        while self._behind:
            (_, stamp), entry = heapq.heappop(self._behind)
            node = tree.get(entry[0])
            if entry in lru and evictable(tree, node, self._mine):
                return node, entry[1], stamp
        blocked, nodes = self._blocked, tree.node_map
        for entry, stamp in self._walk:  # entries evicted since the copy are skipped
            node = nodes[entry[0]]
            self._at = (int(self._two_pass and node.protected), stamp)
            if not blocked[node.idx] and evictable(tree, node, self._mine):
                return node, entry[1], stamp
        return None


def _new_leaf(record: Evicted) -> Node | None:
    """The parent whose last child in the pool an eviction took: the node's parent when it
    left the tree or moved to the host tier."""
    if record.kind == REPLICA:
        return record.parent  # set when the node left the tree with this copy
    return record.node.parent if record.kind == DEMOTED else None


def restore(tree: TreeIndex, evicted: Sequence[Evicted], live: Iterable[int]) -> list[bool]:
    """Undo evictions, latest first (so a parent comes back before its child). A victim
    comes back only if its place is still free: its node (or, for a last copy, its parent)
    is still in the tree, no node took its key, its instance is in ``live``, and it has no
    replica there yet. Returns, per record, whether it was restored; the caller frees the
    slots of the others. Only call this if nothing was written into the victims' slots
    since they were evicted."""
    live = set(live)
    table = tree.table
    done = [False] * len(evicted)
    resort = False
    tier_resort = False
    for i in range(len(evicted) - 1, -1, -1):
        node, loc, stamp, parent, access, scale, position, _, kind = evicted[i]
        if kind != REPLICA:  # the host tier's records
            last = tree.lru.last_stamp
            done[i] = host_tier.restore(tree, evicted[i], live)
            resort |= done[i] and kind == DEMOTED and stamp < last
            tier_resort |= done[i] and kind == TIER_DROP
            continue
        if loc.instance_id not in live:
            continue
        if parent is not None:  # the node left the tree with this copy
            attached = parent is tree.root or tree.get(parent.key) is parent
            if not attached or tree.get(node.key) is not None or node.idx >= 0:
                continue
            if parent is not tree.root and not parent.num_replicas:
                continue  # its parent left the pool for the host tier since: not below it
            if scale != table.access_scale:  # decayed since: same count, new scale
                access *= table.access_scale / scale
            tree.reattach(node, parent, access)
        elif tree.get(node.key) is not node or (
            any(r.instance_id == loc.instance_id for r in node.replicas)
            or node.num_replicas >= table.max_replicas
            or node.tier_block >= 0  # moved to the host tier since
        ):
            continue
        resort |= stamp < tree.lru.last_stamp
        tree.add_replica(node, loc, stamp=stamp, position=position)
        done[i] = True
    if resort:  # back to stamp order: an undone eviction returns to its old place
        tree.lru.resort()
    if tier_resort:
        tree.tier.lru.resort()
    return done


def drop_instance(tree: TreeIndex, instance_id: int) -> list[Location]:
    """Forget every replica on a lost instance. A node whose only replica was there goes
    with its whole subtree (those prefixes are incomplete now; segments of it in the host
    tier too); such nodes must be unpinned. Returns the freed locations on other instances."""
    lost = [n for n in tree.nodes() if lost_with(n, instance_id)]
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
    for node in list(tree.nodes()):
        if node.key not in doomed_keys and any(r.instance_id == instance_id for r in node.replicas):
            tree.remove_replica(node, instance_id)
    freed: list[Location] = []
    for node in reversed(doomed):  # descendants were pushed after their ancestors
        if tree.get(node.key) is not node:
            continue
        if not node.num_replicas:
            host_tier.discard(tree, node)
            continue
        for loc in list(node.replicas):
            tree.remove_replica(node, loc.instance_id)
            if loc.instance_id != instance_id:
                freed.append(loc)
    return freed


def lost_with(node: Node, instance_id: int) -> bool:
    """Whether ``node`` is in the pool only on ``instance_id`` (a segment only in the host
    tier survives a lost instance, unless its parent does not)."""
    replicas = node.replicas
    return bool(replicas) and all(r.instance_id == instance_id for r in replicas)
