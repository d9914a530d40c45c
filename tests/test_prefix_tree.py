"""PrefixTree against a naive model: a dict from each committed segment's whole token prefix
(position 0 to the segment's end) to its replicas, pins and access order."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tokenlake.errors import InvalidArgumentError
from tokenlake.keys import SegmentHasher
from tokenlake.prefix_tree import CommitResult, Location, Node, PrefixTree

NUM_INSTANCES = 3
TOKEN = st.integers(0, 2)


def arr(tokens) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def lcp(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Entry:
    node: Node
    replicas: list[Location]
    pins: int = 0
    last: int = 0  # node-level access order


@dataclass
class Model:
    seg: int
    entries: dict[tuple, Entry] = field(default_factory=dict)
    replica_order: dict[tuple[tuple, int], int] = field(default_factory=dict)
    clock: int = 0

    def parent(self, prefix: tuple) -> tuple:
        return prefix[: (len(prefix) - 1) // self.seg * self.seg]

    def children(self, prefix: tuple) -> list[tuple]:
        return [p for p in self.entries if len(p) > len(prefix) and self.parent(p) == prefix]

    def touch(self, path: list[tuple]) -> None:
        for p in reversed(path):
            self.clock += 1
            self.entries[p].last = self.clock
            for loc in self.entries[p].replicas:
                self.clock += 1
                self.replica_order[(p, loc.instance_id)] = self.clock

    def add(self, prefix: tuple, node: Node, loc: Location) -> None:
        self.entries[prefix] = Entry(node, [loc])
        self.replica_order[(prefix, loc.instance_id)] = 0
        self.touch([prefix])

    def add_replica(self, prefix: tuple, loc: Location) -> None:
        self.entries[prefix].replicas.append(loc)
        self.clock += 1
        self.replica_order[(prefix, loc.instance_id)] = self.clock

    def remove_replica(self, prefix: tuple, instance_id: int) -> Location:
        entry = self.entries[prefix]
        loc = next(r for r in entry.replicas if r.instance_id == instance_id)
        entry.replicas.remove(loc)
        del self.replica_order[(prefix, instance_id)]
        if not entry.replicas:
            del self.entries[prefix]
        return loc

    def evictable(self, prefix: tuple) -> bool:
        e = self.entries[prefix]
        return len(e.replicas) > 1 or (e.pins == 0 and not self.children(prefix))

    def lru_victim(self) -> tuple[tuple, Location] | None:
        cands = [
            (order, p, inst) for (p, inst), order in self.replica_order.items() if self.evictable(p)
        ]
        if not cands:
            return None
        _, p, inst = min(cands)
        return p, next(r for r in self.entries[p].replicas if r.instance_id == inst)

    def match(self, tokens: list[int]) -> tuple[list[tuple], int, list[tuple]]:
        """(full-segment prefixes, partial_len, prefixes of the equally good partials)."""
        seg, nodes, pos = self.seg, [], 0
        while pos + seg <= len(tokens) and tuple(tokens[: pos + seg]) in self.entries:
            pos += seg
            nodes.append(tuple(tokens[:pos]))
        rest, best, cands = tuple(tokens[pos : pos + seg]), 0, []
        for p in self.children(tuple(tokens[:pos])) if rest else []:
            n = lcp(p[pos:], rest)
            if n > best:
                best, cands = n, [p]
            elif n == best and n > 0:
                cands.append(p)
        return nodes, best, cands


class TreeMachine(RuleBasedStateMachine):
    @initialize(seg=st.sampled_from([2, 3, 4]))
    def setup(self, seg: int) -> None:
        self.hasher = SegmentHasher("t")
        self.tree = PrefixTree(seg, self.hasher)
        self.model = Model(seg)
        self.seg = seg
        self.slots = itertools.count()
        self.seqs: list[list[int]] = []
        self.pending: list[tuple] = []  # (PendingInsert, full prefix, parent node)
        self.pinned_paths: list[list[tuple]] = []

    # ---- helpers ------------------------------------------------------------------------
    def draw_tokens(self, data) -> list[int]:
        if self.seqs and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(self.seqs))
            cut = data.draw(st.integers(0, len(base)))
            tokens = base[:cut] + data.draw(st.lists(TOKEN, max_size=2 * self.seg))
        else:
            tokens = data.draw(st.lists(TOKEN, max_size=4 * self.seg))
        self.seqs = (self.seqs + [tokens])[-16:]
        return tokens

    def new_location(self, instance_id: int) -> Location:
        return Location(instance_id, next(self.slots))

    def node_of(self, prefix: tuple) -> Node:
        return self.model.entries[prefix].node if prefix else self.tree.root

    def check_match(self, tokens: list[int], touch: bool = False) -> None:
        m = self.tree.match(tokens, touch=touch)
        nodes, best, cands = self.model.match(tokens)
        assert m.num_tokens == len(nodes) * self.seg + best
        assert [id(n) for n in m.nodes] == [id(self.model.entries[p].node) for p in nodes]
        assert m.partial_len == best
        if best:
            assert any(m.partial is self.model.entries[p].node for p in cands)
        else:
            assert m.partial is None
        if touch:
            path = nodes + [p for p in cands if self.model.entries[p].node is m.partial]
            self.model.touch(path)

    def expect_commit(
        self, res: CommitResult, prefix: tuple, loc: Location, parent_node: Node | None
    ) -> None:
        """``parent_node`` is what the reservation's parent resolved to (None: refused)."""
        entries = self.model.entries
        parent = self.model.parent(prefix)
        alive = parent_node is not None and (
            parent_node is self.tree.root
            if not parent
            else parent in entries and entries[parent].node is parent_node
        )
        if not alive:
            assert res == CommitResult(None, False)
        elif prefix in entries:
            assert res.deduped and res.node is entries[prefix].node
        else:
            assert not res.deduped and res.node is not None
            assert res.node.replicas == [loc]
            assert res.node.parent is (entries[parent].node if parent else self.tree.root)
            assert tuple(res.node.tokens) == prefix[len(parent) :]
            self.model.add(prefix, res.node, loc)

    # ---- two-phase insert ---------------------------------------------------------------
    @rule(data=st.data())
    def insert_chain(self, data) -> None:
        """Reserve every full segment (as a request does), then commit in order or abort one."""
        tokens = self.draw_tokens(data)
        n_full = len(tokens) // self.seg
        instance_id = data.draw(st.integers(0, NUM_INSTANCES - 1))
        reserved, parent_ref = [], self.tree.root
        for i in range(n_full):
            prefix = tuple(tokens[: (i + 1) * self.seg])
            loc = self.new_location(instance_id)
            parent_ref = self.tree.reserve(parent_ref, arr(prefix[i * self.seg :]), loc)
            reserved.append((parent_ref, prefix))
            self.check_match(tokens)  # reservations are invisible
        abort_at = data.draw(st.none() | st.integers(0, max(n_full - 1, 0)))
        parent_node: Node | None = self.tree.root
        for i, (pending, prefix) in enumerate(reserved):
            if i == abort_at:
                self.tree.abort(pending)
                parent_node = None  # the writer gave up: its later segments are refused
            else:
                res = self.tree.commit(pending)
                self.expect_commit(res, prefix, pending.location, parent_node)
                parent_node = res.node
            self.check_match(tokens)
        if len(tokens) % self.seg and data.draw(st.booleans()):
            prefix = tuple(tokens)
            parent = self.model.parent(prefix)
            if parent and parent not in self.model.entries:
                return
            loc = self.new_location(instance_id)
            res = self.tree.insert(self.node_of(parent), arr(prefix[len(parent) :]), loc)
            self.expect_commit(res, prefix, loc, self.node_of(parent))

    @rule(data=st.data())
    def reserve_one(self, data) -> None:
        tokens = self.draw_tokens(data)
        matched, _, _ = self.model.match(tokens)
        i = data.draw(st.integers(0, len(matched)))
        start = i * self.seg
        if start >= len(tokens):
            return
        prefix = tuple(tokens[: start + self.seg])
        loc = self.new_location(data.draw(st.integers(0, NUM_INSTANCES - 1)))
        parent_node = self.node_of(prefix[:start])
        pending = self.tree.reserve(parent_node, arr(prefix[start:]), loc)
        self.pending.append((pending, prefix, parent_node))
        self.check_match(tokens)
        self.check_match(list(prefix))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def commit_one(self, data) -> None:
        pending, prefix, parent_node = self.pending.pop(
            data.draw(st.integers(0, len(self.pending) - 1))
        )
        self.expect_commit(self.tree.commit(pending), prefix, pending.location, parent_node)
        with pytest.raises(InvalidArgumentError, match="pending"):
            self.tree.commit(pending)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abort_one(self, data) -> None:
        pending, prefix, _ = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        before = (self.tree.num_nodes, self.tree.num_replicas, self.tree.num_evictable)
        self.tree.abort(pending)
        assert (self.tree.num_nodes, self.tree.num_replicas, self.tree.num_evictable) == before
        self.check_match(list(prefix))
        with pytest.raises(InvalidArgumentError, match="pending"):
            self.tree.abort(pending)

    # ---- reads, pins, replicas, eviction ------------------------------------------------
    @rule(data=st.data(), touch=st.booleans())
    def match(self, data, touch: bool) -> None:
        self.check_match(self.draw_tokens(data), touch=touch)

    @rule(data=st.data(), with_partial=st.booleans())
    def pin_path(self, data, with_partial: bool) -> None:
        tokens = self.draw_tokens(data)
        self.check_match(tokens)
        nodes, best, cands = self.model.match(tokens)
        m = self.tree.match(tokens)
        path = list(nodes)
        if with_partial and best:
            path += [p for p in cands if self.model.entries[p].node is m.partial]
        if not path:
            return
        for p in path:
            self.tree.pin(self.model.entries[p].node)
            self.model.entries[p].pins += 1
        self.pinned_paths.append(path)

    @precondition(lambda self: self.pinned_paths)
    @rule(data=st.data())
    def unpin_path(self, data) -> None:
        path = self.pinned_paths.pop(data.draw(st.integers(0, len(self.pinned_paths) - 1)))
        for p in path:
            self.tree.unpin(self.model.entries[p].node)
            self.model.entries[p].pins -= 1

    @rule()
    def evict_lru(self) -> None:
        expected = self.model.lru_victim()
        got = self.tree.evict_lru()
        if expected is None:
            assert got is None
            return
        prefix, loc = expected
        assert got is not None
        assert got[0] is self.model.entries[prefix].node
        assert got[1] == loc
        self.model.remove_replica(prefix, loc.instance_id)

    @precondition(lambda self: self.model.entries)
    @rule(data=st.data())
    def add_replica(self, data) -> None:
        prefix = data.draw(st.sampled_from(sorted(self.model.entries)))
        entry = self.model.entries[prefix]
        instance_id = data.draw(st.integers(0, NUM_INSTANCES - 1))
        loc = self.new_location(instance_id)
        if any(r.instance_id == instance_id for r in entry.replicas):
            with pytest.raises(InvalidArgumentError, match="location"):
                self.tree.add_replica(entry.node, loc)
        else:
            self.tree.add_replica(entry.node, loc)
            self.model.add_replica(prefix, loc)

    @precondition(lambda self: self.model.entries)
    @rule(data=st.data())
    def remove_replica(self, data) -> None:
        prefix = data.draw(st.sampled_from(sorted(self.model.entries)))
        entry = self.model.entries[prefix]
        loc = data.draw(st.sampled_from(entry.replicas))
        if len(entry.replicas) == 1 and self.model.children(prefix):
            with pytest.raises(InvalidArgumentError, match="children"):
                self.tree.remove_replica(entry.node, loc.instance_id)
        elif len(entry.replicas) > 1 or entry.pins == 0:
            node = entry.node
            assert self.tree.remove_replica(node, loc.instance_id) == loc
            self.model.remove_replica(prefix, loc.instance_id)
            if not node.replicas:
                assert self.tree.get(node.key) is None
        else:
            with pytest.raises(InvalidArgumentError, match="pinned"):
                self.tree.remove_replica(entry.node, loc.instance_id)

    # ---- invariants ---------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "tree"):
            return
        self.tree.check_invariants()
        entries = self.model.entries
        assert self.tree.num_nodes == len(entries)
        assert self.tree.num_pending == len(self.pending)
        assert self.tree.num_replicas == sum(len(e.replicas) for e in entries.values())
        assert self.tree.num_evictable == sum(
            len(e.replicas) - (1 if e.pins else 0) for e in entries.values()
        )
        for e in entries.values():
            assert e.node.replicas == e.replicas
            assert e.node.pin_count == e.pins
        by_tree = sorted(entries, key=lambda p: entries[p].node.last_access)
        assert by_tree == sorted(entries, key=lambda p: entries[p].last)

    def teardown(self) -> None:
        """Pins are path-closed, so repeated eviction frees exactly ``num_evictable`` replicas
        and leaves one copy of each pinned node."""
        if not hasattr(self, "tree"):
            return
        expected = self.tree.num_evictable
        evicted = 0
        while self.tree.evict_lru() is not None:
            evicted += 1
        assert evicted == expected
        pinned = [e for e in self.model.entries.values() if e.pins]
        assert self.tree.num_nodes == self.tree.num_replicas == len(pinned)
        assert all(len(e.node.replicas) == 1 for e in pinned)
        self.tree.check_invariants()


