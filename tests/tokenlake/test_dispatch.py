"""Hungarian dispatch (§5) against brute force, and the plan's bytes against a recount."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.errors import InvalidArgumentError
from tokenlake.planning.dispatch import hungarian_dispatch, traffic_cost


def brute_force(cost: np.ndarray) -> float:
    num_sub, n = cost.shape
    return min(
        sum(cost[u, perm[u]] for u in range(num_sub))
        for perm in itertools.permutations(range(n), num_sub)
    )


@pytest.mark.parametrize("seed", range(40))
def test_hungarian_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 7))
    num_sub = int(rng.integers(1, n + 1))
    # sparse, clumpy traffic like real batches: a few holders/homes per sub-batch
    q = rng.integers(0, 50, (num_sub, n)) * (rng.random((num_sub, n)) < 0.4)
    p = rng.integers(0, 20, (num_sub, n)) * (rng.random((num_sub, n)) < 0.3)
    cost = traffic_cost(q.astype(float), p.astype(float), 96.0, 64.0)
    origins = hungarian_dispatch(cost, range(n))
    assert len(set(origins.tolist())) == num_sub
    assert sum(cost[u, origins[u]] for u in range(num_sub)) == pytest.approx(brute_force(cost))


@pytest.mark.parametrize("seed", range(20))
def test_one_sub_batch_takes_the_column_the_solver_takes(seed):
    """One sub-batch skips the solver: the same instance it picks, ties and ``allowed``
    included (ties are the rule: a decode lane often costs the same anywhere)."""
    from scipy.optimize import linear_sum_assignment

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    cost = rng.integers(0, 3, (1, n)).astype(float)
    live = sorted(rng.choice(n, int(rng.integers(1, n + 1)), replace=False).tolist())
    allowed = rng.random((1, n)) < 0.7
    allowed[0, live[-1]] = True
    for mask in (None, allowed):
        sub = cost[:, live] if mask is None else np.where(mask[:, live], cost[:, live], 1e9)
        expected = live[int(linear_sum_assignment(sub)[1][0])]
        assert hungarian_dispatch(cost, live, mask).tolist() == [expected]
    none_live = np.ones((1, n), dtype=bool)
    none_live[0, live] = False
    with pytest.raises(InvalidArgumentError, match="no assignment"):
        hungarian_dispatch(cost, live, none_live)


def test_traffic_cost_is_bytes_not_local_to_the_origin():
    q = np.array([[3.0, 0.0, 5.0]])
    p = np.array([[0.0, 7.0, 1.0]])
    cost = traffic_cost(q, p, q_row_bytes=10.0, kv_token_bytes=2.0)
    assert cost.tolist() == [[5 * 10 + 8 * 2, 8 * 10 + 1 * 2, 3 * 10 + 7 * 2]]


def test_dead_instances_are_never_chosen_and_too_many_sub_batches_raise():
    cost = np.zeros((2, 4))
    cost[:, 1] = -100  # tempting, but instance 1 is not live
    assert set(hungarian_dispatch(cost, [0, 2, 3]).tolist()) <= {0, 2, 3}
    with pytest.raises(InvalidArgumentError, match="dops"):
        hungarian_dispatch(np.zeros((3, 4)), [0, 2])


def recount_bytes(pool: tl.Pool, plans: tl.Plans) -> tuple[float, float]:
    """Bytes the plans put on the wire, counted from the plans alone."""
    m = pool.config.model
    q_row = m.num_layers * (
        m.num_q_heads * m.head_dim * m.dtype_bytes + 4 * m.num_q_heads * (m.head_dim + 1)
    )
    query = put = 0.0
    for qp in plans.query_plans:
        for part in qp.parts:
            if part.instance_id != qp.origin:
                query += len(part.rows) * q_row
    for tp in plans.transfer_plans:
        for d, dst in enumerate(tp.dst_ids.tolist()):
            if dst != tp.origin:
                put += len(tp.rows_to(d)[0]) * m.kv_bytes_per_token
    return query, put


@pytest.mark.parametrize("seed", range(6))
def test_gen_plans_minimises_recounted_bytes(seed):
    """The pool's dispatch is optimal for its own traffic: no other assignment of the same
    plans' sub-batches to instances moves fewer bytes, and the stats match the recount."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 6))
    h = Harness(n, 16, num_slots=64)
    docs = [tokens(seed * 10 + i, 16 * int(rng.integers(1, 5)) + 3) for i in range(n)]
    for i, d in enumerate(docs):
        h.step([[tl.Chunk(f"w{i}", d, 0)]])
    batches, dops = [], []
    budget = n
    for i, d in enumerate(docs):
        if budget == 0:
            break
        dop = int(rng.integers(1, min(budget, 2) + 1))
        ids = np.concatenate([d, tokens(100 + i, 20)])
        batches.append([tl.Chunk(f"r{i}", ids, len(d) - len(d) % 16 or 16)])
        dops.append(dop)
        budget -= dop
    before = h.pool.get_stats()
    plans = h.pool.gen_plans(batches, dops)
    for key in ("query_bytes", "put_bytes", "num_iterations", "num_requests", "instance_load"):
        assert h.pool.get_stats()[key] == before[key], f"{key} counts only at commit"
    h.pool.commit(plans)
    after = h.pool.get_stats()
    query, put = recount_bytes(h.pool, plans)
    assert after["query_bytes"] - before["query_bytes"] == pytest.approx(query)
    assert after["put_bytes"] - before["put_bytes"] == pytest.approx(put)
    # every permutation of the chosen instances over the sub-batches moves at least as much
    origins = [qp.origin for qp in plans.query_plans]
    m = h.pool.config.model
    q_row = m.num_layers * (
        m.num_q_heads * m.head_dim * m.dtype_bytes + 4 * m.num_q_heads * (m.head_dim + 1)
    )
    q_mat = np.zeros((len(origins), n))
    p_mat = np.zeros((len(origins), n))
    for u, (qp, tp) in enumerate(zip(plans.query_plans, plans.transfer_plans, strict=True)):
        for part in qp.parts:
            q_mat[u, part.instance_id] += len(part.rows)
        for d, dst in enumerate(tp.dst_ids.tolist()):
            p_mat[u, dst] += len(tp.rows_to(d)[0])
    cost = traffic_cost(q_mat, p_mat, q_row, m.kv_bytes_per_token)
    assert query + put == pytest.approx(brute_force(cost))
    assert query + put == pytest.approx(sum(cost[u, o] for u, o in enumerate(origins)))
    h.pool.check_invariants()


