"""The shared pool's control service as a hostile peer sees it: only holders of the cluster
secret are answered, every bad request gets an error naming what was wrong and changes
nothing, a worker reaches only its own requests and epochs, and the service goes on."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from tokenlake import plan_wire, wire
from tokenlake.config import ModelShape, PoolConfig
from tokenlake.engines.dataplane_config import PeerFailedError
from tokenlake.engines.sglang.control_service import ControlService
from tokenlake.engines.sglang.shared_runtime import ControlClient
from tokenlake.engines.transport.auth import ClusterSecret, FrameAuth
from tokenlake.errors import InvalidArgumentError, TokenLakeError
from tokenlake.plans import Chunk
from tokenlake.pool import Pool

SHAPE = ModelShape(2, 4, 2, 16, "float32")


@pytest.fixture
def service():
    pool = Pool(PoolConfig(SHAPE, 2, 16, 4, "m"))
    lost: list[int] = []
    restarted: list[int] = []
    cluster = SimpleNamespace(secret=ClusterSecret.generate(), mark_lost=lost.append,
                              restart=restarted.append)  # fmt: skip
    svc = ControlService(pool, cluster, max_request_bytes=1 << 16)
    ctx = zmq.Context()
    yield svc, ctx, lost, restarted
    svc.close()
    ctx.destroy(linger=0)


def _client(svc, ctx, secret=None, timeout_s: float = 5.0) -> ControlClient:
    return ControlClient(ctx, svc.endpoint, FrameAuth(secret or svc.cluster.secret), timeout_s)


def test_outsiders_get_no_answer_and_the_service_goes_on(service) -> None:
    svc, ctx, *_ = service
    outsider = _client(svc, ctx, ClusterSecret.generate(), timeout_s=0.5)
    with pytest.raises(PeerFailedError, match="no answer"):
        outsider.call("match", tokens=np.arange(8, dtype=np.int32))
    raw = ctx.socket(zmq.DEALER)  # no CURVE at all
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(svc.endpoint)
    raw.send(b"\x00" * 64)
    assert not raw.poll(300)
    raw.close()
    member = _client(svc, ctx)
    assert member.call("match", tokens=np.arange(8, dtype=np.int32)) == 0


def test_bad_requests_are_answered_with_errors_naming_them(service) -> None:
    svc, ctx, *_ = service
    c = _client(svc, ctx)
    cases = [
        ("nonsense", {}, r"op: expected one of"),
        ("plan", {"instance": 5, "chunks": []}, r"instance"),
        ("plan", {"instance": 0, "chunks": []}, r"chunks: expected a non-empty list"),
        ("plan", {"instance": 0, "chunks": [b"\x00"]}, r"plans"),
        ("commit", {"instance": 0, "epoch": True}, r"epoch: True is not in flight"),
        ("abort", {"instance": 1, "epoch": 0}, r"epoch: 0 is not in flight for worker 1"),
        ("locate", {"tokens": np.arange(4, dtype=np.int32), "lo": 0, "hi": 4}, r"lo/hi"),
        ("finish", {"instance": 0, "pool_id": "w1:x#1"}, r"pool_id: expected a str starting"),
        ("hello", {"instance": 0, "pid": -3}, r"pid: expected a positive int"),
    ]
    for op, args, message in cases:
        with pytest.raises(TokenLakeError, match=message):
            c.call(op, **args)
    # another worker's request id is refused, nothing planned
    chunk = plan_wire.encode(Chunk("w1:r#1", np.arange(6, dtype=np.int64), 0, 6))
    with pytest.raises(InvalidArgumentError, match="does not belong to worker 0"):
        c.call("plan", instance=0, chunks=[chunk])
    assert not svc.pool.requests and svc.pool.active_epochs == ()
    # a request over the size limit is dropped by the socket; the service answers the next
    big = ControlClient(ctx, svc.endpoint, FrameAuth(svc.cluster.secret), 0.5)
    with pytest.raises(PeerFailedError):
        big.call("match", tokens=np.zeros(1 << 16, dtype=np.int32))
    assert c.call("match", tokens=np.arange(3, dtype=np.int32)) == 0
    assert svc.stats["rejected_requests"] >= len(cases) + 1


def test_a_worker_plans_commits_its_death_drops_its_instance_a_new_one_rejoins(service) -> None:
    svc, ctx, lost, restarted = service
    c = _client(svc, ctx)
    c.call("hello", instance=0, pid=os.getpid())
    chunk = plan_wire.encode(Chunk("w0:r#1", np.arange(10, dtype=np.int64), 0, 10))
    limits = plan_wire.PlanLimits(2, 16, 4)
    plans = plan_wire.decode(c.call("plan", instance=0, chunks=[chunk])["plans"], limits)
    assert plans.query_plans[0].origin == 0
    with pytest.raises(InvalidArgumentError, match="not in flight for worker 1"):
        c.call("commit", instance=1, epoch=plans.epoch)
    c.call("commit", instance=0, epoch=plans.epoch)
    assert c.call("match", tokens=np.arange(10, dtype=np.int32)) == 8  # two sealed segments
    assert c.call("stored", instance=0, pool_id="w0:r#1") == 10
    c.call("finish", instance=0, pool_id="w0:r#1")
    assert c.call("stored", instance=0, pool_id="w0:r#1") is None
    assert c.call("match", tokens=np.arange(10, dtype=np.int32)) == 10  # and its kept tail
    where = c.call("locate", tokens=np.arange(10, dtype=np.int32), lo=2, hi=10)
    assert where["first_segment"] == 0 and len(where["where"]) == 2 * 3
    # a worker whose process is gone: instance 1 registered with a pid that no longer runs
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    c.call("hello", instance=1, pid=gone.pid)
    for _ in range(100):  # bounded: the service checks its workers every 100 ms
        if lost:
            break
        c.call("stats")
    assert lost == [1] and svc.pool.live_instances == (0,)
    with pytest.raises(InvalidArgumentError, match="was dropped"):
        c.call("plan", instance=1, chunks=[chunk])
    assert wire.unpackb(wire.packb(c.call("stats")), 1 << 20)["lost"] == [1]
    # instance 0 is held by this live process: another process is refused it, by name
    other = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(InvalidArgumentError, match=r"instance: 0 is held by a live worker"):
            c.call("attach", instance=0, pid=other.pid)
        # a new worker joins the dropped instance 1: it comes back, empty (its engines
        # restarted; this fake cluster's buffers are not named, so the reply is an error)
        with pytest.raises(InvalidArgumentError, match="not named"):
            c.call("attach", instance=1, pid=os.getpid())
    finally:
        other.kill()
        other.wait(10)
    assert restarted == [1] and svc.pool.live_instances == (0, 1) and svc.lost == set()
    c.call("hello", instance=1, pid=os.getpid())
    chunk1 = plan_wire.encode(Chunk("w1:s#1", np.arange(10, dtype=np.int64), 0, 10))
    reply = c.call("plan", instance=1, chunks=[chunk1])
    assert reply["members"] == 1  # every worker re-reads the endpoints: one restart since
    c.call("commit", instance=1, epoch=plan_wire.decode(reply["plans"], limits).epoch)
    c.call("finish", instance=1, pool_id="w1:s#1")
    check = c.call("check")  # the pool's invariants hold, and every used slot is a replica's
    assert check["running"] == check["in_flight"] == 0
    assert check["replicas"] == sum(check["slots_used"]) >= check["segments"] > 0


def test_one_copy_and_attach_requests_are_checked(service) -> None:
    """``release``, ``attach`` and a plan's ``engine_slots`` from an authenticated worker:
    wrong types, ranges or pool kinds get an error naming them, and nothing changes."""
    svc, ctx, *_ = service
    c = _client(svc, ctx)
    chunk = plan_wire.encode(Chunk("w0:r#1", np.arange(8, dtype=np.int64), 0, 8))
    cases = [
        ("release", {"instance": 0, "slots": [1, 2]}, r"slots: expected a 1-D int32 array"),
        ("release", {"instance": 0, "slots": np.array([1], np.int32)}, r"engine_slots"),
        ("attach", {"instance": 0}, r"not named"),
        ("attach", {"instance": 7}, r"instance"),
    ]
    for op, args, message in cases:
        with pytest.raises(TokenLakeError, match=message):
            c.call(op, **args)
    # a one-copy pool: a plan must carry one slot array per chunk, each slot in range
    pool = Pool(PoolConfig(SHAPE, 2, 16, 4, "m"), engine_slots=True)
    one = ControlService(pool, SimpleNamespace(secret=svc.cluster.secret, mark_lost=print))
    try:
        w = _client(one, ctx)
        bad = [
            ({}, r"engine_slots: expected a list of 1 slot arrays"),
            ({"engine_slots": [np.array([3], np.int32)]}, r"expected 2 slots"),
            (
                {"engine_slots": [np.array([3, 99], np.int32)]},
                r"slot: expected a slot in \[0, 16\)",
            ),
        ]
        for extra, message in bad:
            with pytest.raises(TokenLakeError, match=message):
                w.call("plan", instance=0, chunks=[chunk], **extra)
        pool.check_invariants()
        assert pool.requests == {} and pool.tree.num_nodes == 0
        with pytest.raises(TokenLakeError, match=r"slots\[0\]"):
            w.call("release", instance=0, slots=np.array([16], np.int32))
        assert w.call("release", instance=1, slots=np.array([3, 5], np.int32)) == [3, 5]
    finally:
        one.close()
