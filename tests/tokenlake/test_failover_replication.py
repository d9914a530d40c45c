"""Fail-over re-replication: after ``drop_instance`` the next ``gen_plans`` decides
replications at once (not at the balancer's next interval), and each heavy hitter that lost
a replica gets a copy on the least-loaded live instance even with no instance overloaded.
Cold segments do not; the budget holds; the orders are part of the iteration (abort undoes
them, commit settles them) and queries stay exact over the new copies."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness import Harness, tokens
from pool_state import assert_restored, pool_state

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig, plan_replications
from tokenlake.engines.dataplane_config import PeerFailedError
from tokenlake.tree.prefix_tree import Location

SEG = 16
# decisions only at epoch 1 and 1001 (any other is fail-over's), no instance ever counts as
# overloaded, and with 3 or 4 live instances the heavy hitters are the top ceil(k·N·ln N): 1
QUIET = BalancerConfig(interval=1000, overload_factor=1e6, heavy_hitter_k=0.15)


def harness(balancer: BalancerConfig) -> Harness:
    """Four instances on a LocalCluster whose ``mark_lost`` (what ``Harness.fail_over``
    calls) garbles the lost instance's KV, so a plan that still read there would be wrong."""
    h = Harness(4, SEG, num_slots=32, balancer=balancer)
    h.cluster.mark_lost = lambda i: h.cluster.kv_pools[i].data.fill_(1e4)
    return h


def lose(h: Harness, instance_id: int) -> list:
    failed = h.pool.drop_instance(instance_id)
    h.cluster.mark_lost(instance_id)
    return failed


def replicate_by_hand(h: Harness, node, dst: int) -> None:
    """A second copy of ``node`` on ``dst``: the data first, then the tree."""
    src = node.replicas[0]
    slot = h.pool.allocators[dst].allocate()
    pools = h.cluster.kv_pools
    pools[dst].data[:, slot] = pools[src.instance_id].data[:, src.slot_id]
    h.pool.tree.add_replica(node, Location(dst, slot))


def hot_and_cold(
    balancer: BalancerConfig = QUIET, docs: int = 2, reads: tuple[int, ...] = (6, 1)
) -> tuple[Harness, list, list, int]:
    """Four instances; ``docs`` one-segment documents, document ``d`` read by ``reads[d]``
    requests (the first hot, the last cold), each with a second copy on one shared instance
    ``b`` (none's first copy). Returns the harness, the documents' tokens, their nodes, b."""
    h = harness(balancer)
    texts = [tokens(100 + d, SEG) for d in range(docs)]
    for d, doc in enumerate(texts):
        h.step([[tl.Chunk(f"w{d}", np.append(doc, [1, 2]), 0)]])
        h.pool.finish(f"w{d}")
    nodes = [h.pool.tree.match(doc).nodes[0] for doc in texts]
    firsts = {n.replicas[0].instance_id for n in nodes}
    b = min(set(range(4)) - firsts)
    for node in nodes:
        replicate_by_hand(h, node, b)
    for d, doc in enumerate(texts):
        for r in range(reads[d]):
            rid = f"read{d}.{r}"
            h.step([[tl.Chunk(rid, np.concatenate([doc, tokens(1000 * d + r, 3)]), SEG)]])
            h.pool.finish(rid)
    h.pool.check_invariants()
    for node in nodes:
        assert {r.instance_id for r in node.replicas} == {node.replicas[0].instance_id, b}
    return h, texts, nodes, b


def fresh_batch(seed: int) -> list[list[tl.Chunk]]:
    return [[tl.Chunk(f"fresh{seed}", tokens(5000 + seed, 5), 0)]]


def ordered(it) -> dict:
    """The iteration's replication orders: node key -> destination instance."""
    return {node.key: dst.instance_id for node, _, dst in it.replications}


def test_hot_segment_regains_a_copy_in_the_next_iteration_cold_does_not():
    h, _, (hot, cold), b = hot_and_cold()
    a = hot.replicas[0].instance_id
    plans = h.pool.gen_plans(fresh_batch(0))  # without a drop: no decision off the interval
    assert not h.pool.iterations_in_flight()[0].decided_replication
    h.pool.abort(plans, executed=False)
    lose(h, b)
    assert [r.instance_id for r in hot.replicas] == [a]
    load = h.pool.access.window_load
    live = h.pool.live_instances
    assert plan_replications(h.pool.tree, h.pool.access, list(live), QUIET) == []  # load alone
    plans = h.pool.gen_plans(fresh_batch(1))
    (it,) = h.pool.iterations_in_flight()
    assert it.decided_replication
    assert ordered(it) == {hot.key: ordered(it)[hot.key]}  # the hot one only, not the cold
    dst = ordered(it)[hot.key]
    assert dst in live and dst != a
    assert dst == min((i for i in live if i != a), key=lambda i: load[i])  # least loaded
    tp_copies = {
        (int(s), int(d))
        for tp in plans.transfer_plans
        for s, d in zip(tp.copy_src_instance, tp.copy_dst_instance, strict=True)
    }
    assert (a, dst) in tp_copies  # part of this iteration's transfer plan
    err = h.execute(plans, fresh_batch(1))
    h.pool.commit(plans)
    h.cluster.retire(plans.epoch)
    h.pool.check_invariants()
    assert err <= h.tolerance
    assert {r.instance_id for r in hot.replicas} == {a, dst}
    assert len(cold.replicas) == 1
    # settled: the next iteration makes no decision of its own
    h.step(fresh_batch(2))
    plans = h.pool.gen_plans(fresh_batch(3))
    assert not h.pool.iterations_in_flight()[0].decided_replication
    h.pool.abort(plans, executed=False)


