"""The router baseline decides as sgl-router's documented cache-aware rule says."""

import pytest

from benchmarks.sim.router import CacheAwareRouter, RouterConfig

B = 512


def chain(*ids):
    return list(ids), [B] * len(ids)


def test_defaults_are_the_papers():
    cfg = RouterConfig()
    assert (cfg.cache_threshold, cfg.balance_abs_threshold, cfg.balance_rel_threshold) == (
        0.3,
        64,
        1.5,
    )


def test_balanced_high_match_goes_to_the_matching_worker():
    r = CacheAwareRouter(3)
    r.trees[2].insert(*chain(1, 2, 3), lock=False)
    r.loads[:] = [0, 5, 40]  # busier, but not imbalanced: 40 - 0 <= 64
    assert r.select(*chain(1, 2, 3, 4)) == 2  # match rate 3/4 > 0.3
    assert r.loads == [0, 5, 41]


def test_balanced_low_match_goes_to_the_least_loaded_worker():
    r = CacheAwareRouter(3)
    r.trees[2].insert(*chain(1), lock=False)
    r.loads[:] = [7, 3, 0]
    assert r.select(*chain(1, 2, 3, 4)) == 2  # the least loaded (and the match is 1/4 <= 0.3)
    r.loads[:] = [7, 3, 9]
    assert r.select(*chain(1, 5, 6, 7)) == 1  # match 1/4 on worker 2 is below the threshold


def test_match_rate_must_exceed_the_threshold_strictly():
    r = CacheAwareRouter(2, RouterConfig(cache_threshold=0.5))
    r.trees[1].insert(*chain(1, 2), lock=False)
    r.loads[:] = [0, 1]
    assert r.select(*chain(1, 2, 3, 4)) == 0  # exactly 0.5 is not > 0.5


@pytest.mark.parametrize(
    "loads, expected",
    [
        ([100, 170], 0),  # diff 70 > 64 and 170 > 1.5 * 100: imbalanced, shortest queue
        ([200, 270], 1),  # diff 70 > 64 but 270 <= 1.5 * 200: balanced, cache wins
        ([10, 70], 1),  # 70 > 1.5 * 10 but diff 60 <= 64: balanced, cache wins
    ],
)
def test_imbalance_needs_both_thresholds(loads, expected):
    r = CacheAwareRouter(2)
    r.trees[1].insert(*chain(1, 2, 3), lock=False)
    r.loads[:] = loads
    assert r.select(*chain(1, 2, 3)) == expected


def test_the_chosen_worker_learns_the_prefix_even_when_balancing():
    r = CacheAwareRouter(2)
    r.loads[:] = [0, 100]
    assert r.select(*chain(8, 9)) == 0
    assert r.trees[0].match([8, 9], touch=False).num_tokens == 2 * B
    r.finished(0)
    assert r.loads == [0, 100]


@pytest.mark.parametrize("seed", [0, 1])
def test_router_tree_eviction_trims_by_lru(seed):
    r = CacheAwareRouter(1, RouterConfig(max_tree_tokens=2 * B))
    r.select(*chain(1, 2))
    r.select(*chain(3, 4))
    r.evict()
    assert r.trees[0].match([3, 4], touch=False).num_tokens == 2 * B
    assert r.trees[0].match([1, 2], touch=False).num_tokens == 0
