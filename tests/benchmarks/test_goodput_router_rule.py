"""The router baseline decides as sgl-router's ``CacheAwarePolicy::select_worker`` does, branch
by branch, on constructed cases; its approximate tree keeps sgl-router's ``Tree`` semantics."""

import numpy as np
import pytest

from tokenlake.benchmarks.sim.systems.approx_tree import ApproxTree
from tokenlake.benchmarks.sim.systems.router import CacheAwareRouter, RouterConfig

B = 512


def chain(*ids):
    return list(ids), [B] * len(ids)


def routed(r, worker, *ids, now=0.0):
    """Put a request on ``worker``'s branch of the tree, as if routed there earlier."""
    r.tree.insert(*chain(*ids), worker, now)


def test_defaults_are_sgl_routers():
    cfg = RouterConfig()
    assert (cfg.cache_threshold, cfg.balance_abs_threshold, cfg.balance_rel_threshold) == (
        0.3,
        64,
        1.5,
    )
    assert (cfg.eviction_interval_s, cfg.miss_rule) == (120.0, "smallest_tree")


def test_cache_hit_goes_to_the_matching_worker_even_if_busier():
    r = CacheAwareRouter(3)
    routed(r, 2, 1, 2, 3)
    r.loads[:] = [0, 5, 40]  # busier, but not imbalanced: 40 - 0 <= 64
    assert r.select(*chain(1, 2, 3, 4)) == 2  # match rate 3/4 > 0.3
    assert r.last_branch == "cache_hit"
    assert r.loads == [0, 5, 41]


def test_cache_miss_goes_to_the_smallest_tree_not_the_least_loaded():
    r = CacheAwareRouter(3)
    routed(r, 0, 10, 11, 12, 13)  # worker 0: 4 blocks in the tree
    routed(r, 1, 20)  # worker 1: 1 block
    routed(r, 2, 30, 31)  # worker 2: 2 blocks
    r.loads[:] = [0, 9, 3]  # worker 0 is idle, worker 1 the busiest
    assert r.select(*chain(40, 41, 42, 43)) == 1  # no match at all: the smallest tree
    assert r.last_branch == "cache_miss"
    # the request now lives in worker 1's branch: 5 blocks; worker 2 (2) is the smallest
    assert r.tree.tenant_tokens == [4 * B, 5 * B, 2 * B]
    assert r.select(*chain(50, 51)) == 2


def test_low_match_is_a_miss_and_still_touches_the_matched_worker():
    r = CacheAwareRouter(2)
    routed(r, 1, 1, 2, 3, now=0.0)  # worker 1 holds a 3-block prefix
    routed(r, 0, 7, now=0.0)  # worker 0 holds less
    # 1 of 4 blocks matched on worker 1: 0.25 <= 0.3, so the smallest tree (worker 0)
    assert r.select(*chain(1, 8, 9, 10), now=5.0) == 0
    assert r.last_branch == "cache_miss"
    # sgl-router's prefix_match refreshed the matched tenant's path anyway
    assert r.tree.root.children[1].tenants[1] == 5.0


def test_match_rate_must_exceed_the_threshold_strictly():
    r = CacheAwareRouter(2, RouterConfig(cache_threshold=0.5))
    routed(r, 1, 1, 2)
    routed(r, 0, 5, 6, 7)  # worker 1 has the smaller tree, so a miss also picks it: enlarge it
    routed(r, 1, 8, 9, 10)
    assert r.select(*chain(1, 2, 3, 4)) == 0  # exactly 0.5 is not > 0.5: smallest tree
    assert r.last_branch == "cache_miss"


@pytest.mark.parametrize(
    "loads, expected, branch",
    [
        ([100, 170], 0, "imbalanced"),  # diff 70 > 64 and 170 > 1.5 * 100: shortest queue
        ([200, 270], 1, "cache_hit"),  # diff 70 > 64 but 270 <= 1.5 * 200: balanced
        ([10, 70], 1, "cache_hit"),  # 70 > 1.5 * 10 but diff 60 <= 64: balanced
    ],
)
def test_imbalance_needs_both_thresholds(loads, expected, branch):
    r = CacheAwareRouter(2)
    routed(r, 1, 1, 2, 3)
    r.loads[:] = loads
    assert r.select(*chain(1, 2, 3)) == expected
    assert r.last_branch == branch


def test_imbalanced_ties_go_to_the_first_least_loaded_and_it_learns_the_prefix():
    r = CacheAwareRouter(3)
    r.loads[:] = [100, 0, 0]
    assert r.select(*chain(8, 9)) == 1  # Rust's min_by_key keeps the first minimum
    assert r.last_branch == "imbalanced"
    assert r.tree.tokens_of(1, [8, 9]) == 2 * B
    r.finished(1)
    assert r.loads == [100, 0, 0]


def test_min_load_miss_rule_is_smgs_variant():
    r = CacheAwareRouter(3, RouterConfig(miss_rule="min_load"))
    routed(r, 1, 20)  # the smallest tree would be worker 0 (empty)
    r.loads[:] = [4, 1, 1]
    r.processed[:] = [0, 3, 2]
    assert r.select(*chain(40, 41)) == 2  # least loaded; tie 1 vs 2 broken by processed


def test_hit_among_several_holders_follows_the_nodes_fixed_order():
    # Every worker holds the shared prefix; sgl-router returns the first tenant of the deepest
    # node's map, an order fixed per node: the same worker each time (until imbalance).
    r = CacheAwareRouter(4)
    for w in range(4):
        routed(r, w, 1, 2, 3)
    picks = {r.select(*chain(1, 2, 3, 100 + i)) for i in range(5)}
    assert len(picks) == 1


def test_eviction_trims_each_tenant_by_lru_leaves():
    t = ApproxTree(2)
    t.insert(*chain(1, 2), 0, now=1.0)
    t.insert(*chain(1, 3), 0, now=2.0)
    t.insert(*chain(4), 1, now=3.0)
    t.prefix_match([1, 2], now=4.0)  # the only tenant on 1 -> 2 is 0: touches 1 and 2
    t.evict_by_size(2 * B)  # tenant 0 holds 3 blocks: drop its LRU leaf, block 3
    assert t.tokens_of(0, [1, 2]) == 2 * B
    assert t.tokens_of(0, [1, 3]) == B
    assert t.tokens_of(1, [4]) == B  # under the limit: untouched
    t.check_invariants()
    t.evict_by_size(0)  # leaves first, then their parents
    assert t.tenant_tokens == [0, 0] and not t.root.children


def test_random_operations_keep_the_tree_consistent():
    rng = np.random.default_rng(0)
    t = ApproxTree(3, seed=1)
    for step in range(400):
        keys = [int(k) for k in rng.integers(0, 4, size=rng.integers(1, 5))]
        op = rng.integers(3)
        if op == 0:
            t.insert(keys, [B] * len(keys), int(rng.integers(3)), float(step))
        elif op == 1:
            matched, tenant = t.prefix_match(keys, float(step))
            assert matched == 0 or t.tokens_of(tenant, keys) == matched
        else:
            t.evict_by_size(int(rng.integers(0, 6)) * B)
        t.check_invariants()
