"""Fixtures of the multi-process data-plane tests: one launched cluster shared by the
session (engine start-up dominates their cost), a per-test hang watchdog, and process/shared
memory snapshots."""

from __future__ import annotations

import faulthandler
import os
import sys
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the harness

from harness import Harness  # noqa: E402

import tokenlake as tl  # noqa: E402
from tokenlake.engines.dataplane_config import DataPlaneConfig  # noqa: E402
from tokenlake.engines.mp_cluster import MPCluster  # noqa: E402

WATCHDOG_S = 240  # a hung test dumps every thread's stack and ends the run
MAX_INSTANCES = 4
# the largest layout any test lays out on the shared cluster
SHAPE = tl.ModelShape(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32")
CAPACITY = tl.PoolConfig(SHAPE, MAX_INSTANCES, num_slots=64, segment_len=64)
CONFIG = DataPlaneConfig(max_q_rows=512, max_kv_rows=512, timeout_s=8.0)


@pytest.fixture(autouse=True)
def watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


class SharedCluster:
    """Hands out harnesses whose data plane is the shared :class:`MPCluster`."""

    def __init__(self, cluster: MPCluster) -> None:
        self.cluster = cluster

    def harness(self, num_instances: int, *args, min_live: int | None = None, **kwargs) -> Harness:
        """A :class:`Harness` of ``num_instances`` instances served by the cluster. Lost
        instances are restarted first unless ``min_live`` of them already run."""
        need = num_instances if min_live is None else min_live
        lost = sorted(i for i in self.cluster.lost if i < num_instances)
        while lost and num_instances - len(lost) < need:
            self.cluster.restart(lost.pop(0))
        h = Harness(num_instances, *args, **kwargs)
        h.cluster = self.cluster.reset(h.pool.config, h.cluster.backend)
        for i in sorted(self.cluster.lost):  # the control plane learns what the data plane lost
            if i in h.pool.live_instances:
                h.pool.drop_instance(i)
        return h


@pytest.fixture(scope="session")
def shared_cluster():
    with MPCluster(tl.Pool(CAPACITY), CONFIG) as cluster:
        yield SharedCluster(cluster)


def child_pids() -> set[int]:
    """Live (non-zombie) child processes of this process. Starts multiprocessing's resource
    tracker first: it is a child that lives as long as this process, not a leak."""
    resource_tracker.ensure_running()
    me, out = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            out.add(int(entry))
    return out


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))
