"""Streams cancelled mid-way on a server that then stays idle: their pins are released and
the pool's ``running requests`` snapshot (what ``/metrics`` serves) returns to 0 within a
bounded wait, with no further request to refresh it."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from tokenlake.serve.build import build  # noqa: E402
from tokenlake.serve.config import ServeConfig  # noqa: E402
from tokenlake.serve.metrics.collector import server_registry  # noqa: E402
from tokenlake.serve.request import GenerationRequest  # noqa: E402

NUM_STREAMS = 6
CANCEL_AFTER = 2  # tokens a stream receives before its client goes away
GAUGE = "tokenlake:pool_running_requests"
WAIT_BOUND_S = 10.0  # generous: the snapshot follows the cancel within one loop pass


def gauge(registry, name: str) -> float:
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not exported")


def wait_for(predicate, bound_s: float, what: str) -> None:
    deadline = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {bound_s} s"
        time.sleep(0.05)


def test_cancelled_streams_release_pins_and_the_gauge_follows_while_idle():
    served = build(ServeConfig(num_instances=2, segment_len=8, num_slots=128, chunk_len=16,
                               max_model_len=256, profile=False, torch_threads=1))  # fmt: skip
    rt = served.runtime
    registry = server_registry(rt, "tiny-random")
    lock, done = threading.Lock(), threading.Event()
    received = {f"s{i}": 0 for i in range(NUM_STREAMS)}
    ends: dict[str, str] = {}

    def sink(event):  # on the runtime thread, like the server's; cancel as a client leaves
        with lock:
            if event.token_id is not None:
                received[event.request_id] += 1
                if received[event.request_id] == CANCEL_AFTER:
                    rt.cancel(event.request_id)
            if event.finish_reason:
                ends[event.request_id] = event.finish_reason
                if len(ends) == NUM_STREAMS:
                    done.set()

    try:
        for i in range(NUM_STREAMS):
            prompt = tuple(range(3 + i, 20 + 9 * i))
            rt.submit(GenerationRequest(f"s{i}", prompt, 150, ignore_eos=True), sink)
        assert done.wait(60)
        assert set(ends.values()) == {"abort"}, ends
        assert all(CANCEL_AFTER <= n < 150 for n in received.values()), received
        assert rt.counters["finished_abort"] == NUM_STREAMS
        # no further request: the snapshot and the gauge must catch up on their own
        wait_for(lambda: rt.stats.pool_stats["num_running_requests"] == 0, WAIT_BOUND_S, "snapshot")
        assert gauge(registry, GAUGE) == 0
        wait_for(lambda: not rt.scheduler.has_work, WAIT_BOUND_S, "scheduler idle")
        pool = rt.scheduler.pool
        assert not pool.requests and rt.num_running == 0
        pool.check_invariants()  # read-only while the runtime idles
    finally:
        rt.close()
