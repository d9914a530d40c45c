"""The prefix tree's structural invariants (:meth:`PrefixTree.check_invariants`), checked
through its public methods."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenlake.tree import host_tier
from tokenlake.tree.node import Location

if TYPE_CHECKING:
    from tokenlake.tree.index import TreeIndex


def check_tree_invariants(tree: TreeIndex) -> None:
    seg, table = tree.segment_len, tree.table
    seen, stack = 0, [tree.root]
    locations: set[Location] = set()
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            assert child.key == key and child.parent is node, "child link broken"
            assert tree.get(key) is child, "child missing from the index"
            assert tree.node_at(child.idx) is child, "row index drifted"
            assert table.is_live(child.idx) and table.in_tree[child.idx], "row not live"
            assert len(node.tokens) in (0, seg), "a tail (partial segment) has children"
            assert 0 < len(child.tokens) <= seg, "segment length out of range"
            assert child.depth == node.depth + 1, "depth wrong"
            assert child.key == tree.hasher.key(node.key, child.tokens), "key mismatch"
            assert child in node.by_first[int(child.tokens[0])], "first-token index missing"
            host_tier.check_node(tree, child, node)
            if child.pin_count:
                assert node is tree.root or node.pin_count, "pins not closed under parents"
            if table.readers[child.idx]:
                assert node is tree.root or table.readers[node.idx] or node.pin_count, (
                    "readers not closed under parents"
                )
            insts = [r.instance_id for r in child.replicas]
            assert len(set(insts)) == len(insts), "two replicas on one instance"
            for loc in child.replicas:
                assert loc not in locations, f"location {loc} used twice"
                locations.add(loc)
                assert (child.key, loc.instance_id) in tree.lru, "replica missing from LRU"
            seen += 1
            stack.append(child)
        assert sum(len(v) for v in node.by_first.values()) == len(node.children), "index size"
    assert seen == tree.num_nodes == tree.num_indexed, "unreachable nodes in the index"
    assert len(tree.lru) == len(locations), "stale LRU entries"
    tree.lru.check_invariants()
    table.check_invariants()
    tier = tree.tier
    tier.check_invariants()
    blocks = [n.tier_block for n in tree.nodes() if n.tier_block >= 0]
    assert len(set(blocks)) == len(blocks), "a host-tier block held twice"
    assert len(tier.lru) == sum(n.in_tier for n in tree.nodes()), "stale tier LRU entries"
    assert all(tree.get(key) is not None for key in tier.loading), "loading a forgotten segment"
    for pending in tree.pending:
        assert pending.location not in locations, "reserved location is also committed"
