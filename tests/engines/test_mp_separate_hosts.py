"""The between-hosts path: every instance treated as its own host, so q rows, (o, lse), put
rows and replicated segments travel over torch.distributed point-to-point (gloo on
127.0.0.1) instead of shared buffers; results must be exactly as on one host."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import CAPACITY, child_pids, shm_entries
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.engines.clusters.mp import MPCluster
from tokenlake.engines.dataplane_config import DataPlaneConfig

CONFIG = DataPlaneConfig(max_q_rows=512, max_kv_rows=512, timeout_s=8.0, separate_hosts=True)
NUM_INSTANCES = 2


@pytest.fixture(scope="module")
def launched():
    before = (child_pids(), shm_entries())
    config = tl.PoolConfig(CAPACITY.model, NUM_INSTANCES, CAPACITY.num_slots, CAPACITY.segment_len)
    cluster = MPCluster(tl.Pool(config), CONFIG)
    yield cluster, before
    cluster.close()


def _harness(cluster, *args, balancer=None, **kwargs) -> Harness:
    h = Harness(NUM_INSTANCES, *args, **kwargs)
    if balancer is not None:
        h.pool = tl.Pool(h.config, balancer=balancer)
    h.cluster = cluster.reset(h.pool.config, h.cluster.backend)
    return h


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_decode_multiturn_over_the_group(launched, dtype):
    h = _harness(launched[0], 16, 48, dtype, backend="cpu")
    c = 16
    doc = tokens(1, 5 * c + c // 2)
    a_ids = np.concatenate([doc, tokens(2, c + 3)])
    errs = [h.step([[tl.Chunk("a", a_ids, 0, 2 * c + 4)]], dops=[2])]
    errs.append(h.step([[tl.Chunk("a", a_ids, 2 * c + 4)]]))
    b_ids = np.concatenate([doc, tokens(3, 2 * c)])
    errs.append(h.step([[tl.Chunk("b", b_ids, h.cached(b_ids))]]))
    for step in range(2):
        a_ids, b_ids = np.append(a_ids, 7 + step), np.append(b_ids, 9 + step)
        na, nb = h.pool.num_stored_tokens("a"), h.pool.num_stored_tokens("b")
        errs.append(h.step([[tl.Chunk("a", a_ids, na)], [tl.Chunk("b", b_ids, nb)]]))
    h.pool.finish("a")
    turn2 = np.concatenate([a_ids, tokens(5, c + 1)])
    errs.append(h.step([[tl.Chunk("a2", turn2, h.cached(turn2))]]))
    assert max(errs) <= h.tolerance, errs
    remote = [
        (qp.origin, h_id)
        for qp in h.last_plans.query_plans
        for h_id in qp.holder_ids.tolist()
        if h_id != qp.origin
    ]
    assert remote or h.pool.get_stats()["num_segments"] > 0


def test_replication_copies_between_hosts(launched):
    """Hot segments get replicated to the other instance (a send/receive pair between the
    transfer engines); queries reading the replicas stay exact."""
    eager = BalancerConfig(overload_factor=1.0, heavy_hitter_k=4.0, max_replications=8)
    h = _harness(launched[0], 16, 64, backend="cpu", balancer=eager)
    doc = tokens(7, 16 * 6)
    cross_copies = 0
    for k in range(8):
        ids = np.concatenate([doc, tokens(50 + k, 5)])
        assert h.step([[tl.Chunk(f"r{k}", ids, h.cached(ids))]]) <= h.tolerance
        for tp in h.last_plans.transfer_plans:
            cross_copies += int(np.sum(tp.copy_src_instance != tp.copy_dst_instance))
        h.pool.finish(f"r{k}")
    assert cross_copies > 0, "expected replication orders between the two hosts"


def test_close_leaves_nothing_behind(launched):
    cluster, (pids_before, shm_before) = launched
    assert len(child_pids() - pids_before) >= 2 * NUM_INSTANCES
    cluster.close()
    cluster.close()  # idempotent
    assert child_pids() <= pids_before
    assert shm_entries() <= shm_before
