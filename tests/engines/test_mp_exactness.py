"""The foundation's exactness grid against the multi-process data plane: query + local
self-attention, merged, equals monolithic causal attention (docs/architecture.md#one-iterations-life), with the engines
running as separate processes sharing buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import dop_split_and_spread, prefill_decode_dedup_multiturn, tier_round_trip, tokens

import tokenlake as tl
from tokenlake.engines.client.engine_client import EngineClient
from tokenlake.errors import InvalidArgumentError, StalePlanError

GRID = [
    pytest.param(n, c, dtype, backend, id=f"N{n}-C{c}-{dtype}-{backend}")
    for n in (2, 4)
    for c in (16, 64)
    for dtype in ("float32", "bfloat16")
    for backend in ("torch", "cpu")
]


@pytest.mark.parametrize("num_instances,segment_len,dtype,backend", GRID)
def test_prefill_decode_dedup_multiturn(shared_cluster, num_instances, segment_len, dtype, backend):
    h = shared_cluster.harness(num_instances, segment_len, 48, dtype, backend=backend)
    assert isinstance(h.cluster.engine(0), EngineClient)
    prefill_decode_dedup_multiturn(h, num_instances, segment_len)


@pytest.mark.parametrize("num_instances", [2, 4])
def test_dop_split_and_spread(shared_cluster, num_instances):
    dop_split_and_spread(
        shared_cluster.harness(num_instances, 16, 64, backend="cpu"), num_instances
    )


@pytest.mark.parametrize("num_instances", [2, 4])
def test_segments_promoted_from_the_host_tier_stay_exact(shared_cluster, num_instances):
    h = shared_cluster.harness(num_instances, 16, 6, backend="cpu", num_tier_blocks=32)
    tier_round_trip(h, num_instances)


def test_same_iteration_dedup_stays_exact(shared_cluster):
    h = shared_cluster.harness(4, 16, 32, backend="cpu")
    shared = tokens(21, 16 * 3)
    x, y = np.append(shared, [1, 2]), np.append(shared, [3])
    assert h.step([[tl.Chunk("x", x, 0)], [tl.Chunk("y", y, 0)]]) <= h.tolerance
    assert h.pool.get_stats()["num_dedup_segments"] == 3
    x, y = np.append(x, 5), np.append(y, 6)
    err = h.step([[tl.Chunk("x", x, len(x) - 1), tl.Chunk("y", y, len(y) - 1)]])
    assert err <= h.tolerance


def test_put_is_ordered_before_the_query_of_its_layer(shared_cluster):
    """put returns before the data landed; a query of that layer (from another instance, in
    the next iteration) still sees it, with no explicit flush in between."""
    h = shared_cluster.harness(2, 16, 32, backend="cpu")
    ids = tokens(31, 16 * 6)
    for end in range(16, len(ids) + 1, 16):  # every chunk's prefix was put one step earlier
        start = h.pool.num_stored_tokens("r") if end > 16 else 0
        assert h.step([[tl.Chunk("r", ids, start, end)]], dops=[1]) <= h.tolerance


def test_bad_input_names_the_argument(shared_cluster):
    h = shared_cluster.harness(2, 16, 32, backend="cpu")
    ids = tokens(41, 40)
    plans = h.pool.gen_plans([[tl.Chunk("r", ids, 0)]])
    qp, tp = plans.query_plans[0], plans.transfer_plans[0]
    engine, other = h.cluster.engine(qp.origin), h.cluster.engine(1 - qp.origin)
    with pytest.raises(InvalidArgumentError, match="query_plan"):
        other.init_query(qp)
    with pytest.raises(InvalidArgumentError, match="transfer_plan"):
        engine.init_transfer(qp)
    q_buf, kv_buf = engine.init_query(qp), engine.init_transfer(tp)
    assert q_buf.shape == (qp.num_rows, 4, 16) and kv_buf.shape == (2, tp.num_rows, 2, 2, 16)
    with pytest.raises(InvalidArgumentError, match="layer"):
        engine.query(q_buf, 2)
    with pytest.raises(InvalidArgumentError, match="q_buf"):
        engine.query(torch.zeros_like(q_buf), 0)
    with pytest.raises(InvalidArgumentError, match="kv_buf"):
        engine.put(q_buf, 0)
    with pytest.raises(InvalidArgumentError, match="instance_id"):
        h.cluster.engine(2)
    h.pool.abort(plans)
    h.cluster.retire(plans.epoch)
    with pytest.raises(StalePlanError, match="q_buf"):
        engine.query(q_buf, 0)
    with pytest.raises(StalePlanError, match="query_plan"):
        engine.init_query(qp)
    # capacity: a plan needing more rows than the shared buffers hold
    long_ids = tokens(42, 600)
    plans = h.pool.gen_plans([[tl.Chunk("long", long_ids, 0)]])
    engine = h.cluster.engine(plans.query_plans[0].origin)
    with pytest.raises(InvalidArgumentError, match="query_plan.*max_q_rows"):
        engine.init_query(plans.query_plans[0])
    with pytest.raises(InvalidArgumentError, match="transfer_plan.*max_kv_rows"):
        engine.init_transfer(plans.transfer_plans[0])
    h.pool.abort(plans)
    h.cluster.retire(plans.epoch)
    with pytest.raises(InvalidArgumentError, match="config"):
        h.cluster.reset(tl.PoolConfig(h.shape, 2, num_slots=4096, segment_len=64))
