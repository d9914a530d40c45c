"""An HTTP fuzz over every endpoint and field: wrong types, out-of-range and extreme numbers,
huge strings and batches, escaped lone surrogates, deep nesting, unknown fields, bad content
types and methods. Every answer is a 2xx or a 4xx with the standard error body, never a
5xx; afterwards nothing is left running, the pool's invariants hold and a good request gets
the same tokens as before the fuzz."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

COMPLETION = {"prompt": [3, 4, 5], "max_tokens": 2, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
SAMPLING_FIELDS = [
    "model", "temperature", "top_p", "top_k", "seed", "n", "stop", "stop_token_ids",
    "ignore_eos", "stream", "stream_options", "return_token_ids", "user", "best_of",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
    "response_format",
]  # fmt: skip
FIELDS = {
    "/v1/completions": (COMPLETION, [*SAMPLING_FIELDS, "prompt", "max_tokens", "echo",
                                     "logprobs", "suffix", "unknown_field"]),
    "/v1/chat/completions": (CHAT, [*SAMPLING_FIELDS, "messages", "max_tokens",
                                    "max_completion_tokens", "add_generation_prompt",
                                    "logprobs", "top_logprobs", "tools", "tool_choice",
                                    "unknown_field"]),
}  # fmt: skip


def nested_list(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def nested_object(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


# JSON texts of hostile values (text, so NaN, Infinity and 5000-digit ints can be sent)
VALUES = [
    "null", "true", "false", "-1", "1", "2.5", "1e308", "-1e-40", "NaN", str(2**64),
    str(-(2**70)), "1" + "0" * 5000, '""', '"x"', json.dumps("\u0000\ud7ff" * 10),
    json.dumps("y" * 200_000), "[]", "[[]]", "[true]", "[-1]", '["a", 1]', "{}",
    '{"include_usage": "no"}', '[{"role": "user", "content": [{"type": "image", "text": "x"}]}]',
    '[{"role": 5, "content": null}]', nested_list(5000), nested_object(5000),
    # escaped lone surrogates (valid JSON, not valid Unicode), in strings, lists and keys
    '"\\ud800"', '["ok", "a\\udc00b"]', '{"\\udfff": 1}',
    '[{"role": "user", "content": "\\ud83d"}]',
    # extreme floats
    "5e-324", "-5e-324", "1e-40", "1.7976931348623157e308", "-1.7976931348623157e308",
    # huge batches: 50,000 prompts, 200,000 token ids
    "[" + ", ".join(["[1]"] * 50_000) + "]", "[" + ", ".join(["7"] * 200_000) + "]",
]  # fmt: skip
NUM_CLIENTS = 4  # concurrent fuzzing connections: the server sees overlapping requests too


def splice(base: dict, field: str, value_text: str) -> str:
    """``base`` as JSON text with ``field`` set to the raw JSON ``value_text``."""
    rest = json.dumps({k: v for k, v in base.items() if k != field})
    return rest[:-1] + (", " if len(rest) > 2 else "") + f'"{field}": {value_text}' + "}"


def check_answer(r: httpx.Response, what: str) -> None:
    assert r.status_code < 500, f"{what}: {r.status_code} {r.text[:300]}"
    if r.status_code >= 400:
        assert set(r.json()) == {"error"}, what
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, what
        assert err["code"] == r.status_code, what
        assert isinstance(err["message"], str) and err["message"], what
        assert len(err["message"]) < 4000, f"{what}: the error echoes the input"
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", what
        for line in lines[:-1]:
            assert "error" not in json.loads(line[6:]), f"{what}: {line[:300]}"
    elif "completions" in what:
        assert "choices" in r.json(), what  # a 2xx here is a served completion
    else:  # /health, /v1/models (JSON) or /metrics (Prometheus text)
        assert r.headers["content-type"].startswith(("application/json", "text/plain")), what


def post(client: httpx.Client, path: str, content: bytes | str, content_type: str | None):
    headers = {"content-type": content_type} if content_type else {}
    return client.post(path, content=content, headers=headers)


def wait_idle(runtime, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while runtime.num_running or runtime.num_waiting or runtime.scheduler.pool.requests:
        assert time.monotonic() < deadline, "requests still running after the fuzz"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(client_module):
    r = client_module.post("/v1/completions", json={**COMPLETION, "max_tokens": 6,
                                                    "return_token_ids": True})  # fmt: skip
    assert r.status_code == 200
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def client_module(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_fuzz_every_field(server, client_module, reference, path):
    base, fields = FIELDS[path]
    cases = [(field, value) for field in fields for value in VALUES]

    def one(case):
        field, value = case
        r = post(client_module, path, splice(base, field, value), "application/json")
        check_answer(r, f"{path} {field}={value[:40]}")

    with concurrent.futures.ThreadPoolExecutor(NUM_CLIENTS) as pool:
        list(pool.map(one, cases))
    assert client_module.get("/health").status_code == 200


RAW_BODIES = [
    b"", b"null", b"[]", b"1", b'"s"', b"{", b"\xff\xfe\x00", b'{"prompt": "\xff"}',
    nested_list(10_000).encode(), nested_object(10_000).encode(),
    b'{"prompt": "' + b"z" * (1 << 20) + b'", "max_tokens": 2}',
    json.dumps({**COMPLETION, **{f"k{i}": i for i in range(20_000)}}).encode(),
]  # fmt: skip
CONTENT_TYPES = [
    "application/json", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=xyz", "application/json; charset=latin-1",
    "application/vnd.api+json", None,
]  # fmt: skip


def test_fuzz_bodies_content_types_and_methods(server, client_module, reference):
    cases = [
        (path, body, content_type)
        for path in ("/v1/completions", "/v1/chat/completions")
        for body in RAW_BODIES
        for content_type in CONTENT_TYPES
    ]

    def one(case):
        path, body, content_type = case
        check_answer(
            post(client_module, path, body, content_type), f"{path} {content_type} {body[:40]!r}"
        )

    with concurrent.futures.ThreadPoolExecutor(NUM_CLIENTS) as pool:
        list(pool.map(one, cases))
    for path in ("/v1/completions", "/v1/chat/completions"):
        good = json.dumps(FIELDS[path][0]).encode()
        for content_type in CONTENT_TYPES[1:4]:  # a good body under a wrong type is refused
            r = post(client_module, path, good, content_type)
            assert r.status_code == 400, f"{path} {content_type}: {r.status_code}"
            check_answer(r, f"{path} {content_type}")
    for method in ("GET", "PUT", "DELETE", "PATCH"):
        for path in ("/health", "/v1/models", "/metrics", "/v1/completions", "/nope", "/v1"):
            r = client_module.request(method, path, content=b'{"prompt": "hi"}')
            check_answer(r, f"{method} {path}")
    for path in ("/health", "/v1/models", "/metrics"):
        r = client_module.get(path, params={"x": "y" * 2000})
        assert r.status_code == 200, path


def test_server_serves_after_the_fuzz(server, client_module, reference):
    runtime = server.served.runtime
    wait_idle(runtime)
    assert runtime.alive
    assert runtime.scheduler.pool.get_stats()["num_running_requests"] == 0
    runtime.scheduler.pool.check_invariants()
    r = client_module.post("/v1/completions", json={**COMPLETION, "max_tokens": 6,
                                                    "return_token_ids": True})  # fmt: skip
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference
    assert client_module.get("/health").json() == {}
