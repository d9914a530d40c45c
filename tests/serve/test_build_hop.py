"""``tokenlake serve`` prices hops: the profiled start-up measures the fixed cost of a remote
holder on the served data plane and the scheduler's latency model carries it."""

from __future__ import annotations

import pytest

import tokenlake as tl
from tokenlake.serve.build import LINK_BYTES_PER_S, build
from tokenlake.serve.config import ServeConfig


def served_model(num_instances: int, data_plane: str, profile: bool = True):
    config = ServeConfig(
        num_instances=num_instances, segment_len=8, num_slots=64, chunk_len=16,
        max_model_len=256, data_plane=data_plane, profile=profile, torch_threads=1,
    )  # fmt: skip
    served = build(config)
    try:
        pool = served.runtime.scheduler.pool
        # the probe ran on a scratch pool: the served pool holds nothing and counted nothing
        assert pool.get_stats() == tl.Pool(pool.config).get_stats()
        assert pool.get_prefix_tree().num_segments == 0
        pool.check_invariants()
        model = served.runtime.scheduler.latency_model
        # dispatch and placement weigh the same hop, in bytes at the link's rate
        assert pool.balancer.hop_bytes == pytest.approx(model.hop_s * LINK_BYTES_PER_S)
        return model
    finally:
        served.runtime.close()


@pytest.mark.parametrize("num_instances", [2, 4])
def test_multi_process_plane_prices_a_hop(num_instances):
    model = served_model(num_instances, "mp")
    assert model.hop_s > 0.0
    # a spread step now costs more than the same work on one instance
    assert model.predict("decode", [1], remote_holders=1) > model.predict("decode", [1])


@pytest.mark.parametrize("plane", ["local", "mp"])
def test_one_instance_has_no_hop(plane):
    assert served_model(1, plane).hop_s == 0.0


def test_unprofiled_start_keeps_hops_free():
    assert served_model(2, "local", profile=False).hop_s == 0.0
