"""Whole-pool invariants, checked by tests after every randomized operation."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tokenlake.tree.node import DEMOTED

if TYPE_CHECKING:
    from tokenlake.cluster.slots import SlotAllocator
    from tokenlake.iteration.record import Iteration
    from tokenlake.iteration.requests import RequestState
    from tokenlake.tree.prefix_tree import PrefixTree


def check_pool_invariants(
    *,
    tree: PrefixTree,
    allocators: Sequence[SlotAllocator],
    requests: Mapping[int | str, RequestState],
    iterations: Sequence[Iteration],
    live: Iterable[int],
    in_flight_epoch: Callable[[int | str], int | None],
) -> None:
    """Every used slot has exactly one owner; pins and readers equal what running requests
    and iterations in flight hold; every used host-tier block one owner (a segment, or the
    iteration demoting a segment forgotten since) and the loads in flight are the
    iterations'; each request's stored length matches its segments;
    iterations in flight have disjoint requests and compute instances."""
    seg = tree.segment_len
    tree.check_invariants()
    for allocator in allocators:
        allocator.check_invariants()
    live = set(live)

    owners: Counter = Counter()
    for node in tree.nodes():
        owners.update(node.replicas)
    expected_pins: Counter = Counter()
    num_private = 0
    new_in_flight = {id(pc.state) for it in iterations for pc in it.new_chunks}
    for state in requests.values():
        open_len = len(state.open.tokens) if state.open else 0
        assert state.num_tokens == seg * len(state.nodes) + open_len or id(state) in (
            new_in_flight
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

    readers = np.zeros(tree.table.capacity, dtype=np.int64)
    loading: Counter = Counter()
    orphan_blocks: list[int] = []
    seen_requests: set = set()
    seen_origins: set[int] = set()
    for it in iterations:
        rids = set(it.chunk_set.request_ids)
        assert len(rids) == len(it.chunk_set), "a request twice in one iteration"
        assert not rids & seen_requests, "a request is in two iterations in flight"
        assert not it.origins & seen_origins, "two iterations in flight run on one instance"
        seen_requests |= rids
        seen_origins |= it.origins
        assert it.instances <= live, "an iteration in flight uses a dead instance"
        for rid, state in zip(it.chunk_set.request_ids, it.chunk_set.states, strict=True):
            assert in_flight_epoch(rid) == it.epoch, "busy table drifted"
            assert requests.get(rid) is state, "in-flight request lost"
        for pc in it.chunks:
            if pc.source is not None:
                expected_pins[pc.source.key] += 1
            for w in pc.writes:
                if w.new_slot:
                    owners[w.location] += 1
        for _, _, dst in it.replications:
            owners[dst] += 1
        for node, loc in it.loads:
            owners[loc] += 1
            loading[node.key] += 1
            assert node.tier_block >= 0 and node.pin_count, (
                "a load of a segment not pinned in the tier"
            )
        for v in it.victims:
            if (
                v.kind == DEMOTED
                and tree.get(v.node.key) is not v.node
                or (v.kind == DEMOTED and v.node.tier_block != v.block)
            ):
                orphan_blocks.append(v.block)  # its segment was forgotten: the block waits
        np.add.at(readers, it.all_read_idx(), 1)
    for loc, count in owners.items():
        assert count == 1, f"slot {loc} has {count} owners"
        assert allocators[loc.instance_id].is_used(loc.slot_id), f"slot {loc} owned but free"
        assert loc.instance_id in live, f"slot {loc} on a dead instance"
    used = sum(a.num_used for a in allocators)
    assert used == len(owners), f"{used - len(owners)} used slots have no owner (leak)"
    assert tree.table.num_live == tree.num_nodes + num_private, "segment table rows leaked"
    assert np.array_equal(readers, tree.table.readers), "readers differ from iterations in flight"
    num_busy = sum(len(it.chunk_set) for it in iterations)
    assert sum(in_flight_epoch(r) is not None for r in requests) == num_busy, (
        "a request marked in flight belongs to no iteration"
    )
    for node in tree.nodes():
        assert node.pin_count == expected_pins[node.key], (
            f"{node!r}: pin_count {node.pin_count}, expected {expected_pins[node.key]}"
        )
    tier = tree.tier
    assert loading == tier.loading, "host-tier loads differ from iterations in flight"
    blocks = [n.tier_block for n in tree.nodes() if n.tier_block >= 0] + orphan_blocks
    assert len(set(blocks)) == len(blocks) == tier.num_used, "host-tier blocks leaked or shared"
    check_no_shared_slots(iterations)


def _slots(plans) -> tuple[set, set]:
    """``(read, written)`` (instance, slot) pairs of one iteration's plans."""
    read, written = set(), set()
    for qp in plans.query_plans:
        for h, instance_id in enumerate(qp.holder_ids.tolist()):
            lo, hi = int(qp.holder_indptr[h]), int(qp.holder_indptr[h + 1])
            pages = qp.kv_indices[int(qp.kv_indptr[lo]) : int(qp.kv_indptr[hi])]
            read.update((instance_id, s) for s in pages.tolist())
    for tp in plans.transfer_plans:
        for d, instance_id in enumerate(tp.dst_ids.tolist()):
            lo, hi = int(tp.dst_indptr[d]), int(tp.dst_indptr[d + 1])
            written.update((instance_id, s) for s in tp.run_dst_slot[lo:hi].tolist())
        read.update(zip(tp.copy_src_instance.tolist(), tp.copy_src_slot.tolist(), strict=True))
        written.update(zip(tp.copy_dst_instance.tolist(), tp.copy_dst_slot.tolist(), strict=True))
        # the host tier's blocks as instance -1
        read.update(zip(tp.demote_src_instance.tolist(), tp.demote_src_slot.tolist(), strict=True))
        written.update((-1, b) for b in tp.demote_dst_block.tolist())
        read.update((-1, b) for b in tp.load_src_block.tolist())
        written.update(zip(tp.load_dst_instance.tolist(), tp.load_dst_slot.tolist(), strict=True))
    return read, written


def check_no_shared_slots(iterations) -> None:
    """No iteration in flight reads or writes a slot another one writes: no reader sees
    another iteration's pending writes, and no two iterations write one slot."""
    slots = [(it.epoch, *_slots(it.plans)) for it in iterations if it.plans is not None]
    for i, (epoch_a, read_a, written_a) in enumerate(slots):
        for epoch_b, read_b, written_b in slots[i + 1 :]:
            assert not read_a & written_b and not read_b & written_a, (
                f"iterations {epoch_a} and {epoch_b}: one reads a slot the other writes"
            )
            assert not written_a & written_b, f"iterations {epoch_a} and {epoch_b} write one slot"
