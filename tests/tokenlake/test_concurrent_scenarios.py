"""Several iterations in flight, targeted interleavings (the random ones are the state
machine of test_concurrent_iterations.py): commits in reverse order, evictions next to
another iteration's reads and writes, one replication decision at a time, drops that wait
only for the iterations using the instance, victims of one iteration kept from the next.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import Harness, tokens
from pool_state import assert_restored, assert_same_state, pool_state

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.errors import IterationStateError, PoolFullError
from tokenlake.tree.prefix_tree import Location

SEG = 8


def running(h: Harness, rid: str, seed: int, n: int) -> np.ndarray:
    ids = tokens(seed, n)
    assert h.step([[tl.Chunk(rid, ids, 0)]]) <= h.tolerance
    return ids


def decode(h: Harness, rid: str, ids: np.ndarray) -> tl.Chunk:
    return tl.Chunk(rid, np.append(ids, 3), len(ids))


def test_two_iterations_in_flight_commit_in_reverse_order_and_stay_exact():
    h = Harness(4, SEG, num_slots=16)
    a, b = running(h, "a", 1, 2 * SEG + 3), running(h, "b", 2, SEG + 5)
    shared = np.concatenate([a[: 2 * SEG], tokens(3, 5)])
    batches_1 = [[decode(h, "a", a)], [tl.Chunk("new", shared, 2 * SEG)]]
    plans_1 = h.pool.gen_plans(batches_1)
    batches_2 = [[decode(h, "b", b)]]
    plans_2 = h.pool.gen_plans(batches_2, instances=[list(h.pool.free_instances)])
    assert set(plans_1.origins).isdisjoint(plans_2.origins)
    assert h.pool.active_epochs == (plans_1.epoch, plans_2.epoch)
    with pytest.raises(IterationStateError, match=r"batches\[0\]"):
        h.pool.gen_plans([[decode(h, "a", a)]])  # "a" is in iteration 1
    h.pool.check_invariants()
    assert h.execute(plans_2, batches_2) <= h.tolerance
    assert h.execute(plans_1, batches_1) <= h.tolerance
    h.pool.commit(plans_2)
    h.pool.check_invariants()
    h.pool.commit(plans_1)
    h.pool.check_invariants()
    assert h.pool.num_stored_tokens("a") == len(a) + 1
    assert h.pool.get_stats()["num_iterations"] == 4


def test_evictions_never_take_what_another_iteration_reads_or_writes():
    """Iteration 1 reads two replicated documents and writes a new segment; iteration 2,
    planned while it is in flight in a full pool, must evict elsewhere or give up."""
    h = Harness(2, SEG, num_slots=6, balancer=BalancerConfig(replicate=False))
    doc = running(h, "doc", 1, 2 * SEG)
    h.pool.finish("doc")
    for node in h.pool.tree.match(doc).nodes:  # a copy of each on the other instance too
        other = 1 - node.replicas[0].instance_id
        slot = h.pool.allocators[other].allocate()
        src = node.replicas[0]
        h.cluster.kv_pools[other].data[:, slot] = h.cluster.kv_pools[src.instance_id].data[
            :, src.slot_id
        ]
        h.pool.tree.add_replica(node, Location(other, slot))
    ids = np.concatenate([doc, tokens(2, SEG + 2)])
    batches_1 = [[tl.Chunk("reader", ids, 2 * SEG)]]
    plans_1 = h.pool.gen_plans(batches_1)
    read = {(n.key, loc) for n in h.pool.tree.match(doc).nodes for loc in n.replicas}
    assert len(read) == 4
    # fill the rest of the pool with evictable tails, then plan a big new request
    free_left = sum(a.num_free for a in h.pool.allocators)
    for i in range(free_left):
        running(h, f"t{i}", 10 + i, 3)
        h.pool.finish(f"t{i}")
    big = [[tl.Chunk("big", tokens(99, 3 * SEG), 0)]]
    try:
        plans_2 = h.pool.gen_plans(big)
    except PoolFullError:
        plans_2 = None
    h.pool.check_invariants()
    still = {(n.key, loc) for n in h.pool.tree.match(doc).nodes for loc in n.replicas}
    assert still == read, "an iteration in flight lost a copy it reads"
    assert h.execute(plans_1, batches_1) <= h.tolerance
    if plans_2 is not None:
        assert h.execute(plans_2, big) <= h.tolerance
        h.pool.commit(plans_2)
    h.pool.commit(plans_1)
    h.pool.check_invariants()


def test_one_replication_decision_in_flight_at_a_time():
    balancer = BalancerConfig(interval=1, overload_factor=1.0, max_replica_fraction=0.5)
    h = Harness(2, SEG, num_slots=24, balancer=balancer)
    doc = tokens(1, 4 * SEG)

    def readers(i: int, n: int) -> list[list[tl.Chunk]]:
        chunks = []
        for j in range(n):
            ids = np.concatenate([doc, tokens(100 * i + j, 3)])
            chunks.append(tl.Chunk(f"r{i}.{j}", ids, min(h.cached(ids), len(ids) - 1)))
        return [chunks]

    for i in range(12):  # many readers of one document: a heavy hitter
        batches = readers(i, 3)
        plans_1 = h.pool.gen_plans(batches)
        it_1 = h.pool.iterations_in_flight()[0]
        if it_1.replications:
            break
        assert h.execute(plans_1, batches) <= h.tolerance
        h.pool.commit(plans_1)
        for c in batches[0]:
            h.pool.finish(c.request_id)
    assert it_1.replications, "no replication ordered"
    plans_2 = h.pool.gen_plans(readers(50, 1))
    it_2 = h.pool.iterations_in_flight()[1]
    assert not it_2.decided_replication and not it_2.replications
    h.pool.check_invariants()
    h.pool.abort(plans_1, executed=False)  # its orders are gone; a later epoch decides again
    plans_3 = h.pool.gen_plans(batches)
    assert h.pool.iterations_in_flight()[1].replications
    for plans in (plans_3, plans_2):
        h.pool.abort(plans, executed=False)
    h.pool.check_invariants()


def test_drop_instance_waits_only_for_iterations_that_use_it():
    h = Harness(4, SEG, num_slots=16, balancer=BalancerConfig(replicate=False))
    ids = running(h, "a", 1, SEG + 3)
    batches = [[decode(h, "a", ids)]]
    plans = h.pool.gen_plans(batches)
    (it,) = h.pool.iterations_in_flight()
    used = sorted(it.instances)
    unused = [i for i in h.pool.live_instances if i not in it.instances]
    assert unused
    for instance_id in used:
        before = pool_state(h.pool)
        with pytest.raises(IterationStateError, match=str(plans.epoch)):
            h.pool.drop_instance(instance_id)
        assert_same_state(before, pool_state(h.pool))
    assert h.pool.drop_instance(unused[0]) == []
    h.pool.check_invariants()
    assert h.execute(plans, batches) <= h.tolerance
    h.pool.commit(plans)
    h.pool.restore_instance(unused[0])
    h.pool.check_invariants()


def test_victims_of_one_iteration_are_invisible_to_the_next_and_restored_after_both():
    h = Harness(2, SEG, num_slots=3, balancer=BalancerConfig(replicate=False))
    old = running(h, "old", 1, 2 * SEG + 2)
    h.pool.finish("old")  # 3 evictable segments: two sealed, one tail
    keep = running(h, "keep", 2, SEG + 1)  # 2 pinned slots
    before = pool_state(h.pool)
    batches = [[tl.Chunk("new", tokens(3, 2 * SEG), 0)]]
    plans_1 = h.pool.gen_plans(batches)
    (it_1,) = h.pool.iterations_in_flight()
    assert it_1.victims
    assert h.cached(old) < len(old), "a tentative victim is still matched"
    plans_2 = h.pool.gen_plans([[decode(h, "keep", keep)]])
    h.pool.abort(plans_1, executed=False)
    h.pool.check_invariants()
    assert h.cached(old) == len(old), "victims not restored"
    h.pool.abort(plans_2, executed=False)
    assert_restored(before, pool_state(h.pool))
