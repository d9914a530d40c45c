"""A pool whose model soft-caps its attention logits (``ModelShape.logit_cap``): every holder's
partial, the local attention and their merge apply the cap, on both transports and between
hosts; every row of every layer matches monolithic capped attention (fp32 <= 1e-5)."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import CAPACITY, CONFIG
from harness import Harness, dop_split_and_spread, prefill_decode_dedup_multiturn, tokens

import tokenlake as tl
from tokenlake.engines.client.synthetic import SyntheticModel
from tokenlake.engines.clusters.mp import MPCluster

CAP = 1.5  # the synthetic model's scores have std 1: a cap of 1.5 bends them strongly


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("num_instances,segment_len", [(1, 16), (3, 4)])
def test_local_cluster(backend, num_instances, segment_len):
    h = Harness(num_instances, segment_len, num_slots=48, backend=backend, logit_cap=CAP)
    assert h.cluster.logit_cap == CAP
    prefill_decode_dedup_multiturn(h, num_instances, segment_len)
    if num_instances > 1:
        dop_split_and_spread(Harness(4, 16, backend=backend, logit_cap=CAP), 4)


def test_the_cap_is_what_makes_it_exact():
    # the same pool against an uncapped reference model: far from exact, so the tests above
    # would see a cap the data plane dropped
    h = Harness(2, 8, num_slots=48, backend="cpu", logit_cap=CAP)
    h.model = SyntheticModel(dataclasses.replace(h.shape, logit_cap=0.0), seed=1)
    ids = tokens(1, 40)
    assert h.step([[tl.Chunk("a", ids[:30], 0)]]) > 0.05
    assert h.step([[tl.Chunk("a", ids, 30)]]) > 0.05


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_processes(shared_cluster, dtype):
    h = shared_cluster.harness(2, 16, 48, dtype, backend="cpu", logit_cap=CAP)
    assert h.cluster.logit_cap == CAP
    prefill_decode_dedup_multiturn(h, 2, 16)
    # the next pool on the same engines has no cap: Configure carries it
    h = shared_cluster.harness(2, 16, 48, backend="cpu")
    assert h.cluster.logit_cap == 0.0
    prefill_decode_dedup_multiturn(h, 2, 16)


def test_between_hosts():
    """Query rows and (o, lse) over point-to-point (the query engines' packed parts)."""
    config = tl.PoolConfig(CAPACITY.model, 2, CAPACITY.num_slots, CAPACITY.segment_len)
    dataplane = dataclasses.replace(CONFIG, separate_hosts=True)
    with MPCluster(tl.Pool(config), dataplane) as cluster:
        h = Harness(2, 16, 48, backend="cpu", logit_cap=CAP)
        h.cluster = cluster.reset(h.pool.config, "cpu")
        prefill_decode_dedup_multiturn(h, 2, 16)
        remote = [
            (qp.origin, holder)
            for qp in h.last_plans.query_plans
            for holder in qp.holder_ids.tolist()
            if holder != qp.origin
        ]
        assert remote, "some query went to another host"
