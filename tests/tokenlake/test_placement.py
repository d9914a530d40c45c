"""Rendezvous placement: uniform shares, minimal movement on membership change, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from tokenlake.cluster.placement import Placement
from tokenlake.errors import InvalidArgumentError
from tokenlake.keys import SegmentHasher

NUM_KEYS = 100_000


def random_keys(n: int = NUM_KEYS, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**64, size=n, dtype=np.uint64)


def chained_keys(n: int = NUM_KEYS) -> np.ndarray:
    """Real segment keys: chains of xxh64 over a few shared prompts."""
    h, rng = SegmentHasher("placement"), np.random.default_rng(1)
    tokens = rng.integers(0, 32_000, size=n * 4, dtype=np.int32)
    return np.array(h.chain(tokens, 4), dtype=np.uint64)


@pytest.mark.parametrize("keys", [random_keys(), chained_keys()], ids=["random", "chained"])
@pytest.mark.parametrize("ids", [list(range(8)), [3, 9, 10, 17, 40, 41, 100, 7]])
def test_shares_are_uniform_within_ten_percent(keys, ids):
    homes = Placement(ids, seed=5).homes(keys)
    assert set(np.unique(homes)) == set(ids)
    counts = np.array([np.count_nonzero(homes == i) for i in ids])
    expected = len(keys) / len(ids)
    assert np.all(np.abs(counts - expected) <= 0.1 * expected), counts


def test_home_and_rank_agree_with_homes():
    placement = Placement([0, 2, 5, 6, 11], seed=3)
    keys = random_keys(2000, seed=7)
    homes = placement.homes(keys)
    for key, home in zip(keys.tolist(), homes.tolist(), strict=True):
        rank = placement.rank(key)
        assert sorted(rank) == sorted(placement.live)
        assert rank[0] == placement.home(key) == home


def test_rank_is_stable_when_another_instance_leaves():
    """Rendezvous order: removing one instance deletes it from every key's ranking and leaves
    the relative order of the others untouched (the fallback chain does not reshuffle)."""
    placement = Placement(range(6), seed=2)
    keys = random_keys(500, seed=3).tolist()
    before = [placement.rank(k) for k in keys]
    placement.remove(4)
    for key, old in zip(keys, before, strict=True):
        assert placement.rank(key) == [i for i in old if i != 4]


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_adding_an_instance_moves_only_its_share_to_it(seed):
    keys = random_keys(seed=seed)
    placement = Placement(range(8), seed=seed)
    before = placement.homes(keys)
    placement.add(8)
    after = placement.homes(keys)
    moved = before != after
    assert np.all(after[moved] == 8)
    assert np.all(after[~moved] == before[~moved])
    expected = len(keys) / 9
    assert abs(np.count_nonzero(moved) - expected) <= 0.2 * expected


@pytest.mark.parametrize("victim", [0, 3, 7])
def test_removing_an_instance_moves_exactly_its_keys(victim):
    keys = random_keys(seed=victim)
    placement = Placement(range(8), seed=9)
    before = placement.homes(keys)
    placement.remove(victim)
    assert victim not in placement.live and len(placement.live) == 7
    after = placement.homes(keys)
    moved = before != after
    np.testing.assert_array_equal(moved, before == victim)
    assert not np.any(after == victim)
    expected = len(keys) / 8
    assert abs(np.count_nonzero(moved) - expected) <= 0.2 * expected
    # The moved keys spread over the survivors, not onto one neighbour.
    counts = np.bincount(after[moved], minlength=8)
    survivors = [i for i in range(8) if i != victim]
    assert np.all(counts[survivors] > 0.5 * np.count_nonzero(moved) / 7)


def test_same_seed_is_deterministic_and_independent_of_insertion_order():
    keys = random_keys(20_000, seed=4)
    a = Placement(range(8), seed=42)
    b = Placement(reversed(range(8)), seed=42)
    np.testing.assert_array_equal(a.homes(keys), b.homes(keys))
    assert [a.home(int(k)) for k in keys[:100]] == [b.home(int(k)) for k in keys[:100]]


def test_different_seeds_give_different_mappings():
    keys = random_keys(20_000, seed=4)
    a = Placement(range(8), seed=1).homes(keys)
    b = Placement(range(8), seed=2).homes(keys)
    # Independent mappings agree on about 1/8 of the keys.
    assert np.count_nonzero(a == b) < 0.2 * len(keys)


def test_membership_errors_leave_placement_unchanged():
    with pytest.raises(InvalidArgumentError, match="instance_ids"):
        Placement([])
    placement = Placement([1, 2])
    keys = random_keys(1000)
    before = placement.homes(keys)
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        placement.add(2)
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        placement.remove(7)
    placement.remove(1)
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        placement.remove(2)
    assert placement.live == (2,)
    assert np.all(placement.homes(keys) == 2)
    placement.add(1)
    np.testing.assert_array_equal(placement.homes(keys), before)
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        Placement([3, 3])