TestPrefixTreeMachine = TreeMachine.TestCase
TestPrefixTreeMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ---- collisions (2-bit keys: a quarter of all key pairs collide) ---------------------------
SEGS2 = list(itertools.product(range(4), repeat=2))


def colliding_pair(h: SegmentHasher) -> tuple[tuple, tuple]:
    """Two different first segments with the same key, neither keyed like the root."""
    for a, b in itertools.combinations(SEGS2, 2):
        ka, kb = h.key(h.root_key, arr(a)), h.key(h.root_key, arr(b))
        if ka == kb != h.root_key:
            return a, b
    raise AssertionError("no collision found")


@settings(max_examples=150, deadline=None)
@given(
    seg=st.sampled_from([2, 3]),
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=9), min_size=1, max_size=12),
    queries=st.lists(st.lists(st.integers(0, 3), max_size=9), max_size=12),
    evictions=st.lists(st.integers(0, 3), max_size=12),
)
def test_collisions_cost_misses_never_wrong_segments(seg, seqs, queries, evictions):
    h = SegmentHasher("t", key_bits=2)
    tree = PrefixTree(seg, h)
    truth: dict[Node, tuple] = {}  # node -> the full prefix the inserter meant
    slots = itertools.count()
    for tokens, num_evict in zip(seqs, itertools.cycle(evictions or [0])):
        parent, pos = tree.root, 0
        while pos < len(tokens):
            prefix = tuple(tokens[: pos + seg])
            res = tree.insert(parent, arr(prefix[pos:]), Location(0, next(slots)))
            tree.check_invariants()
            if res.node is None:
                break
            if res.deduped:
                assert truth[res.node] == prefix, "dedupe returned a different segment"
            truth[res.node] = prefix
            if len(prefix) % seg:
                break
            parent, pos = res.node, pos + seg
        for _ in range(num_evict):
            tree.evict_lru()
        tree.check_invariants()
    for q in queries + seqs:
        m = tree.match(q)
        for i, node in enumerate(m.nodes):
            assert truth[node] == tuple(q[: (i + 1) * seg]), "a key hit returned other tokens"
        if m.partial is not None:
            pos = len(m.nodes) * seg
            got = truth[m.partial]
            assert got[:pos] == tuple(q[:pos])
            assert got[pos : pos + m.partial_len] == tuple(q[pos : pos + m.partial_len])


