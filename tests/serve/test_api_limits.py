"""What one request may cost the server: a body over --max-body-bytes gets a 413 before it
is read whole (declared or chunked), and tokenizing or detokenizing a request never blocks
the event loop, so /health answers while a large prompt is being tokenized (held by a stub,
and an 8 MiB one by the real tokenizer)."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import statistics
import threading
import time

import httpx
import pytest

from tokenlake.serve.api.http_server import HTTPServer
from tokenlake.serve.build import build
from tokenlake.serve.config import ServeConfig

RELEASE_TIMEOUT_S = 60  # a hang guard only: the test orders events, it does not time them


def raw_exchange(server, head: str, parts: list[bytes]) -> tuple[int, dict]:
    """Send ``head`` and ``parts`` on one connection; the status and JSON body of the
    answer (read until the server closes the connection)."""
    with socket.create_connection((server.host, server.port), timeout=60) as s:
        s.sendall(head.encode("latin-1"))
        for part in parts:
            s.sendall(part)
        data = b""
        for _ in range(10_000):  # the answer is small; the server closes after it
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    _, _, body = rest.partition(b"\r\n\r\n")
    return int(status_line.split()[1]), json.loads(body)["error"]


def head(extra: str) -> str:
    return f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}\r\n"


def test_declared_oversize_body_is_refused_before_it_is_sent(server, client):
    limit = server.served.config.max_body_bytes
    requests = server.served.runtime.counters["requests"]
    # the body is never sent: the answer comes from the header alone
    status, err = raw_exchange(server, head(f"Content-Length: {limit + 1}\r\n"), [])
    assert status == 413
    assert err["code"] == 413
    assert f"{limit + 1} bytes exceeds the server's limit of {limit} bytes" in err["message"]
    status, err = raw_exchange(server, head(f"Content-Length: {'9' * 18}\r\n"), [])
    assert status == 413 and err["code"] == 413
    assert server.served.runtime.counters["requests"] == requests
    assert client.get("/health").status_code == 200


def test_chunked_oversize_body_is_refused_once_past_the_limit(server, client):
    limit = server.served.config.max_body_bytes
    piece = 1 << 20
    parts, sent = [], 0
    while sent <= limit:  # one byte past the limit in all, the last chunk left unfinished
        n = min(piece, limit + 1 - sent)
        chunk = b'{"prompt": "' + b"x" * (n - 12) if sent == 0 else b"x" * n
        parts.append(f"{piece if n == piece else n:x}\r\n".encode() + chunk
                     + (b"\r\n" if sent + n <= limit else b""))  # fmt: skip
        sent += n
    status, err = raw_exchange(server, head("Transfer-Encoding: chunked\r\n"), parts)
    assert status == 413
    assert f"more than {limit} bytes exceeds" in err["message"]
    assert client.get("/health").status_code == 200


def test_body_within_the_limit_is_served(client):
    # a large body (mostly an ignored field) under the limit reaches the handler whole
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "user": "u" * (1 << 20)}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text[:200]
    assert r.json()["usage"]["prompt_tokens"] == 3


def blocking(monkeypatch, obj, name: str) -> tuple[threading.Event, threading.Event]:
    """Make ``obj.name`` block (after signalling ``entered``) until ``release`` is set."""
    entered, release = threading.Event(), threading.Event()
    real = getattr(obj, name)

    def held(*args, **kwargs):
        entered.set()
        release.wait(RELEASE_TIMEOUT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, held)
    return entered, release


BIG = "tokens " * 100_000  # 700k characters: under --max-text-chars, over the context


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("encode", "/v1/completions", {"prompt": BIG, "max_tokens": 4}, 400),
        ("encode", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": BIG}], "max_tokens": 4}, 400),
        ("decode", "/v1/completions", {"prompt": "Hello", "max_tokens": 2}, 200),
    ],
)  # fmt: skip
def test_health_answers_while_a_request_is_tokenized(
    server, client, monkeypatch, method, path, body, status
):
    """The held (de)tokenizer stands for a slow one: on the event loop it would hold
    /health too, which then could not answer before the request is released."""
    entered, release = blocking(monkeypatch, server.served.tokenizer, method)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, path, json=body)
        try:
            assert entered.wait(RELEASE_TIMEOUT_S)
            health = httpx.get(f"{server.url}/health", timeout=RELEASE_TIMEOUT_S / 2)
            still_pending = not pending.done()
        finally:
            release.set()
        r = pending.result()
    assert health.status_code == 200 and health.json() == {}
    assert still_pending  # /health answered while the request was being (de)tokenized
    assert r.status_code == status, r.text[:300]
    if status == 400:
        assert "maximum context length" in r.json()["error"]["message"]


EIGHT_MIB = 8 << 20
LIVENESS_S = 1.0  # what a /health probe may take while the prompt is tokenized (median)


@pytest.fixture(scope="module")
def big_server():
    config = ServeConfig(
        num_instances=1, segment_len=8, num_slots=64, chunk_len=32, max_model_len=256,
        profile=False, torch_threads=1, port=0, max_body_bytes=2 * EIGHT_MIB,
        max_text_chars=2 * EIGHT_MIB,
    )  # fmt: skip
    with HTTPServer(build(config), "127.0.0.1", 0).start() as srv:
        yield srv


def test_health_answers_while_the_real_tokenizer_reads_8_mib(big_server, monkeypatch):
    """The real tokenizer on an 8 MiB prompt (seconds of work): /health probes sent from
    this process keep being answered while it runs. A tokenizer holding the GIL would let
    none through until it finished, whatever the machine's load."""
    tokenizer = big_server.served.tokenizer
    spans = []
    real = tokenizer.encode

    def timed(*args, **kwargs):
        start = time.monotonic()
        try:
            return real(*args, **kwargs)
        finally:
            spans.append((start, time.monotonic()))

    monkeypatch.setattr(tokenizer, "encode", timed)
    probes, stop = [], threading.Event()

    def probe():
        with httpx.Client(base_url=big_server.url, timeout=RELEASE_TIMEOUT_S) as c:
            while not stop.is_set():
                sent = time.monotonic()
                status = c.get("/health").status_code
                probes.append((sent, time.monotonic(), status))
                time.sleep(0.1)  # a probe every ~0.1 s: enough, and light

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    text = "tokens and words " * (EIGHT_MIB // 17)
    try:
        with httpx.Client(base_url=big_server.url, timeout=RELEASE_TIMEOUT_S * 5) as c:
            r = c.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    finally:
        stop.set()
        prober.join()
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    ((start, end),) = spans
    during = [(b - a, status) for a, b, status in probes if a >= start and b <= end]
    print(f"\n8 MiB tokenized in {end - start:.2f} s; {len(during)} /health probes answered "
          f"meanwhile, slowest {max((d for d, _ in during), default=0):.3f} s")  # fmt: skip
    assert len(during) >= 3 and all(status == 200 for _, status in during)
    assert statistics.median(d for d, _ in during) < LIVENESS_S


def test_connections_are_bounded_by_uvicorn_settings():
    """--limit-concurrency is uvicorn's limit_concurrency: with every allowed connection
    held by a client that never finishes its headers, a request gets uvicorn's 503 (not an
    unbounded pile of connections); once they go, it is served. An idle keep-alive
    connection is closed after --timeout-keep-alive."""
    config = ServeConfig(
        num_instances=1, segment_len=8, num_slots=64, chunk_len=32, max_model_len=256,
        profile=False, torch_threads=1, port=0, limit_concurrency=4, timeout_keep_alive=1,
    )  # fmt: skip
    with HTTPServer(build(config), "127.0.0.1", 0).start() as srv:
        address = (srv.host, srv.port)
        held = [socket.create_connection(address, timeout=60) for _ in range(4)]
        try:
            for s in held:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            deadline = time.monotonic() + RELEASE_TIMEOUT_S
            while httpx.get(f"{srv.url}/health", timeout=60).status_code != 503:
                assert time.monotonic() < deadline, "no connection limit"
                time.sleep(0.05)
        finally:
            for s in held:
                s.close()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            deadline = time.monotonic() + RELEASE_TIMEOUT_S
            while (status := c.get("/health").status_code) != 200:
                assert status == 503 and time.monotonic() < deadline
                time.sleep(0.05)
        with socket.create_connection(address, timeout=RELEASE_TIMEOUT_S) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while chunk := s.recv(65536):  # the server closes the idle connection
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