@pytest.mark.parametrize("executed", [False, True])
def test_abort_of_the_fail_over_iteration_leaves_the_pool_exactly_as_before(executed):
    h, texts, (hot, _), b = hot_and_cold()
    lose(h, b)
    before = pool_state(h.pool)
    batch = [[tl.Chunk("reader", np.concatenate([texts[0], tokens(7, 4)]), SEG)]]
    plans = h.pool.gen_plans(batch)
    (it,) = h.pool.iterations_in_flight()
    assert hot.key in ordered(it) and not it.victims
    h.pool.check_invariants()
    h.pool.abort(plans, executed=executed)
    assert_restored(before, pool_state(h.pool))
    h.pool.check_invariants()
    # the fail-over is still pending: the next iteration orders the copy again
    plans = h.pool.gen_plans(batch)
    (it,) = h.pool.iterations_in_flight()
    assert hot.key in ordered(it)
    h.pool.abort(plans, executed=False)
    assert_restored(before, pool_state(h.pool))


@pytest.mark.parametrize(
    ("budget", "expect"),
    [
        ({"max_replications": 1}, 1),
        ({"max_replica_fraction": 0.0}, 0),
        ({"replicate": False}, 0),
        ({}, 2),
    ],
    ids=["max_replications", "max_replica_fraction", "replicate-off", "unbounded"],
)
def test_fail_over_copies_respect_the_budget(budget, expect):
    # three documents lose a copy; the top ceil(0.6·3·ln 3) = 2 are heavy hitters
    balancer = dataclasses.replace(QUIET, heavy_hitter_k=0.6, **budget)
    h, _, nodes, b = hot_and_cold(balancer, docs=3, reads=(6, 4, 1))
    lose(h, b)
    h.step(fresh_batch(0))
    copies = [len(n.replicas) - 1 for n in nodes]
    assert sum(copies) == expect
    assert copies[2] == 0  # the cold one never
    if expect == 1:
        assert copies[0] == 1  # the hottest first
    extra = h.pool.tree.num_replicas - h.pool.tree.num_nodes
    capacity = h.config.num_slots * len(h.pool.live_instances)
    assert extra <= max(0, int(balancer.max_replica_fraction * capacity))
    h.pool.check_invariants()


def test_restore_instance_also_triggers_a_decision_and_pending_copies_may_go_there():
    h, _, (hot, cold), b = hot_and_cold()
    a = hot.replicas[0].instance_id
    h.pool.drop_instance(b)
    h.pool.restore_instance(b)  # restarted, empty: before any iteration ran
    plans = h.pool.gen_plans(fresh_batch(0))
    (it,) = h.pool.iterations_in_flight()
    assert it.decided_replication
    assert set(ordered(it)) == {hot.key} and ordered(it)[hot.key] != a
    h.pool.abort(plans, executed=False)
    h.step(fresh_batch(0))
    assert len(hot.replicas) == 2 and len(cold.replicas) == 1
    # a restore alone (the drop's decision already committed) also decides at once
    c = min(set(h.pool.live_instances) - {r.instance_id for n in (hot, cold) for r in n.replicas})
    h.pool.drop_instance(c)
    h.step(fresh_batch(1))
    plans = h.pool.gen_plans(fresh_batch(2))
    assert not h.pool.iterations_in_flight()[0].decided_replication
    h.pool.abort(plans, executed=False)
    h.pool.restore_instance(c)
    plans = h.pool.gen_plans(fresh_batch(2))
    assert h.pool.iterations_in_flight()[0].decided_replication
    h.pool.abort(plans, executed=False)
    h.pool.check_invariants()


def test_queries_stay_exact_after_fail_over_and_the_original_copy_is_lost_too():
    """An iteration in flight hits a dead peer; the harness fails over (abort, drop, mark
    lost); the next iteration re-replicates the hot document; then its first copy's instance
    dies as well: readers are served exactly from the fail-over copy (and its own copy)."""
    h, texts, (hot, _), b = hot_and_cold()
    a = hot.replicas[0].instance_id
    batch = [[tl.Chunk("r0", np.concatenate([texts[0], tokens(11, 4)]), SEG)]]
    plans = h.pool.gen_plans(batch)
    failed = h.fail_over(plans, PeerFailedError(b, "transfer", "killed"))
    assert failed == []
    assert h.step(batch) <= h.tolerance  # the re-planned reader, with the fail-over copy
    (dst,) = {r.instance_id for r in hot.replicas} - {a}
    h.pool.finish("r0")
    lose(h, a)
    assert [r.instance_id for r in hot.replicas] == [dst]
    for i in range(4):
        ids = np.concatenate([texts[0], tokens(20 + i, 5)])
        assert h.cached(ids) == SEG
        assert h.step([[tl.Chunk(f"after{i}", ids, SEG)]]) <= h.tolerance
        if i == 0:  # read from the fail-over copy, which is itself copied again (it lost one)
            assert {int(x) for x in h.last_plans.query_plans[0].holder_ids} == {dst}
            assert len(hot.replicas) == 2 and hot.replicas[0].instance_id == dst
    h.pool.check_invariants()
