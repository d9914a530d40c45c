"""``abort`` undoes everything ``gen_plans`` changed, and knows when it must not.

Before execution (``executed=False``) the pool comes back exactly — tree, LRU order, access
counts, load window, counters, slots, evicted victims. After a partial execution (a peer died
mid-iteration) the victims' slots may hold the aborted iteration's data, so they stay evicted
and nothing ever reads them as the victims' KV. Plans are bound to their pool and epoch.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness import Harness, tokens
from pool_state import assert_restored, assert_same_state, pool_state

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.errors import StalePlanError
from tokenlake.tree.prefix_tree import Location


def crowded(seed: int, num_slots: int = 9, replicate: bool = True) -> tuple[Harness, dict]:
    """A small pool full of finished requests' segments (evictable), some replicated, with
    two requests still running; returns the harness and the running requests' tokens."""
    balancer = BalancerConfig(interval=1, overload_factor=1.0, replicate=replicate)
    h = Harness(2, 16, num_slots=num_slots, balancer=balancer)
    rng = np.random.default_rng(seed)
    doc = tokens(seed, 16 * 2)
    for i in range(8):
        ids = np.concatenate([doc, tokens(100 * seed + i, int(rng.integers(3, 20)))])
        h.step([[tl.Chunk(f"old{i}", ids, min(h.cached(ids), len(ids) - 1))]])
        h.pool.finish(f"old{i}")
    running = {}
    for rid in ("a", "b"):
        ids = tokens(1000 * seed + ord(rid), 16 + 5)
        h.step([[tl.Chunk(rid, ids, 0)]])
        running[rid] = ids
    return h, running


def next_batches(h: Harness, running: dict, seed: int) -> list[list[tl.Chunk]]:
    """Decode steps of the running requests and two new requests, one sharing the document
    (copy-on-extend of a partial tail or a hit) and one long enough to force evictions."""
    batches = [[tl.Chunk(rid, np.append(ids, 7), len(ids))] for rid, ids in running.items()]
    shared = np.concatenate([tokens(seed, 16 * 2), tokens(5, 9)])
    fresh = tokens(77 + seed, 16 * 3 + 4)
    batches[0].append(tl.Chunk("new-shared", shared, min(h.cached(shared), len(shared) - 1)))
    batches[1].append(tl.Chunk("new-fresh", fresh, 0))
    return batches


@pytest.mark.parametrize("seed", range(6))
def test_abort_before_execution_restores_the_pool_exactly(seed):
    h, running = crowded(seed)
    before = pool_state(h.pool)
    plans = h.pool.gen_plans(next_batches(h, running, seed))
    (it,) = h.pool.iterations_in_flight()
    assert it.victims, "the scenario must make gen_plans evict"
    h.pool.check_invariants()
    h.pool.abort(plans, executed=False)
    assert_restored(before, pool_state(h.pool))
    h.pool.check_invariants()
    # the aborted epoch is never handed out again; its plans stay stale
    again = h.pool.gen_plans(next_batches(h, running, seed))
    assert again.epoch == plans.epoch + 1
    with pytest.raises(StalePlanError):
        h.pool.commit(plans)
    h.pool.abort(again, executed=False)
    assert_restored(before, pool_state(h.pool))


def test_abort_undoes_a_replication_decision_and_its_victims():
    """Readers of a hot document in a full pool: an iteration that both orders replicas
    (reserving slots, some by eviction) and evicts for its own writes is aborted."""
    balancer = BalancerConfig(interval=1, overload_factor=1.0, max_replica_fraction=0.5)
    h = Harness(2, 16, num_slots=10, balancer=balancer)
    doc = tokens(1, 16 * 4)
    found = False
    for i in range(12):
        batch = []
        for j in range(3):
            ids = np.concatenate([doc, tokens(10 + 3 * i + j, 5)])
            batch.append(tl.Chunk(f"r{i}.{j}", ids, min(h.cached(ids), len(ids) - 1)))
        before = pool_state(h.pool)
        plans = h.pool.gen_plans([batch])
        (it,) = h.pool.iterations_in_flight()
        if it.replications and it.victims:
            found = True
            h.pool.abort(plans, executed=False)
            assert_restored(before, pool_state(h.pool))
            h.pool.check_invariants()
            plans = h.pool.gen_plans([batch])
        h.pool.abort(plans, executed=False)
        h.step([batch])
        for j in range(3):
            h.pool.finish(f"r{i}.{j}")
    assert found, "no iteration both replicated and evicted"


def partial_execution(h: Harness, plans: tl.Plans, batches) -> None:
    """Every sub-batch puts its layer-0 KV, then the iteration dies (a peer failed)."""
    chunks = {c.request_id: c for batch in batches for c in batch}
    for qp, tp in zip(plans.query_plans, plans.transfer_plans, strict=True):
        engine = h.cluster.engine(qp.origin)
        engine.init_query(qp)
        kv_buf = engine.init_transfer(tp)
        for r, rid in enumerate(qp.request_ids):
            lo, hi = int(qp.q_indptr[r]), int(qp.q_indptr[r + 1])
            first = int(qp.positions[r])
            ids = chunks[rid].token_ids[first : first + hi - lo]
            kv_buf[0, lo:hi] = h.model.kv(ids, np.arange(first, first + hi - lo), 0)
        engine.put(kv_buf, 0)


