"""The runtime's hardening seen over HTTP (the shared tiny-random server of conftest.py): a
temperature below float32's range answers with tokens and the server stays healthy; clients
that disconnect mid-stream have their pins released and ``/metrics`` shows it with no
further request."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("prometheus_client")
httpx = pytest.importorskip("httpx")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

NUM_STREAMS = 8
CHUNKS_BEFORE_LEAVING = 3
WAIT_BOUND_S = 15.0  # disconnects are noticed within the API's poll period, then one pass


def metric(client, name: str, **labels: str) -> float:
    text = client.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise AssertionError(f"{name} not exported")


def test_tiny_temperature_answers_and_the_server_stays_healthy(client):
    """The request that used to leave every later request a 500 and /health a 503.
    Reference: the same prompt at temperature 0."""
    body = {"prompt": "hi", "temperature": 1e-40, "max_tokens": 4, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    got = resp.json()["choices"][0]
    greedy = client.post("/v1/completions", json={**body, "temperature": 0})
    assert greedy.status_code == 200, greedy.text
    assert len(got["token_ids"]) == 4
    assert got["token_ids"] == greedy.json()["choices"][0]["token_ids"]
    assert client.get("/health").status_code == 200
    follow = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
    assert follow.status_code == 200, follow.text


def leave_mid_stream(url: str, i: int, chunks_read: list[int]) -> None:
    """Open a long stream, read a few events, then drop the connection."""
    body = {"prompt": list(range(10 + i, 30 + 5 * i)), "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    with (
        httpx.Client(base_url=url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunks_read[i] += 1
                if chunks_read[i] == CHUNKS_BEFORE_LEAVING:
                    break


def test_disconnected_streams_release_pins_and_the_gauge_follows(server, client):
    model = {"model_name": "tiny-random", "finished_reason": "abort"}
    aborts_before = metric(client, "tokenlake:request_success_total", **model)
    chunks_read = [0] * NUM_STREAMS
    threads = [
        threading.Thread(target=leave_mid_stream, args=(server.url, i, chunks_read))
        for i in range(NUM_STREAMS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert chunks_read == [CHUNKS_BEFORE_LEAVING] * NUM_STREAMS
    runtime = server.served.runtime
    deadline = time.monotonic() + WAIT_BOUND_S
    while True:  # no further request: the snapshot must catch up on its own
        running = metric(client, "tokenlake:pool_running_requests")
        aborts = metric(client, "tokenlake:request_success_total", **model) - aborts_before
        if running == 0 and runtime.num_running == 0 and runtime.num_waiting == 0:
            break
        assert time.monotonic() < deadline, (running, aborts, runtime.num_running)
        time.sleep(0.1)
    assert aborts == NUM_STREAMS, "some streams finished before their clients left"
    pool = runtime.scheduler.pool
    assert not pool.requests
    pool.check_invariants()  # read-only while the runtime idles
