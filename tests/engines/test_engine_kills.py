"""Engine kills mid-iteration, seeded: a holder's query engine is SIGKILLed at a random call
of an iteration that still needs it. Every kill must surface as a PeerFailedError within a
bounded time (no hang), the control plane fails the instance over, every request of the
iteration completes after re-planning (recomputed where its prefix was lost) with exact
attention, lost instances restart, and nothing is left behind. Prints the figures.

``TOKENLAKE_SOAK_KILLS=N`` runs a longer soak (default 50 kills)."""

from __future__ import annotations

import os
import signal
import statistics
import time

import numpy as np
from engine_helpers import SHAPE, child_pids, shm_entries
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.engines.client.synthetic import run_iteration
from tokenlake.engines.clusters.mp import MPCluster
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError

NUM_KILLS = int(os.environ.get("TOKENLAKE_SOAK_KILLS", "50"))
NUM_INSTANCES, C = 4, 16
CALLS = ("init_query", "init_transfer", "put", "query")


class KillAt:
    """A cluster whose engines SIGKILL ``pid`` just before the ``at``-th data-plane call."""

    def __init__(self, cluster, pid: int, at: int) -> None:
        self.cluster, self.backend, self.logit_cap = cluster, cluster.backend, cluster.logit_cap
        self.pid, self.at, self.calls = pid, at, 0
        self.killed_at: float | None = None

    def engine(self, instance_id: int):
        return _Proxy(self, self.cluster.engine(instance_id))

    def synchronize(self) -> None:
        self.cluster.synchronize()


class _Proxy:
    def __init__(self, owner: KillAt, engine) -> None:
        self._o, self._e = owner, engine

    def __getattr__(self, name):
        attr = getattr(self._e, name)
        if name not in CALLS:
            return attr

        def call(*args):
            o = self._o
            if o.killed_at is None and o.calls >= o.at:
                os.kill(o.pid, signal.SIGKILL)
                o.killed_at = time.monotonic()
            o.calls += 1
            return attr(*args)

        return call


def _calls_until_last_query_of(plans, victim: int) -> int:
    """Data-plane calls of ``run_forward`` up to and including the last query that needs
    ``victim``: binds (two per sub-batch), then per layer every put, then every query."""
    subs = len(plans.query_plans)
    needs = [victim in qp.holder_ids.tolist() and qp.origin != victim for qp in plans.query_plans]
    last = max(k for k, n in enumerate(needs) if n)
    return 2 * subs + (SHAPE.num_layers - 1) * 2 * subs + subs + last


def test_engine_kills_mid_iteration_are_detected_and_recovered():
    pids_before, shm_before = child_pids(), shm_entries()
    config = tl.PoolConfig(SHAPE, NUM_INSTANCES, num_slots=64, segment_len=C)
    dataplane = DataPlaneConfig(max_q_rows=256, max_kv_rows=256, timeout_s=30.0)
    rng = np.random.default_rng(2024)
    kills, hangs, wrong, completed, detections = 0, 0, 0, 0, []
    with MPCluster(config, dataplane, backend="cpu") as cluster:
        h = Harness(NUM_INSTANCES, C, 64, backend="cpu")
        h.cluster = cluster.reset(config, "cpu")
        ids = {f"r{k}": tokens(100 + k, C * int(rng.integers(3, 8)) + 3) for k in range(4)}
        for rid, t in ids.items():
            assert h.step([[tl.Chunk(rid, t, 0)]]) <= h.tolerance
        step = 0
        while kills < NUM_KILLS:
            step += 1
            for rid in ids:
                ids[rid] = np.append(ids[rid], step % 997)
            chunks = [tl.Chunk(r, t, h.pool.num_stored_tokens(r)) for r, t in ids.items()]
            live = len(h.pool.live_instances)
            batches = [chunks[k::live] for k in range(min(live, len(chunks)))]
            plans = h.pool.gen_plans(batches)
            remote = sorted(
                {v for qp in plans.query_plans for v in qp.holder_ids.tolist() if v != qp.origin}
            )
            by_id = {c.request_id: c for c in chunks}
            if not remote:  # nothing to kill in this iteration: run it plainly
                run_iteration(h.cluster, plans, by_id, h.model)
                h.pool.commit(plans)
                h.cluster.retire(plans.epoch)
                continue
            victim = int(rng.choice(remote))
            last = _calls_until_last_query_of(plans, victim)
            saboteur = KillAt(
                cluster, cluster.pids[("query", victim)], int(rng.integers(0, last + 1))
            )
            t0 = time.monotonic()
            try:
                run_iteration(saboteur, plans, by_id, h.model)
                hangs += 1  # the kill went unnoticed: counted as a failure below
                h.pool.commit(plans)
                h.cluster.retire(plans.epoch)
                continue
            except PeerFailedError as e:
                detections.append(time.monotonic() - (saboteur.killed_at or t0))
                assert (e.instance_id, e.role) == (victim, "query"), e
                failed = h.fail_over(plans, e)
            kills += 1
            replanned = []  # every request of the iteration completes after re-planning
            for c in chunks:
                if c.request_id in failed:
                    start = min(h.cached(c.token_ids), len(c.token_ids) - 1)
                    replanned.append(tl.Chunk(c.request_id, c.token_ids, start))
                else:
                    replanned.append(c)
            live = len(h.pool.live_instances)
            err = h.step([replanned[k::live] for k in range(min(live, len(replanned)))])
            wrong += int(err > h.tolerance)
            completed += len(replanned)
            h.pool.check_invariants()
            if len(h.pool.live_instances) <= 2:  # bring the lost instances back, empty
                for i in sorted(cluster.lost):
                    cluster.restart(i)
                    h.pool.restore_instance(i)
    leaked_procs = len(child_pids() - pids_before)
    leaked_shm = len(shm_entries() - shm_before)
    print(
        f"\nengine kills: {kills} mid-iteration kills, {hangs} hangs or undetected, "
        f"{wrong} wrong outputs, {completed} in-flight requests completed after re-planning; "
        f"detection median {statistics.median(detections):.3f} s, max {max(detections):.3f} s; "
        f"leaked processes {leaked_procs}, leaked shm {leaked_shm}"
    )
    assert kills >= NUM_KILLS and hangs == 0 and wrong == 0
    assert max(detections) <= 1.0, detections
    assert leaked_procs == 0 and leaked_shm == 0
