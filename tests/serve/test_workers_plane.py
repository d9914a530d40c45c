"""``--data-plane workers``: a worker process per instance with its own step loop, the server
planning asynchronous iterations as instances free up. The greedy tokens are those of the
in-process plane, also where an origin reads segments another instance holds (in place, from
shared memory); a request cancelled while in flight ends and the server goes on; an idle
worker killed is failed over and rejoins. (kill -9 of a worker under load, over HTTP:
``test_failover_http.py``.)"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from test_serve_runtime import run_requests

from tokenlake.serve.async_runtime import AsyncRuntime
from tokenlake.serve.build import build
from tokenlake.serve.config import ServeConfig
from tokenlake.serve.request import GenerationRequest

HANG_GUARD_S = 120.0  # a guard against a hang only
DOC = tuple((5 * j) % 250 + 3 for j in range(40))  # shared by every prompt: read across instances


def _requests():
    return [
        GenerationRequest(f"r{i}", DOC + tuple(range(1 + i, 9 + 3 * i)), 6, ignore_eos=True)
        for i in range(6)
    ]


def _serve(plane: str):
    return build(
        ServeConfig(
            num_instances=2,
            segment_len=8,
            num_slots=64,
            chunk_len=16,
            max_model_len=256,
            data_plane=plane,
            profile=False,
            torch_threads=1,
        )  # fmt: skip
    )


@pytest.fixture(scope="module")
def workers():
    served = _serve("workers")
    yield served
    served.runtime.close()


def test_workers_give_the_in_process_tokens(workers):
    local = _serve("local")
    try:
        first = run_requests(local.runtime, _requests()[:1])  # caches the document
        expected = run_requests(local.runtime, _requests()[1:])
    finally:
        local.runtime.close()
    runtime = workers.runtime
    assert isinstance(runtime, AsyncRuntime) and not runtime.scheduler.config.sync_iterations
    assert run_requests(runtime, _requests()[:1]) == first
    assert run_requests(runtime, _requests()[1:]) == expected
    stats = runtime.scheduler.pool.get_stats()
    assert stats["query_bytes"] > 0  # prefix parts held by the other instance were read
    assert stats["num_hit_tokens"] > 0 and stats["num_running_requests"] == 0
    assert runtime.counters["iterations"] > 0 and runtime.engine.workers.failures() == []


def test_a_request_cancelled_in_flight_ends_and_the_server_goes_on(workers):
    runtime = workers.runtime
    ended, events = threading.Event(), []

    def sink(event):
        events.append(event)
        if event.token_id is not None and len(events) == 1:
            runtime.cancel("long")  # while its next decode steps are planned or running
        if event.finish_reason:
            ended.set()

    runtime.submit(GenerationRequest("long", DOC, 200, ignore_eos=True), sink)
    assert ended.wait(120)
    assert events[-1].finish_reason == "abort" and len(events) < 200
    assert run_requests(runtime, _requests()[:2])  # still serving
    assert runtime.scheduler.pool.get_stats()["num_running_requests"] == 0


def test_an_idle_worker_killed_is_failed_over_and_rejoins(workers):
    runtime = workers.runtime
    pool = runtime.scheduler.pool
    before = run_requests(runtime, _requests()[:3])
    failures = runtime.counters["instance_failures"]
    os.kill(runtime.engine.workers.pids[1], signal.SIGKILL)  # nothing in flight
    deadline = time.monotonic() + HANG_GUARD_S
    while runtime.counters["instance_failures"] == failures or 1 not in pool.live_instances:
        assert time.monotonic() < deadline, "the death was not seen, or it never rejoined"
        time.sleep(0.02)
    assert runtime.counters["instances_rejoined"] >= 1
    assert run_requests(runtime, _requests()[:3]) == before  # greedy: the same tokens
