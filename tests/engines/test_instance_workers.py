"""Instance workers: one process per instance with its own step loop, plans in and results out
through a shared-memory mailbox, every other instance's segments read in place. Iterations on
disjoint instances are in flight at once; every query row of every layer equals monolithic
causal attention computed here, in the test process (the one holding the pool)."""

from __future__ import annotations

import os
import signal
import time
from functools import partial

import numpy as np
import pytest
from engine_helpers import SHAPE, child_pids
from harness import program_error, tokens

import tokenlake as tl
from tokenlake.engines.client.synthetic import SyntheticModel, SyntheticProgram
from tokenlake.engines.clusters.instance_workers import InstanceWorkers
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError, RemoteEngineError
from tokenlake.engines.transport import messages

C = 16
HANG_GUARD_S = 60.0  # a guard against a hang only


@pytest.fixture(scope="module")
def setup():
    pids_before = child_pids()
    config = tl.PoolConfig(SHAPE, 2, num_slots=48, segment_len=C)
    dataplane = DataPlaneConfig(max_q_rows=256, max_kv_rows=256, timeout_s=20.0)
    workers = InstanceWorkers(config, dataplane, partial(SyntheticProgram, SHAPE, 1), "cpu")
    yield tl.Pool(config), workers  # one pool: the workers see its epochs only grow
    workers.close()
    assert child_pids() <= pids_before


def _answer(workers, ticket):
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        result = workers.answer(ticket)
        if result is not None:
            return result
        assert time.monotonic() < deadline, "no answer"
        workers.wait(0.05)


def test_two_instances_step_at_once_reading_each_other_in_place(setup):
    pool, workers = setup
    assert os.getpid() not in workers.pids and len(set(workers.pids)) == 2
    model = SyntheticModel(SHAPE, seed=1)
    doc = tokens(1, 6 * C + 5)
    first = pool.gen_plans([[tl.Chunk("doc", doc, 0)]], instances=[[0]])
    chunks = {"doc": tl.Chunk("doc", doc, 0)}
    assert program_error(model, [_answer(workers, workers.start(first, chunks))], chunks) < 1e-4
    pool.commit(first)
    pool.finish("doc")
    # the document's segments are spread over both instances by hash
    assert set(first.transfer_plans[0].dst_ids.tolist()) == {0, 1}
    a = np.concatenate([doc, tokens(2, C + 3)])
    b = np.concatenate([doc, tokens(3, 2 * C)])
    tree = pool.get_prefix_tree()
    ca = tl.Chunk("a", a, tree.match(a).num_tokens)
    plans_a = pool.gen_plans([[ca]], instances=[[0]])
    cb = tl.Chunk("b", b, pool.get_prefix_tree().match(b).num_tokens)
    plans_b = pool.gen_plans([[cb]], instances=[[1]])
    assert ca.start > 0 and cb.start > 0 and pool.get_stats()["num_iterations_in_flight"] == 2
    # both posted before either is awaited: each worker steps on its own
    ta, tb = workers.start(plans_a, {"a": ca}), workers.start(plans_b, {"b": cb})
    assert workers.busy
    got_b, got_a = _answer(workers, tb), _answer(workers, ta)
    assert program_error(model, [got_a], {"a": ca}) < 1e-4
    assert program_error(model, [got_b], {"b": cb}) < 1e-4
    for plans in (plans_b, plans_a):  # in any order
        pool.commit(plans)
    # each origin read a part held by the other instance
    for plans, origin in ((plans_a, 0), (plans_b, 1)):
        assert any(p.instance_id != origin for p in plans.query_plans[0].parts)


def test_a_bad_job_is_an_error_answer_and_the_worker_goes_on(setup):
    pool, workers = setup
    box = workers.mailboxes[0]
    seq = box.post(messages.encode(messages.Stop(0)))  # not a RunStep
    workers._jobs[0] = (seq, time.monotonic())
    with pytest.raises(RemoteEngineError, match="expected a RunStep"):
        _answer(workers, (0, seq))
    chunk = tl.Chunk("x", tokens(5, 2 * C), 0)
    plans = pool.gen_plans([[chunk]], instances=[[0]])
    result = _answer(workers, workers.start(plans, {"x": chunk}))
    assert program_error(SyntheticModel(SHAPE, seed=1), [result], {"x": chunk}) < 1e-4


def test_a_killed_worker_is_reported_and_a_fresh_one_serves(setup):
    pool, workers = setup
    chunk = tl.Chunk("k", tokens(6, 15 * C), 0)
    plans = pool.gen_plans([[chunk]], instances=[[1]])
    ticket = workers.start(plans, {"k": chunk})
    os.kill(workers.pids[1], signal.SIGKILL)
    try:
        _answer(workers, ticket)
    except PeerFailedError as e:  # the usual case: it died before answering
        assert e.instance_id == 1
    pool.abort(plans)
    deadline = time.monotonic() + HANG_GUARD_S
    while 1 not in workers.failures():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    workers.respawn(1)
    while not workers.ready(1):
        assert time.monotonic() < deadline, "the fresh worker never reported ready"
        workers.wait(0.05)
    assert workers.failures() == []
    small = tl.Chunk("s", tokens(7, 3 * C), 0)
    plans = pool.gen_plans([[small]], instances=[[1]])
    result = _answer(workers, workers.start(plans, {"s": small}))
    assert program_error(SyntheticModel(SHAPE, seed=1), [result], {"s": small}) < 1e-4
