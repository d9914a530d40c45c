"""Failure behaviour of the multi-process data plane: an engine that dies (mid-query,
mid-put) or stops answering gives the caller a PeerFailedError in bounded time, never a hang;
the control plane drops the instance, the pool stays consistent, and re-planned requests
(surviving and recomputed ones) are still exact."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from engine_helpers import CONFIG, decode_batch, warm_up

import tokenlake as tl
from tokenlake.engines.client.synthetic import run_iteration
from tokenlake.engines.dataplane_config import PeerFailedError

KILL_AFTER_S = 0.5
DEATH_BOUND_S = 5.0  # a dead peer is noticed by its exit, long before the timeout


class Sabotage:
    """Wraps a cluster for ``run_iteration``: the first call of ``method`` on any engine
    first stops (SIGSTOP) the victim engine process, and optionally kills it a moment later,
    so the request is in flight when the peer fails."""

    def __init__(self, cluster, method: str, pid: int, kill: bool) -> None:
        self.cluster, self.backend, self.logit_cap = cluster, cluster.backend, cluster.logit_cap
        self.method, self.pid, self.kill = method, pid, kill
        self.armed_at: float | None = None
        self.returned_early = False

    def engine(self, instance_id: int):
        return _Proxy(self, self.cluster.engine(instance_id))

    def fire(self) -> None:
        if self.armed_at is not None:
            return
        self.armed_at = time.monotonic()
        os.kill(self.pid, signal.SIGSTOP)
        if self.kill:
            threading.Timer(KILL_AFTER_S, os.kill, (self.pid, signal.SIGKILL)).start()


class _Proxy:
    def __init__(self, sabotage: Sabotage, engine) -> None:
        self._s, self._e = sabotage, engine

    def __getattr__(self, name):
        attr = getattr(self._e, name)
        if name != self._s.method:
            return attr

        def call(*args):
            self._s.fire()
            out = attr(*args)
            if name == "put":  # put must not wait for the (stopped) destination
                self._s.returned_early |= time.monotonic() - self._s.armed_at < KILL_AFTER_S
            return out

        return call


def _fail_and_recover(h, ids, pick_victim, method: str, kill: bool):
    """Run one decode iteration with a sabotaged engine; check the error, fail over,
    re-plan and check exactness. Returns (error, seconds to the error, sabotage)."""
    batch = decode_batch(h, ids, 5)
    plans = h.pool.gen_plans([batch])
    victim, role = pick_victim(plans)
    sabotage = Sabotage(h.cluster, method, h.cluster.pids[(role, victim)], kill)
    with pytest.raises(PeerFailedError) as info:
        run_iteration(sabotage, plans, {c.request_id: c for c in batch}, h.model)
    elapsed = time.monotonic() - sabotage.armed_at
    err = info.value
    assert (err.instance_id, err.role) == (victim, role)
    failed = h.fail_over(plans, err)
    h.pool.check_invariants()
    assert victim not in h.pool.live_instances and victim in h.cluster.lost
    # re-plan: survivors continue, failed requests are recomputed from what is still cached
    replanned = []
    for c in batch:
        if c.request_id in failed:
            start = min(h.cached(c.token_ids), len(c.token_ids) - 1)
            replanned.append(tl.Chunk(c.request_id, c.token_ids, start))
        else:
            replanned.append(c)
    assert h.step([replanned]) <= h.tolerance
    assert all(victim not in qp.holder_ids for qp in h.last_plans.query_plans)
    assert h.step([decode_batch(h, ids, 6)]) <= h.tolerance  # one more on the shrunken cluster
    h.pool.check_invariants()
    return err, elapsed, sabotage


def _remote_holder(plans):
    for qp in plans.query_plans:
        for v in qp.holder_ids.tolist():
            if v != qp.origin:
                return v, "query"
    qp = plans.query_plans[0]
    return int(qp.holder_ids[0]), "query"


def _remote_destination(plans):
    for tp in plans.transfer_plans:
        for v in tp.dst_ids.tolist():
            if v != tp.origin:
                return v, "transfer"
    return int(plans.transfer_plans[0].dst_ids[0]), "transfer"


def test_holder_dies_mid_query(shared_cluster):
    h = shared_cluster.harness(4, 16, 64, backend="cpu", min_live=3)
    ids = warm_up(h, "abc", 100)
    err, elapsed, _ = _fail_and_recover(h, ids, _remote_holder, "query", kill=True)
    assert elapsed < KILL_AFTER_S + DEATH_BOUND_S, elapsed
    assert "exited" in str(err)


def test_puts_inside_a_host_do_not_need_the_transfer_engine(shared_cluster):
    """Inside one host a put is a direct write into the destination's shared pool: a
    destination whose transfer engine is stopped mid-put does not stall or fail it."""
    h = shared_cluster.harness(4, 16, 64, backend="cpu", min_live=3)
    ids = warm_up(h, "abc", 100)
    batch = decode_batch(h, ids, 5)
    plans = h.pool.gen_plans([batch])
    victim, role = _remote_destination(plans)
    pid = h.cluster.pids[(role, victim)]
    sabotage = Sabotage(h.cluster, "put", pid, kill=False)
    try:
        results = run_iteration(sabotage, plans, {c.request_id: c for c in batch}, h.model)
    finally:
        os.kill(pid, signal.SIGCONT)
    h.pool.commit(plans)
    h.cluster.retire(plans.epoch)
    assert sabotage.returned_early
    for r in results:
        o, lse = h.model.reference(ids[r.request_id], r.first, r.end, r.layer)
        assert float((o - r.o).abs().max()) <= h.tolerance


def test_engine_that_stops_answering_times_out(shared_cluster):
    h = shared_cluster.harness(4, 16, 64, backend="cpu", min_live=2)
    ids = warm_up(h, "abc", 100)
    err, elapsed, _ = _fail_and_recover(h, ids, _remote_holder, "query", kill=False)
    assert CONFIG.timeout_s - 0.5 < elapsed < CONFIG.timeout_s + DEATH_BOUND_S, elapsed
    assert "no answer" in str(err)
