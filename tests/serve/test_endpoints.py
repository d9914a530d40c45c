"""vLLM's utility endpoints and the API key: ``/tokenize`` and ``/detokenize`` in vLLM's
shapes against the checkpoint's own tokenizer (via ``tokenizers`` and ``transformers``),
``/version``, ``/ping`` (GET and POST); with a key, ``/v1/*`` answers 401 (before reading a
body) unless the ``openai`` client sends it, and other paths stay open."""

from __future__ import annotations

import socket

import httpx
import pytest

from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.api.auth import load_api_key
from tokenlake.serve.api.http_server import HTTPServer
from tokenlake.serve.build import build
from tokenlake.serve.config import ServeConfig

openai = pytest.importorskip("openai")
KEY = "sk-test-4f2a9c"


def test_tokenize_and_detokenize_match_the_tokenizer(server, client):
    import tokenizers
    import transformers

    path = server.served.model_path
    reference = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "The pool holds every segment once."
    want = reference.encode(text).ids
    r = client.post("/tokenize", json={"model": "tiny-random", "prompt": text,
                                       "return_token_strs": True})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == 512
    assert body["token_strs"] == [reference.decode([t], skip_special_tokens=False) for t in want]
    bare = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == reference.encode(text, add_special_tokens=False).ids
    assert bare["token_strs"] is None
    messages = [{"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": messages}).json()
    hf = transformers.AutoTokenizer.from_pretrained(str(path))
    templated = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    templated = templated["input_ids"] if hasattr(templated, "keys") else templated
    assert chat["tokens"] == list(templated)
    back = client.post("/detokenize", json={"model": "tiny-random", "tokens": want})
    # special tokens kept (<s> here), as vLLM's /detokenize keeps them
    assert back.status_code == 200
    assert back.json() == {"prompt": reference.decode(want, skip_special_tokens=False)}
    assert back.json()["prompt"].startswith("<s>")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                       "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, 100000]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)  # fmt: skip
def test_tokenize_refusals_name_the_field(client, path, body, param):
    r = client.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == r.status_code


def test_version_and_ping(client):
    import importlib.metadata

    assert client.get("/version").json() == {"version": importlib.metadata.version("tokenlake")}
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200


def test_load_api_key_from_a_file_only(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n")
    key_file.chmod(0o600)
    assert load_api_key(str(key_file)) == KEY
    assert load_api_key(None) is None
    for path in (str(tmp_path / "missing"), str(tmp_path)):
        with pytest.raises(InvalidArgumentError, match="api_key_file"):
            load_api_key(path)
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "huge").write_text("k" * 5000)
    for name in ("empty", "huge"):
        (tmp_path / name).chmod(0o600)
        with pytest.raises(InvalidArgumentError, match="api_key_file"):
            load_api_key(str(tmp_path / name))


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api_key"
    key_file.write_text(KEY)
    key_file.chmod(0o600)
    config = ServeConfig(num_instances=2, segment_len=8, num_slots=64, chunk_len=32,
                         max_model_len=256, profile=False, torch_threads=1, port=0,
                         api_key_file=str(key_file))  # fmt: skip
    with HTTPServer(build(config), "127.0.0.1", 0).start() as srv:
        yield srv


def test_api_key_is_required_on_v1(keyed_server):
    url = keyed_server.url
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as good:
        r = good.completions.create(model="tiny-random", prompt=[3, 4, 5], max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert good.models.list().data[0].id == "tiny-random"
    for wrong in ("sk-wrong", KEY + "x", KEY[:-1]):
        with openai.OpenAI(base_url=f"{url}/v1", api_key=wrong, max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError) as e:
                bad.models.list()
            assert e.value.status_code == 401
    with httpx.Client(base_url=url, timeout=30) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": KEY}).status_code == 401
        for path in ("/health", "/ping", "/version", "/metrics"):
            assert c.get(path).status_code == 200, path
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.post("/tokenize", json={"prompt": "x"}, headers=auth).status_code == 200


def test_unauthenticated_body_is_never_read(keyed_server):
    """A declared 1 MB body that never comes: the 401 answers from the headers alone."""
    request = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", keyed_server.port), timeout=10) as s:
        s.sendall(request.encode())
        answer = b""
        for _ in range(64):  # headers and body may come in separate reads; the server closes
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
        answer = answer.decode("latin-1")
    assert answer.startswith("HTTP/1.1 401"), answer[:200]
    assert "AuthenticationError" in answer
