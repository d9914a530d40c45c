"""PrefixTree: key collisions (2-bit keys) and targeted behaviour (touch order, replicas,
reservations, dedupe, tails)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_prefix_tree import arr, lcp

from tokenlake.errors import InvalidArgumentError
from tokenlake.keys import SegmentHasher
from tokenlake.tree.prefix_tree import CommitResult, Location, Node, PrefixTree

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


@settings(max_examples=150, deadline=None)
@given(
    seg=st.sampled_from([2, 3]),
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), max_size=9),  # a sequence to insert
            st.integers(0, 3),  # evictions after it
            st.integers(0, 4),  # which remembered query to match again
            st.lists(st.integers(0, 3), max_size=4),  # tokens it grows by first
        ),
        min_size=1,
        max_size=14,
    ),
)
def test_resumed_match_equals_a_fresh_match(seg, steps):
    """Matching again from an earlier match of the same (or a shorter) token list gives what
    matching from the root gives, through inserts, evictions and key collisions."""
    tree = PrefixTree(seg, SegmentHasher("t", key_bits=2))
    slots = itertools.count()
    remembered: list[tuple[list[int], object]] = []
    for tokens, num_evict, pick, grow in steps:
        parent, pos = tree.root, 0
        while pos < len(tokens):
            res = tree.insert(parent, arr(tokens[pos : pos + seg]), Location(0, next(slots)))
            if res.node is None or len(tokens) - pos < seg:
                break
            parent, pos = res.node, pos + seg
        for _ in range(num_evict):
            tree.evict_lru()
        remembered.append((list(tokens), tree.match(tokens)))
        query, before = remembered[pick % len(remembered)]
        query = query + grow
        fresh, resumed = tree.match(query), tree.match(query, resume=before)
        assert resumed.nodes == fresh.nodes
        assert (resumed.partial, resumed.partial_len) == (fresh.partial, fresh.partial_len)
        remembered[pick % len(remembered)] = (query, resumed)