@pytest.mark.parametrize("seed", range(20))
def test_hungarian_with_allowed_sets_equals_restricted_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 7))
    num_sub = int(rng.integers(1, n + 1))
    cost = rng.integers(0, 1000, (num_sub, n)).astype(float)
    allowed = rng.random((num_sub, n)) < 0.6
    feasible = [
        perm
        for perm in itertools.permutations(range(n), num_sub)
        if all(allowed[u, perm[u]] for u in range(num_sub))
    ]
    if not feasible:
        with pytest.raises(InvalidArgumentError, match="instances"):
            hungarian_dispatch(cost, range(n), allowed)
        return
    origins = hungarian_dispatch(cost, range(n), allowed)
    assert all(allowed[u, o] for u, o in enumerate(origins))
    best = min(sum(cost[u, perm[u]] for u in range(num_sub)) for perm in feasible)
    assert sum(cost[u, o] for u, o in enumerate(origins)) == pytest.approx(best)


def test_gen_plans_respects_instance_sets_and_rejects_bad_ones():
    h = Harness(4, 16, num_slots=32)
    ids = [tokens(i, 40) for i in range(3)]
    batches = [[tl.Chunk(f"r{i}", x, 0)] for i, x in enumerate(ids)]
    plans = h.pool.gen_plans(batches, [1, 2, 1], instances=[[0], [1, 2, 3], None])
    origins = [qp.origin for qp in plans.query_plans]
    assert origins[0] == 0 and set(origins[1:3]) <= {1, 2, 3} and len(set(origins)) == 4
    h.pool.abort(plans)
    for bad, match in (
        ([[0], [0, 1], [1]], "no assignment"),  # three sub-batches, two allowed instances
        ([[7], None, None], r"instances\[0\]"),
        ([[0], [1], None], r"instances\[1\]"),  # DoP 2 on one instance
        ([None, None], "instances"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            h.pool.gen_plans(batches, [1, 2, 1], instances=bad)
        assert h.pool.active_epoch is None and not h.pool.requests
        assert sum(a.num_used for a in h.pool.allocators) == 0
        h.pool.check_invariants()
