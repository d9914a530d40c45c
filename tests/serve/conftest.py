"""A tiny-random server on 127.0.0.1 (any free port), shared by the API tests, and the
official ``openai`` client of whichever ``server`` a test module uses."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tokenlake.serve.api.http_server import HTTPServer  # noqa: E402
from tokenlake.serve.build import build  # noqa: E402
from tokenlake.serve.config import ServeConfig  # noqa: E402

CONFIG = ServeConfig(
    num_instances=2, segment_len=8, num_slots=256, chunk_len=32, max_num_seqs=16,
    max_model_len=512, profile=False, torch_threads=1, port=0,
)  # fmt: skip


@pytest.fixture(scope="module")
def server():
    with HTTPServer(build(CONFIG), "127.0.0.1", 0).start() as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c
