"""Heavy hitters against an exact counter, power-of-two choice, and replication balancing
a Zipf-skewed workload; randomized replicate/evict/pin/abort with invariants."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Harness, tokens

import tokenlake as tl
from tokenlake import _C
from tokenlake.cluster.balancer import AccessStats, BalancerConfig, heavy_hitters
from tokenlake.keys import SegmentHasher
from tokenlake.tree.prefix_tree import Location, PrefixTree


@pytest.mark.parametrize("decay", [1.0, 0.9])
@pytest.mark.parametrize("seed", range(5))
def test_heavy_hitters_equal_exact_top_k(seed, decay):
    rng = np.random.default_rng(seed)
    tree = PrefixTree(2, SegmentHasher("hh"))
    stats = AccessStats(4, tree, BalancerConfig(decay=decay))
    slots = iter(range(10**6))
    nodes = [tree.root]
    for _ in range(300):  # a random tree: attach under a random existing node
        parent = nodes[int(rng.integers(len(nodes)))]
        res = tree.insert(parent, rng.integers(0, 50, 2).astype(np.int32), Location(0, next(slots)))
        if res.node is not None and not res.deduped:
            nodes.append(res.node)
    exact: dict[int, float] = {}
    for _ in range(60):  # iterations; each access reads a whole root-to-node path
        stats.begin_iteration()
        for key in exact:
            exact[key] *= decay
        for _ in range(int(rng.integers(1, 20))):
            node = nodes[1 + int(rng.zipf(1.3)) % (len(nodes) - 1)]
            rows = int(rng.integers(1, 9))
            path = []
            while node is not tree.root:
                path.append(node)
                node = node.parent
            stats.record_accesses(
                np.array([n.idx for n in path]),
                np.full(len(path), float(rows)),
                rows * 2.0 * len(path),
            )
            for n in path:
                exact[n.key] = exact.get(n.key, 0.0) + rows
    k = 12
    got = heavy_hitters(tree, k)
    want = sorted(exact.values(), reverse=True)[:k]
    assert [pytest.approx(stats.access_count(n), rel=1e-9) for n in got] == want
    assert [exact[n.key] for n in got] == pytest.approx(want, rel=1e-9)


def test_power_of_two_never_picks_the_more_loaded_of_two():
    rng = np.random.default_rng(0)
    m = 500
    rep = np.tile(np.array([[0, 1]], dtype=np.int32), (m, 1))
    nrep = np.full(m, 2, dtype=np.int32)
    weight = rng.random(m)
    load = np.array([3.0, 0.0])
    chosen = np.empty(m, dtype=np.int32)
    _C.choose_replicas(rep, nrep, weight, load.copy(), 7, chosen)
    sim = np.array([3.0, 0.0])
    for i in range(m):
        pick = rep[i, chosen[i]]
        assert sim[pick] <= sim[1 - pick]
        sim[pick] += weight[i]


def test_power_of_two_with_more_replicas_never_picks_the_strict_maximum_and_spreads():
    m = 3000
    rep = np.tile(np.array([[2, 5, 7, 0]], dtype=np.int32), (m, 1))
    nrep = np.full(m, 3, dtype=np.int32)
    chosen = np.empty(m, dtype=np.int32)
    load = np.zeros(8)
    load[7] = 1e9  # replica 2 always loses
    _C.choose_replicas(rep, nrep, np.zeros(m), load, 3, chosen)
    assert not (chosen == 2).any()
    counts = np.bincount(chosen, minlength=3)
    assert abs(counts[0] - counts[1]) < 0.1 * m  # equal loads: a fair coin between the rest
    with pytest.raises(ValueError, match="num_replicas"):
        _C.choose_replicas(
            rep[:1], np.array([0], dtype=np.int32), np.ones(1), np.zeros(8), 0, chosen[:1]
        )


def zipf_cv(
    replicate: bool, iters: int = 96, seed: int = 0, window: int = 16, per_batch: int = 8
) -> tuple[float, tl.Pool]:
    """Mean per-window load CV (second half) of a Zipf workload over shared documents."""
    n, seg = 8, 16
    pool = tl.Pool(
        tl.PoolConfig(tl.ModelShape(1, 2, 1, 8), n, 1024, seg),
        balancer=BalancerConfig(window=window, replicate=replicate),
    )
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 30000, 2 * seg).astype(np.int32) for _ in range(100)]
    p = 1 / np.arange(1, 101) ** 1.2
    p /= p.sum()
    rid = 0
    for _ in range(iters):
        batches = []
        for _ in range(n):
            batch = []
            for _ in range(per_batch):
                ids = np.concatenate(
                    [docs[rng.choice(100, p=p)], rng.integers(0, 30000, 3).astype(np.int32)]
                )
                hit = min(pool.get_prefix_tree().match(ids).num_tokens, len(ids) - 1)
                batch.append(tl.Chunk(rid, ids, hit))
                rid += 1
            batches.append(batch)
        pool.commit(pool.gen_plans(batches))
        for batch in batches:
            for c in batch:
                pool.finish(c.request_id)
    cvs = pool.get_stats()["load_cv_over_time"]
    return float(np.mean(cvs[len(cvs) // 2 :])), pool


def test_replication_balances_a_zipf_workload():
    without, _ = zipf_cv(False)
    with_, pool = zipf_cv(True)
    assert without > 0.30, without
    assert with_ < 0.10, with_
    stats = pool.get_stats()
    assert stats["num_replicated_segments"] > 0 and stats["replication_bytes"] > 0
    pool.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_randomized_replicate_evict_pin_abort_keeps_invariants(seed):
    rng = np.random.default_rng(seed)
    pool = tl.Pool(
        tl.PoolConfig(tl.ModelShape(1, 2, 1, 8), 4, 24, 8),
        balancer=BalancerConfig(window=2, overload_factor=1.0, max_replications=4),
    )
    docs = [rng.integers(0, 50, 8 * int(rng.integers(1, 4))).astype(np.int32) for _ in range(5)]
    running: dict[int, np.ndarray] = {}
    rid = 0
    for _ in range(80):
        batches = []
        for r, ids in list(running.items())[:3]:
            ids = np.append(ids, rng.integers(0, 50))
            running[r] = ids
            batches.append([tl.Chunk(r, ids, len(ids) - 1)])
        if rng.random() < 0.7:
            ids = np.concatenate(
                [
                    docs[int(rng.zipf(1.5)) % 5],
                    rng.integers(0, 50, int(rng.integers(1, 12))).astype(np.int32),
                ]
            )
            hit = min(pool.get_prefix_tree().match(ids).num_tokens, len(ids) - 1)
            batches.append([tl.Chunk(rid, ids, hit)])
            running[rid] = ids
            rid += 1
        if not batches:
            continue
        try:
            plans = pool.gen_plans(batches)
        except tl.PoolFullError:
            pool.check_invariants()
            for r in list(running)[:2]:
                if r in pool.requests:
                    pool.finish(r)
                running.pop(r)
            continue
        pool.check_invariants()
        if rng.random() < 0.2:
            pool.abort(plans)
            for b in batches:
                if b[0].request_id not in pool.requests:
                    running.pop(b[0].request_id, None)
                else:
                    running[b[0].request_id] = running[b[0].request_id][:-1]
        else:
            pool.commit(plans)
        pool.check_invariants()
        if running and rng.random() < 0.3:
            r = next(iter(running))
            pool.finish(r)
            running.pop(r)
            pool.check_invariants()


def test_queries_stay_exact_with_replicas_and_after_their_eviction():
    h = Harness(
        4,
        16,
        num_slots=24,
        balancer=BalancerConfig(window=2, overload_factor=1.0, max_replications=8),
    )
    doc = tokens(1, 16 * 4)
    errs = []
    for i in range(12):  # many readers of one document make it a heavy hitter
        ids = np.concatenate([doc, tokens(100 + i, 5)])
        errs.append(h.step([[tl.Chunk(f"r{i}", ids, h.cached(ids))]]))
        if i >= 5:  # five running at once: more than one per instance, so load is balanced
            h.pool.finish(f"r{i - 5}")
    for i in range(7, 12):
        h.pool.finish(f"r{i}")
    assert h.pool.get_stats()["num_replicated_segments"] > 0
    # a batch of readers: some must be served from non-primary replicas
    readers = [np.concatenate([doc, tokens(200 + i, 3)]) for i in range(4)]
    errs.append(h.step([[tl.Chunk(f"q{i}", ids, 64)] for i, ids in enumerate(readers)]))
    replica_slots = {
        (loc.instance_id, loc.slot_id) for n in h.pool.tree.nodes() for loc in n.replicas[1:]
    }
    used = {
        (part.instance_id, int(s))
        for qp in h.last_plans.query_plans
        for part in qp.parts
        for s in part.kv_indices
    }
    assert used & replica_slots, "no query read a replica"
    for i in range(4):
        h.pool.finish(f"q{i}")
    # memory pressure: other documents push the (now unpinned) replicas out
    for i in range(6):
        h.step([[tl.Chunk(f"x{i}", tokens(300 + i, 16 * 3), 0)]])
        h.pool.finish(f"x{i}")
    ids = np.concatenate([doc, tokens(999, 4)])
    hit = h.cached(ids)
    errs.append(h.step([[tl.Chunk("late", ids, hit)]]))
    assert max(errs) <= h.tolerance
    h.pool.check_invariants()


def test_copy_source_evicted_during_planning_is_replaced_by_a_surviving_replica():
    """A new request extends a pinned, replicated segment while the pool is full: planning
    evicts the (least recently used) copy it first chose as the copy source; the copy must
    come from the surviving replica and the results stay exact."""
    h = Harness(2, 16, num_slots=3, balancer=BalancerConfig(replicate=False))
    doc = tokens(1, 16)
    h.step([[tl.Chunk("a", np.concatenate([doc, tokens(2, 5)]), 0)]])  # keeps running
    seg = h.pool.tree.match(doc).nodes[0]
    src = seg.replicas[0]
    other = 1 - src.instance_id
    slot = h.pool.allocators[other].allocate()
    # replicate by hand: the data first, then the tree
    h.cluster.kv_pools[other].data[:, slot] = h.cluster.kv_pools[src.instance_id].data[
        :, src.slot_id
    ]
    h.pool.tree.add_replica(seg, Location(other, slot))  # newer than the primary copy
    h.step([[tl.Chunk("c", tokens(3, 16 * 2 + 1), 0)]])  # fills the rest of the pool, pinned
    assert sum(a.num_free for a in h.pool.allocators) == 0
    ids = np.concatenate([doc[:5], tokens(4, 3)])
    err = h.step([[tl.Chunk("b", ids, 5)]])
    assert err <= h.tolerance
    tp = h.last_plans.transfer_plans[0]
    assert (int(tp.copy_src_instance[0]), int(tp.copy_src_slot[0])) == (other, slot)
    assert seg.replicas == [Location(other, slot)]
    h.pool.check_invariants()
