"""Whole-pool invariants, checked by tests after every randomized operation."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenlake.pool import Pool


def check_pool_invariants(pool: Pool) -> None:
    """Every used slot has exactly one owner; pins equal the running requests' references;
    each request's stored length matches its segments."""
    tree, seg = pool.tree, pool.config.segment_len
    tree.check_invariants()
    for allocator in pool.allocators:
        allocator.check_invariants()

    owners: Counter = Counter()
    for node in tree.nodes():
        owners.update(node.replicas)
    expected_pins: Counter = Counter()
    num_private = 0
    inflight = pool._inflight.chunks if pool._inflight else []
    for state in pool.requests.values():
        open_len = len(state.open.tokens) if state.open else 0
        assert state.num_tokens == seg * len(state.nodes) + open_len or any(
            pc.state is state and pc.is_new for pc in inflight
        ), f"request {state.request_id!r}: stored length does not match its segments"
        assert (state.open is None) == (state.num_tokens % seg == 0), "open tail mismatch"
        if state.open:
            owners[state.open.location] += 1
        parent = tree.root
        for node in state.tree_nodes:
            assert node.parent is parent, f"request {state.request_id!r}: prefix not a chain"
            assert tree.get(node.key) is node, "pinned node no longer in the tree"
            expected_pins[node.key] += 1
            parent = node
        for node in state.private_nodes:
            owners.update(node.replicas)
            num_private += 1
        assert state.page_idx.tolist() == [n.idx for n in state.nodes], "page_idx drifted"
    for _, _, dst in pool._inflight.replications if pool._inflight else []:
        owners[dst] += 1
        assert dst.instance_id in pool.placement.live, "replica reserved on a dead instance"
    for pc in inflight:
        if pc.source is not None:
            expected_pins[pc.source.key] += 1
        for w in pc.writes:
            if w.new_slot:
                owners[w.location] += 1
    for loc, count in owners.items():
        assert count == 1, f"slot {loc} has {count} owners"
        assert pool.allocators[loc.instance_id].is_used(loc.slot_id), f"slot {loc} owned but free"
    used = sum(a.num_used for a in pool.allocators)
    assert used == len(owners), f"{used - len(owners)} used slots have no owner (leak)"
    assert tree.table.num_live == tree.num_nodes + num_private, "segment table rows leaked"
    for loc in owners:
        assert loc.instance_id in pool.placement.live, f"slot {loc} on a dead instance"
    for node in tree.nodes():
        assert node.pin_count == expected_pins[node.key], (
            f"{node!r}: pin_count {node.pin_count}, expected {expected_pins[node.key]}"
        )