def test_commit_colliding_with_other_segment_is_refused_and_never_matched():
    h = SegmentHasher("t", key_bits=2)
    tree = PrefixTree(2, h)
    a, b = colliding_pair(h)
    node_a = tree.insert(tree.root, arr(a), Location(0, 0)).node
    assert node_a is not None
    res = tree.insert(tree.root, arr(b), Location(0, 1))
    assert res == CommitResult(None, False)
    tree.check_invariants()
    assert tree.num_nodes == 1 and tree.num_replicas == 1
    m = tree.match(list(b))
    assert m.nodes == () and m.num_tokens == lcp(a, b)
    assert tree.match(list(a)).nodes == (node_a,)


def test_child_of_refused_collision_is_not_attached_to_the_colliding_segment():
    h = SegmentHasher("t", key_bits=2)
    tree = PrefixTree(2, h)
    a, b = colliding_pair(h)
    ka = h.key(h.root_key, arr(a))
    c = next(c for c in SEGS2 if h.key(ka, arr(c)) not in (ka, h.root_key))
    tree.insert(tree.root, arr(b), Location(0, 0))
    pa = tree.reserve(tree.root, arr(a), Location(0, 1))  # a request writes a, then c
    pc = tree.reserve(pa, arr(c), Location(0, 2))
    assert tree.commit(pa) == CommitResult(None, False)
    assert tree.commit(pc) == CommitResult(None, False)
    m = tree.match(list(b) + list(c))  # the KV at Location(0, 2) is for a + c, not b + c
    assert all(n.replicas != [Location(0, 2)] for n in m.nodes)
    tree.check_invariants()


