"""History the pool keeps is bounded: the per-window load CVs live in a ring buffer, while
their count and mean still cover every window (checked against a brute-force recount)."""

from __future__ import annotations

import numpy as np
import pytest

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig, coefficient_of_variation


def test_load_cv_history_is_a_ring_buffer_with_exact_count_and_mean():
    pool = tl.Pool(
        tl.PoolConfig(tl.ModelShape(1, 2, 1, 8), 3, 64, 4),
        balancer=BalancerConfig(window=1, replicate=False),
    )
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, 4 * k + 2).astype(np.int32) for k in range(1, 6)]
    cvs, last = [], np.zeros(3)
    num_iterations = 1300  # more windows than the ring holds (1,024)
    for i in range(num_iterations):
        doc = docs[i % len(docs)]
        ids = np.append(doc, i % 50).astype(np.int32)
        hit = min(pool.get_prefix_tree().match(ids).num_tokens, len(ids) - 1)
        plans = pool.gen_plans([[tl.Chunk(i, ids, hit)]])
        if i % 7 == 3:  # aborted iterations leave no window behind
            pool.abort(plans, executed=False)
            continue
        pool.commit(plans)
        pool.finish(i)
        load = np.asarray(pool.get_stats()["instance_load"])
        cvs.append(coefficient_of_variation(load - last))
        last = load
    stats = pool.get_stats()
    assert stats["num_load_cv_windows"] == len(cvs) > 1024
    assert len(stats["load_cv_over_time"]) == 1024
    assert stats["load_cv_over_time"] == pytest.approx(cvs[-1024:])
    assert stats["mean_load_cv"] == pytest.approx(float(np.mean(cvs)))
    assert len(pool.access.cv_history) == pool.access.cv_history.maxlen == 1024
