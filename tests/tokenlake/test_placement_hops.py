"""Hop-priced placement: with ``BalancerConfig.hop_bytes > 0`` a request's next segment goes
on the instance of its previous one (unless that instance is loaded beyond the balancer's
factor while more requests run than there are instances), so its decode steps read one
holder; with ``hop_bytes = 0`` placement is the rendezvous hash, as before."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.cluster.placement import Placement
from tokenlake.errors import InvalidArgumentError

C = 16


@pytest.mark.parametrize("seed", range(20))
def test_rank_beside_moves_one_instance_first(seed):
    rng = np.random.default_rng(seed)
    ids = sorted(rng.choice(16, int(rng.integers(1, 7)), replace=False).tolist())
    placement = Placement(ids, seed=seed)
    key = int(rng.integers(0, 2**63))
    rank = placement.rank(key)
    assert placement.rank_beside(key, None) == rank
    for beside in ids:
        order = placement.rank_beside(key, beside)
        assert order[0] == beside and sorted(order) == ids
        assert [i for i in order if i != beside] == [i for i in rank if i != beside]
    missing = next(i for i in range(17) if i not in ids)
    with pytest.raises(InvalidArgumentError, match="beside"):
        placement.rank_beside(key, missing)


def overloaded(pool: tl.Pool, num_running: int) -> set[int]:
    load = pool.access.window_load
    live = list(pool.placement.live)
    if num_running <= len(live):  # light load: no instance queues behind another
        return set()
    mean = float(load[live].mean())
    if mean <= 0:
        return set()
    return {i for i in live if load[i] > pool.balancer.overload_factor * mean}


def run(balancer: BalancerConfig, n: int, seed: int):
    """Requests over a few shared documents plus private multi-segment suffixes; checks
    each new full segment's instance against the rule, from the state before planning.
    Returns every request's segment instances."""
    h = Harness(n, C, num_slots=96, balancer=balancer)
    pool = h.pool
    rng = np.random.default_rng(seed)
    docs = [tokens(1000 * seed + d, C * int(rng.integers(1, 4))) for d in range(3)]
    where, errs = [], []
    for r in range(14):
        own = tokens(50 + r + 100 * seed, C * int(rng.integers(1, 4)) + int(rng.integers(0, C)))
        ids = np.concatenate([docs[int(rng.integers(0, 3))], own]) if r % 4 else own
        cached = h.cached(ids)
        hot = overloaded(pool, len(pool.requests) + 1)
        errs.append(h.step([[tl.Chunk(f"r{r}", ids, cached)]]))
        pool.check_invariants()
        nodes = pool.requests[f"r{r}"].nodes
        for j in range(cached // C, len(nodes)):
            prev = nodes[j - 1].replicas[0].instance_id if j else None
            if balancer.hop_bytes > 0 and prev is not None and prev not in hot:
                expected = prev
            else:
                expected = pool.placement.rank(nodes[j].key)[0]
            assert nodes[j].replicas[0].instance_id == expected
        where.append([node.replicas[0].instance_id for node in nodes])
        if r % 3 == 0:
            for step in range(2):
                ids = np.append(ids, step).astype(np.int32)
                errs.append(h.step([[tl.Chunk(f"r{r}", ids, len(ids) - 1)]]))
                pool.check_invariants()
        pool.finish(f"r{r}")
        pool.check_invariants()
    assert max(errs) <= h.tolerance
    return where


@pytest.mark.parametrize(("n", "seed"), list(itertools.product([2, 3, 4], range(3))))
def test_placement_rule_and_hop_zero_unchanged(n, seed):
    plain = run(BalancerConfig(), n, seed)
    assert run(BalancerConfig(hop_bytes=0.0), n, seed) == plain
    priced = run(BalancerConfig(hop_bytes=1e6), n, seed)
    assert len(priced) == len(plain)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_private_request_decodes_on_one_holder(n):
    """A request sharing nothing, its prompt five segments: every decode step reads one
    holder (the least any placement allows) and runs there; by hash it reads several."""
    steps = {}
    for hop in (0.0, 1e6):
        h = Harness(n, C, num_slots=32, balancer=BalancerConfig(hop_bytes=hop))
        ids = tokens(7, 5 * C + 3)
        h.step([[tl.Chunk("r", ids, 0)]])
        seen = []
        for k in range(4):
            ids = np.append(ids, k).astype(np.int32)
            assert h.step([[tl.Chunk("r", ids, len(ids) - 1)]]) <= h.tolerance
            qp = h.last_plans.query_plans[0]
            seen.append((qp.origin, qp.holder_ids.tolist()))
            h.pool.check_invariants()
        steps[hop] = seen
    assert all(holders == [origin] for origin, holders in steps[1e6])
    assert any(len(holders) > 1 for _, holders in steps[0.0])


@pytest.mark.parametrize("n", [2, 4])
def test_requests_in_sequence_each_decode_on_one_holder(n):
    """Light load, one request after another (the previous one finished): each request's
    segments stay together, so every decode step reads one holder, although the instance
    that served the last request carries all the recent load."""
    h = Harness(n, C, num_slots=64, balancer=BalancerConfig(hop_bytes=1e6))
    for r in range(6):
        ids = tokens(70 + r, 5 * C + 3)
        h.step([[tl.Chunk(f"r{r}", ids, 0)]])
        for k in range(2):
            ids = np.append(ids, k).astype(np.int32)
            assert h.step([[tl.Chunk(f"r{r}", ids, len(ids) - 1)]]) <= h.tolerance
            qp = h.last_plans.query_plans[0]
            assert qp.holder_ids.tolist() == [qp.origin], (r, qp.holder_ids.tolist())
        h.pool.finish(f"r{r}")
        h.pool.check_invariants()