def test_child_of_segment_keyed_like_root_is_not_served_as_first_segment():
    h = SegmentHasher("t", key_bits=2)
    tree = PrefixTree(2, h)
    first = next(s for s in SEGS2 if h.key(h.root_key, arr(s)) == h.root_key)
    second = next(s for s in SEGS2 if s != first and h.key(h.root_key, arr(s)) != h.root_key)
    node = tree.insert(tree.root, arr(first), Location(0, 0)).node
    tree.insert(node if node else tree.root, arr(second), Location(0, 1))
    tree.check_invariants()
    # Location(0, 1) holds the KV of `second` after `first`: never a match for `second` alone.
    assert all(n.replicas != [Location(0, 1)] for n in tree.match(list(second)).nodes)


def test_tree_owns_its_tokens():
    tree = PrefixTree(2, SegmentHasher("t"))
    buf = arr([1, 2])
    node = tree.insert(tree.root, buf, Location(0, 0)).node
    buf[:] = [2, 2]  # the caller reuses its buffer
    assert tree.match([1, 2]).nodes == (node,)
    tree.check_invariants()


def test_commit_before_parent_reservation_raises_and_changes_nothing():
    tree = PrefixTree(2, SegmentHasher("t"))
    parent = tree.reserve(tree.root, arr([1, 2]), Location(0, 0))
    child = tree.reserve(parent, arr([0, 0]), Location(0, 1))
    with pytest.raises(InvalidArgumentError, match="parent"):
        tree.commit(child)
    assert tree.num_pending == 2
    assert tree.commit(parent).node is not None
    assert tree.commit(child).node.parent is parent.result
    tree.check_invariants()


