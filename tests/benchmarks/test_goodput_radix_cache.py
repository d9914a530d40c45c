"""The baselines' local prefix cache: sharing, locking, LRU eviction, invariants."""

import numpy as np

from tokenlake.benchmarks.sim.systems.radix_cache import LocalPrefixCache


def test_match_insert_share_and_lru_eviction():
    c = LocalPrefixCache(4 * 10)
    c.insert([1, 2], [10, 10], lock=False)
    c.insert([1, 3], [10, 10], lock=False)  # shares block 1
    assert c.cached_tokens == 30
    assert c.match([1, 2, 9]).num_tokens == 20  # touches 1, 2: block 3 is now the oldest leaf
    assert c.reserve(20)  # needs 30 + 20 <= 40: evicts block 3 only
    assert c.match([1, 3], touch=False).num_tokens == 10
    assert c.match([1, 2], touch=False).num_tokens == 20
    c.check_invariants()


def test_locked_entries_are_never_evicted():
    c = LocalPrefixCache(30)
    path, added = c.insert([1, 2, 3], [10, 10, 10], lock=True)
    assert added == 30 and c.available_tokens == 0
    assert not c.reserve(1)
    c.unlock(path)
    assert c.reserve(25)  # evicts leaves 3, 2, 1 in that order
    assert c.cached_tokens == 0
    c.check_invariants()


def test_randomized_operations_keep_invariants():
    rng = np.random.default_rng(0)
    c = LocalPrefixCache(200)
    held = []
    for _ in range(400):
        op = rng.integers(3)
        if op == 0:
            keys = [int(k) for k in rng.integers(0, 4, size=rng.integers(1, 5))]
            m = c.match(keys)
            need = 10 * (len(keys) - len(m.path))
            if c.reserve(need):
                c.lock(m.path)
                path, added = c.insert(keys, [10] * len(keys), lock=True)
                c.unlock(m.path)
                c.release(need)
                held.append(path)
        elif op == 1 and held:
            c.unlock(held.pop(int(rng.integers(len(held)))))
        else:
            c.trim()
        c.check_invariants()
