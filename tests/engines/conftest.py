"""Fixtures of the multi-process data-plane tests: one launched cluster shared by the
session (engine start-up dominates their cost), a per-test hang watchdog, and process/shared
memory snapshots (in engine_helpers.py)."""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the harness

from engine_helpers import CAPACITY, CONFIG  # noqa: E402
from harness import Harness  # noqa: E402

import tokenlake as tl  # noqa: E402
from tokenlake.engines.clusters.mp import MPCluster  # noqa: E402

HERE = Path(__file__).resolve().parent
WATCHDOG_S = 240  # a hung test dumps every thread's stack and ends the run


WATCHDOG_FILE = os.path.join(tempfile.gettempdir(), f"tokenlake-watchdog-{os.getpid()}.txt")


@pytest.fixture(autouse=True)
def watchdog(request):
    """A hung test dumps every thread's stack to WATCHDOG_FILE (outside pytest's capture,
    which the exit would discard) and ends the run."""
    # the data-plane tests of this folder only, not the subfolders' (model, kernels)
    if Path(str(request.node.path)).resolve().parent != HERE:
        yield
        return
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
