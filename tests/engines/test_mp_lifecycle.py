"""Launch and shut-down of the multi-process data plane: readiness, and nothing left behind
(processes, shared-memory entries) even when the ``with`` block raises."""

from __future__ import annotations

import os

import numpy as np
import pytest
from engine_helpers import SHAPE, child_pids, shm_entries
from harness import tokens

import tokenlake as tl
from tokenlake.engines.client.synthetic import SyntheticModel, run_iteration
from tokenlake.engines.clusters import launcher
from tokenlake.engines.clusters.mp import MPCluster
from tokenlake.engines.dataplane_config import DataPlaneConfig


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_exception_inside_with_shuts_everything_down():
    pids_before, shm_before = child_pids(), shm_entries()
    pool = tl.Pool(tl.PoolConfig(SHAPE, num_instances=1, num_slots=8, segment_len=16))
    config = DataPlaneConfig(max_q_rows=64, max_kv_rows=64)
    with pytest.raises(RuntimeError, match="boom"), MPCluster(pool, config, "cpu") as cluster:
        engines = set(cluster.pids.values())
        assert len(engines) == 2 and engines <= child_pids()
        chunk = tl.Chunk("r", tokens(3, 40), 0)
        plans = pool.gen_plans([[chunk]])
        run_iteration(cluster, plans, {"r": chunk}, SyntheticModel(SHAPE))
        pool.commit(plans)
        raise RuntimeError("boom")
    assert child_pids() <= pids_before
    assert not any(_alive(pid) for pid in engines)
    assert shm_entries() <= shm_before
    assert os.getpid() not in engines


def test_engine_failing_at_start_up_is_reported_and_cleaned_up(monkeypatch):
    """An engine that cannot start (here: an unreachable readiness address) makes the
    launcher fail within its start-up timeout and leave nothing behind."""
    pids_before = child_pids()
    pool = tl.Pool(tl.PoolConfig(SHAPE, num_instances=1, num_slots=8, segment_len=16))
    config = DataPlaneConfig(max_q_rows=64, max_kv_rows=64, startup_timeout_s=60.0)
    monkeypatch.setattr(launcher, "main", _crash)
    with pytest.raises(tl.TokenLakeError, match="start-up"):
        MPCluster(pool, config)
    assert child_pids() <= pids_before


def _crash(spec) -> None:
    raise SystemExit(3)


def test_config_rejects_bad_values():
    with pytest.raises(tl.InvalidArgumentError, match="max_q_rows"):
        DataPlaneConfig(max_q_rows=0)
    with pytest.raises(tl.InvalidArgumentError, match="timeout_s"):
        DataPlaneConfig(timeout_s=-1)
    with pytest.raises(tl.InvalidArgumentError, match="use_mps"):
        DataPlaneConfig(use_mps=True)
    with pytest.raises(tl.InvalidArgumentError, match="device"):
        DataPlaneConfig(device="tpu")
    assert np.isclose(DataPlaneConfig(timeout_s=0.1).poll_interval_s, 0.025)
