"""What one request may cost the server: a body over --max-body-bytes gets a 413 before it
is read whole (declared or chunked), and tokenizing or detokenizing a request never blocks
the event loop, so /health answers while a large prompt is being tokenized."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading

import httpx
import pytest

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


BIG = "tokens " * (300_000)  # ~2 MiB of text: under the body limit, over the context


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
