"""PrefixTree against a naive model: a dict from each committed segment's whole token prefix
(position 0 to the segment's end) to its replicas, pins and access order."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import settings
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
from tokenlake.tree.prefix_tree import CommitResult, Location, Node, PrefixTree

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
