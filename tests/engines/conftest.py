"""Fixtures of the multi-process data-plane tests: one launched cluster shared by the
session (engine start-up dominates their cost), a per-test hang watchdog, and process/shared
memory snapshots."""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
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


WATCHDOG_FILE = os.path.join(tempfile.gettempdir(), f"tokenlake-watchdog-{os.getpid()}.txt")


@pytest.fixture(autouse=True)
def watchdog(request):
    """A hung test dumps every thread's stack to WATCHDOG_FILE (outside pytest's capture,
    which the exit would discard) and ends the run."""
    with open(WATCHDOG_FILE, "a") as f:
        f.write(f"{request.node.nodeid}\n")
        f.flush()
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=f)
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
    """Live (non-zombie) descendants of this process, but multiprocessing's helpers that live
    as long as it does (the resource tracker, the engines' fork server): started here first
    so that they are never counted as leaks."""
    from multiprocessing import forkserver

    from tokenlake.engines.launcher import process_context

    resource_tracker.ensure_running()
    process_context()  # the fork server's preload, before it starts
    forkserver.ensure_running()
    helpers = {resource_tracker._resource_tracker._pid, forkserver._forkserver._forkserver_pid}
    parent = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(entry)] = int(fields[1])
    out, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - out
        out |= frontier
    return out - helpers


def shm_entries() -> set[str]:
    # Ray launches (serve/ray_buffers.py) name theirs "tokenlake-ray-*"; another suite's
    # launch running on the same machine must not count as this test's leak.
    return {e for e in os.listdir("/dev/shm") if not e.startswith("tokenlake-ray-")}