# ---- targeted behaviour -----------------------------------------------------------------
def test_touch_makes_ancestors_newer_so_leaves_are_evicted_first():
    tree = PrefixTree(2, SegmentHasher("t"))
    slots = itertools.count()
    parent, chain = tree.root, []
    for seg in ([0, 1], [1, 1], [2, 2], [0, 0]):
        node = tree.insert(parent, arr(seg), Location(0, next(slots))).node
        chain.append(node)
        parent = node
    side = tree.insert(chain[0], arr([2, 0]), Location(1, next(slots))).node
    # Inserting deepest-last left the leaf newest; one match touches the whole path.
    tree.match([0, 1, 1, 1, 2, 2, 0, 0], touch=True)
    assert [n.last_access for n in chain] == sorted((n.last_access for n in chain), reverse=True)
    evicted = [tree.evict_lru()[0] for _ in range(5)]
    assert evicted == [side, chain[3], chain[2], chain[1], chain[0]]
    assert tree.evict_lru() is None and tree.num_nodes == 0
    tree.check_invariants()


def test_pinned_last_copy_is_never_evicted_but_extra_replicas_are():
    tree = PrefixTree(2, SegmentHasher("t"))
    node = tree.insert(tree.root, arr([1, 2]), Location(0, 0)).node
    tree.add_replica(node, Location(1, 0))
    tree.pin(node)
    assert tree.num_evictable == 1
    assert tree.evict_lru() == (node, Location(0, 0))
    assert tree.evict_lru() is None
    tree.unpin(node)
    assert tree.evict_lru(instance_id=0) is None
    assert tree.evict_lru() == (node, Location(1, 0))
    with pytest.raises(InvalidArgumentError, match="node"):
        tree.pin(node)  # detached
    tree.check_invariants()


