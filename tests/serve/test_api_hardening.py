"""Client input never gets a 5xx and never costs the server more than a bounded, linear
amount: strings that are not valid Unicode, tiny repetition penalties, token ids outside the
vocabulary, more text than ``--max-text-chars`` and more prompts than a request may carry
are each a 400 naming the field; the API key file must be private, and with a key set the
tokenizer endpoints need it while the probes stay open."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import httpx
import pytest

from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.api import generation
from tokenlake.serve.api.auth import load_api_key
from tokenlake.serve.api.http_server import HTTPServer
from tokenlake.serve.api.text import TextStream
from tokenlake.serve.build import build
from tokenlake.serve.config import ServeConfig
from tokenlake.serve.request import TokenEvent

KEY = "hardening-test-key"
PROMPT = {"prompt": [3, 4, 5], "max_tokens": 3}


def refused(r: httpx.Response, param: str, *words: str) -> None:
    """A 400 with the standard error body naming ``param`` (and every one of ``words``)."""
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400, err
    for word in words:
        assert word in err["message"], err["message"]


@pytest.mark.parametrize(
    "path, body_text, param",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud83d"], "max_tokens": 2}', "stop"),
        ("/v1/completions", '{"prompt": "hi", "model": "\\udc00", "max_tokens": 2}', "model"),
        ("/v1/chat/completions",
         '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', "messages"),
        ("/tokenize", '{"prompt": "x\\ud800"}', "prompt"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_a_400_naming_the_field(client, path, body_text, param):
    r = client.post(path, content=body_text, headers={"content-type": "application/json"})
    refused(r, param, "not valid Unicode")
    # a surrogate pair is one valid character
    ok = client.post("/tokenize", content='{"prompt": "\\ud83d\\ude00"}',
                     headers={"content-type": "application/json"})  # fmt: skip
    assert ok.status_code == 200 and ok.json()["count"] > 0


@pytest.mark.parametrize("penalty", [1e-37, 1e-40, 5e-324])
def test_tiny_repetition_penalty_samples(client, penalty):
    body = {**PROMPT, "temperature": 1.0, "seed": 1, "repetition_penalty": penalty,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize("ids", [[-1], [2**70], "vocab"])
def test_stop_token_ids_outside_the_vocabulary_are_refused(server, client, ids):
    vocab = server.served.runtime.engine.model.config.vocab_size
    ids = [vocab] if ids == "vocab" else ids
    r = client.post("/v1/completions", json={**PROMPT, "stop_token_ids": ids})
    refused(r, "stop_token_ids", f"[0, {vocab})")


def test_text_over_the_limit_is_a_400_before_tokenization(server, client):
    limit = server.served.config.max_text_chars
    tokenizer = server.served.tokenizer
    calls = []
    real = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        big = "x" * (limit + 1)
        refused(client.post("/v1/completions", json={"prompt": big}), "prompt", str(limit))
        refused(client.post("/v1/completions", json={"prompt": ["a", big[:-2]], "stop": "yz"}),
                "prompt", str(limit))  # fmt: skip
        chat = {"messages": [{"role": "user", "content": big}]}
        refused(client.post("/v1/chat/completions", json=chat), "messages", "--max-text-chars")
        refused(client.post("/tokenize", json={"prompt": big}), "prompt", str(limit))
    finally:
        del tokenizer.encode
    assert calls == []


def test_prompts_times_samples_are_capped(client):
    r = client.post("/v1/completions", json={"prompt": [[5]] * 50_000, "max_tokens": 1},
                    timeout=60)  # fmt: skip
    refused(r, "prompt", "50000 prompts", "1024")
    r = client.post("/v1/completions", json={"prompt": [[5]] * 600, "n": 2, "max_tokens": 1})
    refused(r, "n", "600 prompts x 2")


def test_events_of_many_choices_take_one_worker_hop(server, monkeypatch):
    """2,000 choices whose 4,000 events arrived together: detokenized in one worker-thread
    hop, not one per token (each hop costs the event loop a round trip)."""
    hops = []
    real = generation.run_in_threadpool

    async def counted(fn, *args):
        hops.append(fn)
        return await real(fn, *args)

    monkeypatch.setattr(generation, "run_in_threadpool", counted)
    tokenizer, n = server.served.tokenizer, 2000
    choices = [generation.Choice(i, f"r{i}", [5], TextStream(tokenizer, [])) for i in range(n)]
    queue = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(TokenEvent(f"r{i}", 70))
    for i in range(n):
        queue.put_nowait(TokenEvent(f"r{i}", 71, "length"))
    state = SimpleNamespace(runtime=SimpleNamespace(cancel=None), tokenizer=tokenizer)

    async def never_disconnected():
        return False

    async def drain():
        request = SimpleNamespace(is_disconnected=never_disconnected)
        return [delta async for _, delta in generation.events(state, choices, queue, request)]

    deltas = asyncio.run(drain())
    assert len(deltas) == 2 * n and len(hops) == 1
    assert all(c.finish_reason == "length" and c.text.token_ids == [70, 71] for c in choices)
    assert all(c.text.text == tokenizer.decode([70, 71]) for c in choices)


def private_key_file(tmp_path, mode: int) -> str:
    path = tmp_path / f"key-{mode:o}"
    path.write_text(KEY + "\n")
    os.chmod(path, mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640, 0o604])
def test_an_api_key_file_others_can_read_is_refused(tmp_path, mode):
    with pytest.raises(InvalidArgumentError, match="mode 0600"):
        load_api_key(private_key_file(tmp_path, mode))
    assert load_api_key(private_key_file(tmp_path, 0o600)) == KEY


@pytest.mark.parametrize("metrics_require_key", [False, True])
def test_with_a_key_tokenizer_endpoints_need_it_and_probes_do_not(tmp_path, metrics_require_key):
    config = ServeConfig(
        num_instances=1, segment_len=8, num_slots=64, chunk_len=32, max_model_len=256,
        profile=False, torch_threads=1, port=0, api_key_file=private_key_file(tmp_path, 0o600),
        metrics_require_key=metrics_require_key,
    )  # fmt: skip
    auth = {"authorization": f"Bearer {KEY}"}
    with (
        HTTPServer(build(config), "127.0.0.1", 0).start() as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
    ):
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]}),
                           ("/v1/completions", PROMPT)):  # fmt: skip
            r = c.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401, path
            assert c.post(path, json=body, headers=auth).status_code == 200, path
        for path in ("/health", "/ping", "/version"):
            assert c.get(path).status_code == 200, path
        assert c.get("/metrics").status_code == (401 if metrics_require_key else 200)
        assert c.get("/metrics", headers=auth).status_code == 200
