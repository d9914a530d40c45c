"""The resumed eviction walk (``tree_eviction.EvictionScan``) against a search from the head.

Every eviction a plan makes is checked, as it happens, against brute force: the first
evictable replica in the policy's order, found by walking that order from its start over
the tree as it is at that moment. Random multi-turn sessions with shared prefixes, decodes
pinning their requests, replicas, aborts and finishes, under each policy, in a pool far
smaller than the sessions' contexts (plans evict many replicas in a row).
"""

from __future__ import annotations

import numpy as np
import pytest

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.tree import eviction as tree_eviction
from tokenlake.tree.eviction import EvictionScan
from tokenlake.tree.policy import EvictionConfig

SEG = 4


def first_from_head(tree) -> tuple[int, int] | None:
    for (key, inst), _ in tree.policy.candidates(tree.lru, tree.node_map):
        if tree_eviction.evictable(tree, tree.get(key)):
            return key, inst
    return None


@pytest.mark.parametrize("policy", ["lru", "protect", "session"])
@pytest.mark.parametrize("seed", range(4))
def test_each_victim_is_the_first_evictable_from_the_head(monkeypatch, policy, seed):
    checked = {"evictions": 0, "resumed": 0, "none": 0}
    evict = EvictionScan.evict

    def oracle(self, tree, journal):
        expected = first_from_head(tree)
        resumed = journal is self._journal and self._current(tree, journal) == self._signature
        got = evict(self, tree, journal)
        assert (None if got is None else (got[0].key, got[1].instance_id)) == expected
        checked["evictions"] += got is not None
        checked["resumed"] += resumed and got is not None
        checked["none"] += got is None
        return got

    monkeypatch.setattr(EvictionScan, "evict", oracle)
    rng = np.random.default_rng(seed)
    shape = tl.ModelShape(1, 2, 1, 8, "float32")
    pool = tl.Pool(
        tl.PoolConfig(shape, 3, 12, SEG),  # 36 slots
        balancer=BalancerConfig(interval=3, overload_factor=1.0, max_replica_fraction=0.3),
        eviction=EvictionConfig(policy, protected_fraction=0.6),
    )
    systems = [rng.integers(1, 50, SEG * int(rng.integers(1, 4))) for _ in range(3)]
    contexts = {s: np.concatenate([systems[s % 3], rng.integers(1, 50, SEG * 5)]) for s in range(9)}
    running: dict[str, np.ndarray] = {}  # request id -> its tokens so far
    for step in range(120):
        batch = [tl.Chunk(rid, ids, len(ids) - 1) for rid, ids in running.items()]
        for s in set(rng.integers(0, 9, int(rng.integers(0, 3))).tolist()):
            rid = f"s{s}.{step}"
            turn = rng.integers(1, 50, int(rng.integers(1, 3 * SEG)))
            ids = contexts[s] = np.concatenate([contexts[s], turn])
            start = pool.get_prefix_tree().match(ids[:-1]).num_tokens
            batch.append(tl.Chunk(rid, ids, start))
        if not batch:
            continue
        try:
            plans = pool.gen_plans([batch])
        except tl.PoolFullError:
            for rid in list(running):
                pool.finish(rid)
                del running[rid]
            continue
        if rng.random() < 0.15:
            pool.abort(plans)
        else:
            pool.commit(plans)
            for c in batch:
                running[c.request_id] = np.append(c.token_ids, int(rng.integers(1, 50)))
        for rid in list(running):
            if rng.random() < 0.4:
                pool.finish(rid)
                del running[rid]
        pool.check_invariants()
    # the walk did resume within plans, not only start over
    assert checked["evictions"] > 100 and checked["resumed"] > checked["evictions"] // 3


def test_a_pool_copied_mid_walk_evicts_as_the_original():
    """The walk is a cache: a deep copy of a pool (as the API fuzzer takes) starts its own."""
    import copy

    shape = tl.ModelShape(1, 2, 1, 8, "float32")
    pool = tl.Pool(tl.PoolConfig(shape, 2, 4, SEG), eviction=EvictionConfig("protect"))
    for i in range(4):
        ids = np.arange(1 + 100 * i, 1 + 100 * i + 4 * SEG, dtype=np.int32)
        pool.commit(pool.gen_plans([[tl.Chunk(f"r{i}", ids, 0)]]))
        pool.finish(f"r{i}")
    assert pool.tree.eviction_scan._journal is not None  # a walk was used
    twin = copy.deepcopy(pool)
    ids = np.arange(900, 900 + 2 * SEG, dtype=np.int32)
    for p in (pool, twin):
        p.commit(p.gen_plans([[tl.Chunk("new", ids, 0)]]))
        p.check_invariants()
    assert pool.tree.lru_order() == twin.tree.lru_order()
