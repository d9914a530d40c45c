"""The dispatcher's hop term: ``hop_bytes`` per remote holder in the edge weight, checked
against brute force over assignments priced from an independent recount; with
``hop_bytes = 0`` every decision is what it was without the term."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.errors import InvalidArgumentError
from tokenlake.planning.dispatch import hungarian_dispatch, traffic_cost


def reference_cost(q, p, q_row, kv_token, hop, u, v) -> float:
    """Bytes plus hops if sub-batch ``u`` runs on ``v``, counted holder by holder."""
    total = 0.0
    for k in range(q.shape[1]):
        if k != v:
            total += q[u, k] * q_row + p[u, k] * kv_token + (hop if q[u, k] > 0 else 0.0)
    return total


def brute_force(q, p, q_row, kv_token, hop, live) -> float:
    num_sub = q.shape[0]
    return min(
        sum(reference_cost(q, p, q_row, kv_token, hop, u, perm[u]) for u in range(num_sub))
        for perm in itertools.permutations(live, num_sub)
    )


@pytest.mark.parametrize("seed", range(40))
def test_hop_priced_dispatch_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6))
    num_sub = int(rng.integers(1, n + 1))
    q = (rng.integers(0, 6, (num_sub, n)) * (rng.random((num_sub, n)) < 0.5)).astype(float)
    p = (rng.integers(0, 4, (num_sub, n)) * (rng.random((num_sub, n)) < 0.3)).astype(float)
    hop = float(rng.choice([0.0, 50.0, 500.0]))
    cost = traffic_cost(q, p, 10.0, 3.0, hop)
    for u, v in itertools.product(range(num_sub), range(n)):
        assert cost[u, v] == pytest.approx(reference_cost(q, p, 10.0, 3.0, hop, u, v))
    origins = hungarian_dispatch(cost, range(n))
    chosen = sum(reference_cost(q, p, 10.0, 3.0, hop, u, int(o)) for u, o in enumerate(origins))
    assert chosen == pytest.approx(brute_force(q, p, 10.0, 3.0, hop, range(n)))


@pytest.mark.parametrize("seed", range(10))
def test_zero_hop_is_the_bytes_only_cost(seed):
    rng = np.random.default_rng(100 + seed)
    q = rng.integers(0, 9, (3, 4)).astype(float)
    p = rng.integers(0, 9, (3, 4)).astype(float)
    assert np.array_equal(traffic_cost(q, p, 7.0, 2.0, 0.0), traffic_cost(q, p, 7.0, 2.0))


def test_hop_keeps_a_small_decode_where_its_pages_are():
    """Decode A reads one page on instance 0 and stores its new token on instance 1 (twice
    the KV of its query row); prefill B reads instances 0 and 1 alike and stores on 2.
    Bytes alone send A to instance 1 (its page remote); a hop worth more than the byte
    difference keeps A on 0 and B on 1."""
    q = np.array([[1.0, 0.0, 0.0], [9.0, 9.0, 0.0]])
    p = np.array([[0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    assert hungarian_dispatch(traffic_cost(q, p, 1.0, 1.0), range(3)).tolist() == [1, 0]
    assert hungarian_dispatch(traffic_cost(q, p, 1.0, 1.0, 5.0), range(3)).tolist() == [0, 1]


def test_balancer_rejects_a_bad_hop():
    for bad in (-1.0, float("nan"), float("inf"), "x"):
        with pytest.raises(InvalidArgumentError, match="hop_bytes"):
            BalancerConfig(hop_bytes=bad)


def q_row_bytes(pool: tl.Pool) -> float:
    m = pool.config.model
    return m.num_layers * (
        m.num_q_heads * m.head_dim * m.dtype_bytes + 4 * m.num_q_heads * (m.head_dim + 1)
    )


def recount(pool: tl.Pool, plans: tl.Plans) -> tuple[np.ndarray, np.ndarray]:
    """``[U, N]`` query rows to each holder and new-KV tokens to each home, from the plans."""
    n = pool.config.num_instances
    q = np.zeros((len(plans.query_plans), n))
    p = np.zeros_like(q)
    for u, (qp, tp) in enumerate(zip(plans.query_plans, plans.transfer_plans, strict=True)):
        for part in qp.parts:
            q[u, part.instance_id] += len(part.rows)
        for d, dst in enumerate(tp.dst_ids.tolist()):
            p[u, dst] += len(tp.rows_to(d)[0])
    return q, p


def workload(seed: int, n: int):
    """Documents stored one by one, then small batches over their cached pages (a few new
    tokens each, some at DoP 2)."""
    rng = np.random.default_rng(seed)
    docs = [tokens(seed * 10 + i, 16 * int(rng.integers(1, 5)) + 3) for i in range(n + 1)]
    warm = [[[tl.Chunk(f"w{i}", d, 0)]] for i, d in enumerate(docs)]
    batches, dops, budget = [], [], n
    for i, d in enumerate(docs):
        if budget == 0:
            break
        dop = int(rng.integers(1, min(budget, 2) + 1))
        ids = np.concatenate([d, tokens(100 + i, 1 + 8 * (dop - 1))])
        batches.append([tl.Chunk(f"r{i}", ids, len(d) - len(d) % 16)])
        dops.append(dop)
        budget -= dop
    return warm, batches, dops


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("hop_bytes", [0.0, 1e4, 1e7])
def test_pool_dispatch_is_optimal_with_hops(seed, hop_bytes):
    """No other assignment of the plans' sub-batches to live instances costs less, bytes
    and hops recounted from the plans; with ``hop_bytes = 0`` the plans' origins are those
    of a pool with the default balancer."""
    n = int(np.random.default_rng(seed).integers(2, 5))
    warm, batches, dops = workload(seed, n)
    priced = Harness(n, 16, num_slots=64, balancer=BalancerConfig(hop_bytes=hop_bytes))
    default = Harness(n, 16, num_slots=64)
    for h in (priced, default):
        for b in warm:
            h.step(b)
            h.pool.check_invariants()
    plans = priced.pool.gen_plans(batches, dops)
    priced.pool.check_invariants()
    q, p = recount(priced.pool, plans)
    m = priced.pool.config.model
    origins = [qp.origin for qp in plans.query_plans]
    args = (q, p, q_row_bytes(priced.pool), m.kv_bytes_per_token, hop_bytes)
    chosen = sum(reference_cost(*args, u, o) for u, o in enumerate(origins))
    assert chosen == pytest.approx(brute_force(*args, range(n)))
    base = default.pool.gen_plans(batches, dops)
    if hop_bytes == 0.0:
        assert [qp.origin for qp in base.query_plans] == origins
    for h, pl in ((priced, plans), (default, base)):
        h.pool.abort(pl, executed=False)
        h.pool.check_invariants()
