"""Compute engines in processes of their own, separate from the scheduler process that
holds the control plane: plans travel over the wire, each compute process drives the
engines through its own clients, and every query row of every layer equals monolithic
causal attention computed here, in the scheduler process."""

from __future__ import annotations

import os
from functools import partial

import numpy as np
import pytest
from engine_helpers import SHAPE, child_pids
from harness import program_error, tokens

import tokenlake as tl
from tokenlake.engines.client.synthetic import SyntheticModel, SyntheticProgram
from tokenlake.engines.clusters.compute_process import ComputeProcesses
from tokenlake.engines.clusters.mp import MPCluster
from tokenlake.engines.dataplane_config import DataPlaneConfig

C = 16


@pytest.fixture(scope="module")
def setup():
    pids_before = child_pids()
    config = tl.PoolConfig(SHAPE, 2, num_slots=48, segment_len=C)
    dataplane = DataPlaneConfig(max_q_rows=256, max_kv_rows=256, timeout_s=20.0)
    cluster = MPCluster(config, dataplane, backend="cpu")
    compute = ComputeProcesses(cluster, [[0], [1]], partial(SyntheticProgram, SHAPE, 1))
    yield config, cluster, compute
    compute.close()
    cluster.close()
    assert child_pids() <= pids_before


def _step(pool, compute, batches, dops=None) -> float:
    plans = pool.gen_plans(batches, dops)
    chunks = {c.request_id: c for b in batches for c in b}
    results = compute.run(plans, chunks)
    pool.commit(plans)
    compute.retire(plans.epoch)
    model = SyntheticModel(SHAPE, seed=1)  # the reference, in the scheduler process
    return program_error(model, results, chunks)


def test_compute_processes_are_exact(setup):
    config, _, compute = setup
    assert os.getpid() not in compute.pids and len(set(compute.pids)) == 2
    pool = tl.Pool(config)
    doc = tokens(1, 5 * C + C // 2)
    a = np.concatenate([doc, tokens(2, C + 3)])
    b = np.concatenate([doc, tokens(3, 2 * C)])
    errs = [
        _step(pool, compute, [[tl.Chunk("a", a, 0, 2 * C + 4)], [tl.Chunk("x", tokens(9, 30), 0)]])
    ]
    errs.append(_step(pool, compute, [[tl.Chunk("a", a, 2 * C + 4)]]))
    hit = pool.get_prefix_tree().match(b).num_tokens
    errs.append(_step(pool, compute, [[tl.Chunk("b", b, hit)]]))
    for k in range(3):  # decodes of both, in two batches on the two processes
        a, b = np.append(a, 7 + k), np.append(b, 9 + k)
        na, nb = pool.num_stored_tokens("a"), pool.num_stored_tokens("b")
        errs.append(_step(pool, compute, [[tl.Chunk("a", a, na)], [tl.Chunk("b", b, nb)]]))
    pool.finish("a")
    turn2 = np.concatenate([a, tokens(5, C + 1)])
    hit = pool.get_prefix_tree().match(turn2).num_tokens
    assert hit == len(a)
    errs.append(_step(pool, compute, [[tl.Chunk("a2", turn2, hit)]]))
    assert max(errs) <= 1e-5, errs


def test_a_batch_may_not_span_compute_processes(setup):
    config, _, compute = setup
    pool = tl.Pool(config)
    plans = pool.gen_plans([[tl.Chunk("p", tokens(4, 3 * C), 0)]], dops=[2])
    with pytest.raises(tl.InvalidArgumentError, match="spans compute processes"):
        compute.run(plans, {"p": tl.Chunk("p", tokens(4, 3 * C), 0)})
    pool.abort(plans)