@pytest.mark.parametrize("seed", range(4))
def test_abort_after_partial_execution_keeps_victims_evicted_and_answers_stay_exact(seed):
    h, running = crowded(seed, replicate=False)
    batches = next_batches(h, running, seed)
    plans = h.pool.gen_plans(batches)
    (it,) = h.pool.iterations_in_flight()
    victims = [(v.node.key, v.location) for v in it.victims]
    assert victims
    data = [p.data.clone() for p in h.cluster.kv_pools]
    partial_execution(h, plans, batches)
    written = [
        loc
        for _, loc in victims
        if not bool(
            (
                h.cluster.kv_pools[loc.instance_id].data[:, loc.slot_id]
                == data[loc.instance_id][:, loc.slot_id]
            ).all()
        )
    ]
    h.pool.abort(plans)  # executed=True: the default
    h.pool.check_invariants()
    # no victim is back in the tree: a restored one would serve the overwritten KV
    tree_locations = {loc for n in h.pool.tree.nodes() for loc in n.replicas}
    for key, loc in victims:
        node = h.pool.tree.get(key)
        assert node is None or loc not in node.replicas
        assert loc not in tree_locations
    stats = h.pool.get_stats()
    assert stats["num_evictions"] >= len(victims)
    # the same work re-planned and executed in full is exact, whatever the slots held
    err = h.step(next_batches(h, running, seed))
    assert err <= h.tolerance
    h.pool.check_invariants()
    assert written, "the partial execution should have overwritten a victim's slot"


def test_restoring_after_execution_would_have_served_overwritten_kv():
    """The naive alternative, checked directly: put a victim back after a partial execution
    and a query over it is wrong. This is why ``abort`` defaults to ``executed=True``."""
    h, running = crowded(0, replicate=False)
    batches = next_batches(h, running, 0)
    plans = h.pool.gen_plans(batches)
    (it,) = h.pool.iterations_in_flight()
    partial_execution(h, plans, batches)
    h.pool.abort(plans, executed=False)  # wrong on purpose: the slots were written
    restored = [v for v in it.victims if v.location in v.node.replicas]
    assert restored
    errs = []
    for i, victim in enumerate(restored):
        node = victim.node
        prefix = []
        while node is not h.pool.tree.root:
            prefix.append(node.tokens)
            node = node.parent
        ids = np.concatenate([*reversed(prefix), tokens(4242 + i, 3)]).astype(np.int32)
        hit = min(h.cached(ids), len(ids) - 1)
        errs.append(h.step([[tl.Chunk(f"reader{i}", ids, hit)]]))
    assert max(errs) > h.tolerance, "a restored victim should have read overwritten data"


def test_commit_refuses_another_pools_plans_with_the_same_epoch():
    a, b = Harness(2, 16, num_slots=8), Harness(2, 16, num_slots=8)
    ids = tokens(1, 20)
    plans_a = a.pool.gen_plans([[tl.Chunk("r", ids, 0)]])
    plans_b = b.pool.gen_plans([[tl.Chunk("r", ids, 0)]])
    assert plans_a.epoch == plans_b.epoch
    before = pool_state(b.pool)
    for forged in (plans_a, dataclasses.replace(plans_b), dataclasses.replace(plans_a, pool_id="")):
        with pytest.raises(StalePlanError, match="plans"):
            b.pool.commit(forged)
        with pytest.raises(StalePlanError, match="plans"):
            b.pool.abort(forged)
        assert_same_state(before, pool_state(b.pool))
    assert not a.pool.is_active(plans_b) and b.pool.is_active(plans_b)
    b.pool.commit(plans_b)
    a.pool.abort(plans_a)
    a.pool.check_invariants()
    b.pool.check_invariants()


def test_a_new_requests_prefix_is_matched_once_per_iteration():
    h = Harness(2, 16, num_slots=32)
    doc = tokens(1, 16 * 3)
    h.step([[tl.Chunk("w", doc, 0)]])
    calls = []
    match = h.pool.tree.match
    h.pool.tree.match = lambda *a, **k: calls.append(1) or match(*a, **k)
    batches = [
        [tl.Chunk("w", np.append(doc, 1), len(doc))],  # running: never matched
        [tl.Chunk(f"n{i}", np.concatenate([doc, tokens(i, 9)]), 48) for i in range(3)],
    ]
    plans = h.pool.gen_plans(batches)
    assert len(calls) == 3
    h.pool.commit(plans)
    assert len(calls) == 3


def test_replicas_have_one_source_of_truth():
    h = Harness(2, 16, num_slots=8)
    h.step([[tl.Chunk("a", tokens(1, 20), 0)]])
    node = h.pool.tree.match(tokens(1, 16)).nodes[0]
    other = 1 - node.replicas[0].instance_id
    h.pool.tree.add_replica(node, Location(other, h.pool.allocators[other].allocate()))
    got = node.replicas
    got.pop()  # a copy: changing it changes nothing
    assert len(node.replicas) == len(got) + 1
    table = h.pool.tree.table
    assert node.replicas == [Location(*r) for r in table.replicas(node.idx)]
    assert "replicas" not in type(node).__slots__