def test_remove_replica_of_node_with_children_raises():
    tree = PrefixTree(2, SegmentHasher("t"))
    parent = tree.insert(tree.root, arr([1, 2]), Location(0, 0)).node
    tree.insert(parent, arr([0]), Location(0, 1))  # a tail
    with pytest.raises(InvalidArgumentError, match="children"):
        tree.remove_replica(parent, 0)
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        tree.remove_replica(parent, 5)
    tree.add_replica(parent, Location(1, 0))
    assert tree.remove_replica(parent, 0) == Location(0, 0)  # not the last copy: fine
    assert parent.replicas == [Location(1, 0)]
    tree.check_invariants()


def test_add_replica_on_same_instance_twice_raises():
    tree = PrefixTree(2, SegmentHasher("t"))
    node = tree.insert(tree.root, arr([1, 2]), Location(0, 0)).node
    tree.add_replica(node, Location(1, 3))
    with pytest.raises(InvalidArgumentError, match="location"):
        tree.add_replica(node, Location(1, 4))
    with pytest.raises(InvalidArgumentError, match="location"):
        tree.add_replica(node, Location(0, 4))
    assert node.replicas == [Location(0, 0), Location(1, 3)]
    tree.check_invariants()


def test_reserved_segment_is_invisible_and_abort_changes_nothing():
    tree = PrefixTree(2, SegmentHasher("t"))
    pending = tree.reserve(tree.root, arr([1, 2]), Location(0, 0))
    m = tree.match([1, 2, 0])
    assert m.num_tokens == 0 and m.partial is None
    assert tree.num_nodes == 0 and tree.num_pending == 1 and tree.num_evictable == 0
    tree.check_invariants()
    tree.abort(pending)
    assert tree.num_pending == 0 and tree.num_nodes == 0 and tree.evict_lru() is None
    with pytest.raises(InvalidArgumentError, match="pending"):
        tree.commit(pending)
    tree.check_invariants()


def test_dedupe_returns_existing_node_and_partial_match_of_tail():
    tree = PrefixTree(3, SegmentHasher("t"))
    first = tree.insert(tree.root, arr([1, 2, 0]), Location(0, 0))
    again = tree.insert(tree.root, arr([1, 2, 0]), Location(1, 0))
    assert again == CommitResult(first.node, True)
    assert first.node.replicas == [Location(0, 0)]
    tail = tree.insert(first.node, arr([2, 2]), Location(0, 1)).node
    m = tree.match([1, 2, 0, 2, 2, 1, 0])
    assert m.nodes == (first.node,) and m.partial is tail and m.partial_len == 2
    assert m.num_tokens == 5
    with pytest.raises(InvalidArgumentError, match="tokens"):
        tree.reserve(tree.root, arr([1, 2, 0, 1]), Location(0, 2))
    assert tree.insert(tail, arr([1]), Location(0, 3)) == CommitResult(None, False)
    tree.check_invariants()
