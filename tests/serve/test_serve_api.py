"""The OpenAI-compatible API over real HTTP on loopback: outputs equal transformers' greedy
tokens, streaming equals non-streaming, concurrent clients, cancellation releases pins, bad
input gets a 400/404 naming the problem and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
import torch

SEED_RANGE = (
    "seed: Value error, expected a signed 64-bit int in [-9223372036854775808, 9223372036854775807]"
)


def complete(client, prompt, max_tokens=8, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    r = client.post("/v1/completions", json={**body, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def stream_lines(client, path, body):
    events = []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_greedy_tokens_equal_transformers(server, client):
    import transformers

    path = str(server.served.model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    for prompt in ["The pool holds every segment once.", "The pool holds every prefix"]:
        out = complete(client, prompt, max_tokens=10, ignore_eos=True)
        ids = out["choices"][0]["prompt_token_ids"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None, min_new_tokens=10)  # fmt: skip
        assert out["choices"][0]["token_ids"] == ref[0, len(ids) :].tolist()
        assert out["usage"]["completion_tokens"] == 10
    # the second prompt shares the first's prefix: the pool served part of it
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 8


def test_streaming_equals_non_streaming(client):
    body = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = complete(client, body["prompt"], 12, ignore_eos=True)["choices"][0]
    chunks = stream_lines(
        client, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
    )
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"

    messages = [{"role": "user", "content": "Hi there"}]
    chat = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["role"] == "assistant"
    parts = stream_lines(client, "/v1/chat/completions", chat)
    assert parts[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in parts) == message["content"]
    assert parts[-1]["object"] == "chat.completion.chunk"


def test_concurrent_clients_get_their_own_answers(server, client):
    prompts = [[1 + i, 50, 60, 70 + i] + list(range(80, 80 + 2 * i)) for i in range(10)]
    expected = [complete(client, p, 6, ignore_eos=True)["choices"][0]["token_ids"] for p in prompts]

    def one(i):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            if i % 2:
                body = {"prompt": prompts[i], "max_tokens": 6, "temperature": 0,
                        "ignore_eos": True, "return_token_ids": True}  # fmt: skip
                return [
                    t
                    for ch in stream_lines(c, "/v1/completions", body)
                    for t in ch["choices"][0]["token_ids"]
                ]
            return complete(c, prompts[i], 6, ignore_eos=True)["choices"][0]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        got = list(pool.map(one, range(10)))
    assert got == expected


def wait_idle(server, timeout_s=20.0):
    runtime = server.served.runtime
    deadline = time.monotonic() + timeout_s
    while runtime.num_running or runtime.num_waiting or runtime.scheduler.pool.requests:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def test_disconnected_stream_releases_its_pins(server):
    runtime = server.served.runtime
    aborted = runtime.counters["finished_abort"]
    body = {"prompt": "a long answer please", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        for n, _ in enumerate(r.iter_lines()):
            if n > 4:
                break  # the client goes away mid-stream
    wait_idle(server)
    assert runtime.counters["finished_abort"] == aborted + 1
    assert runtime.scheduler.pool.get_stats()["num_running_requests"] == 0
    runtime.scheduler.pool.check_invariants()


def test_non_streaming_client_timeout_cancels(server):
    runtime = server.served.runtime
    aborted = runtime.counters["finished_abort"]
    body = {"prompt": "x" * 50, "max_tokens": 450, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=0.3) as c, pytest.raises(httpx.TimeoutException):
        c.post("/v1/completions", json=body)
    wait_idle(server)
    assert runtime.counters["finished_abort"] == aborted + 1


@pytest.mark.parametrize(
    "body, status, words",
    [
        ('{"prompt": "hi", "max_tokens": ', 400, "invalid JSON"),
        ('{"max_tokens": 3}', 400, "prompt"),
        ('{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
        ('{"prompt": "hi", "temperature": -1}', 400, "temperature"),
        ('{"prompt": "hi", "n": 2, "best_of": 1}', 400, "best_of: expected >= n=2"),
        ('{"prompt": [1, 2, 100000]}', 400, "token ids"),
        ('{"prompt": "hi", "max_tokens": 600}', 400, "maximum context length is 512"),
        ('{"prompt": "hi", "model": "gpt-4"}', 404, "does not exist"),
        ("[1, 2]", 400, "body"),
        ('{"prompt": ""}', 400, "prompt: Value error, expected a non-empty prompt"),
        ('{"prompt": []}', 400, "prompt: Value error, expected a non-empty prompt"),
        ('{"prompt": ["a", ""]}', 400, "every prompt of the batch to be non-empty"),
        ('{"prompt": [[1], []]}', 400, "every prompt of the batch to be non-empty"),
        ('{"prompt": [true, 2]}', 400, "prompt"),
        ('{"prompt": [[5, false]]}', 400, "prompt"),
        ('{"prompt": "hi", "stop_token_ids": [true]}', 400, "stop_token_ids.0"),
        ('{"prompt": "hi", "max_tokens": true}', 400, "max_tokens"),
        ('{"prompt": "hi", "temperature": true}', 400, "temperature"),
        ('{"prompt": "hi", "seed": 18446744073709551616}', 400, SEED_RANGE),
        ('{"prompt": "hi", "seed": -1180591620717411303424}', 400, SEED_RANGE),
        ('{"prompt": "hi", "seed": 1.5}', 400, "seed"),
        ('{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", 400, "body: not parsable"),
        ("[" * 10_000 + "]" * 10_000, 400, "body: not parsable as JSON"),
        ('{"prompt": ' + "[" * 10_000 + "]" * 10_000 + "}", 400, "body: not parsable"),
        ('{"prompt": ' + "[" * 300 + "1" + "]" * 300 + "}", 400, "prompt"),
    ],
)
def test_bad_requests_get_clear_errors(server, client, body, status, words):
    requests = server.served.runtime.counters["requests"]
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err == {"message": err["message"], "type": err["type"], "param": err["param"],
                   "code": status}  # fmt: skip
    assert words in err["message"]
    assert len(err["message"]) < 2000  # the problems are named, not the whole input echoed
    assert server.served.runtime.counters["requests"] == requests  # nothing was submitted
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1, 0])
def test_seed_range_edges_are_served(client, seed):
    body = {"prompt": [3, 4, 5], "max_tokens": 3, "temperature": 1.0, "seed": seed}
    first = complete(client, **body)["choices"][0]["token_ids"]
    assert complete(client, **body)["choices"][0]["token_ids"] == first  # seeded: repeatable


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", "/no/such/path", 404), ("GET", "/v1/completions", 405), ("DELETE", "/health", 405)],
)
def test_framework_errors_use_the_error_body(client, method, path, status):
    r = client.request(method, path)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and path in err["message"]


def test_overlong_chat_and_empty_messages(client):
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    long = [{"role": "user", "content": "y" * 600}]
    r = client.post("/v1/chat/completions", json={"messages": long, "max_tokens": 4})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


def test_stop_token_ids_and_stop_strings(client):
    full = complete(client, [3, 4, 5], 8, ignore_eos=True)["choices"][0]
    stop_at = full["token_ids"][2]
    first = full["token_ids"].index(stop_at)
    out = complete(client, [3, 4, 5], 8, stop_token_ids=[stop_at])["choices"][0]
    assert out["finish_reason"] == "stop" and out["token_ids"] == full["token_ids"][: first + 1]
    text = complete(client, "stop me", 12, ignore_eos=True)["choices"][0]["text"]
    if len(text) >= 3:
        needle = text[1:3]
        cut = complete(client, "stop me", 12, ignore_eos=True, stop=[needle])["choices"][0]
        assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(needle)]


def test_health_models_and_metrics(client):
    assert client.get("/health").json() == {}
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny-random"
    assert models["data"][0]["max_model_len"] == 512
    text = client.get("/metrics").text
    assert (
        "# TYPE tokenlake:requests_total counter" in text
        or "# TYPE tokenlake:requests counter" in text
    )
    assert "tokenlake:pool_hit_rate " in text
    assert 'tokenlake:pool_instance_load_tokens_total{tl_instance="1"}' in text
