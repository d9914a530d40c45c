"""The OpenAI-compatible HTTP API (FastAPI): ``/v1/completions``, ``/v1/chat/completions``
(both with ``stream``), ``/v1/models``, ``/health``, ``/ping``, ``/version``, ``/tokenize``,
``/detokenize``, ``/metrics``; ``/v1/*`` behind an API key when one is set.

Errors follow vLLM: a JSON body ``{"error": {"message", "type", "param", "code"}}``;
bad JSON, a bad field or an over-long prompt is a 400 naming what was wrong, an unknown
model a 404, a body over ``--max-body-bytes`` a 413. A client that disconnects has its
requests cancelled (their pins released). The endpoints are in ``api_routes``; tokenizing
and detokenizing run on worker threads, so a large prompt never blocks ``/health``.
"""

from __future__ import annotations

from fastapi import FastAPI

from tokenlake.serve.api.auth import APIKeyAuth, load_api_key
from tokenlake.serve.api.chat import router as chat_router
from tokenlake.serve.api.errors import install_error_handlers
from tokenlake.serve.api.limits import BodyLimit
from tokenlake.serve.api.routes import router
from tokenlake.serve.api.state import APIState
from tokenlake.serve.api.tools.structured import Grammars
from tokenlake.serve.build import Served
from tokenlake.serve.metrics import collector as metrics


def create_app(served: Served) -> FastAPI:
    """The app serving ``served`` (its runtime must be running)."""
    app = FastAPI(title="TokenLake", version="0.1.0")
    runtime, name = served.runtime, served.config.model_name
    grammars = None
    if served.tokenizer is not None:
        vocab_size = runtime.engine.model.config.vocab_size
        grammars = Grammars(served.tokenizer, vocab_size, sorted(runtime.eos_token_ids))
    app.state.api = APIState(
        runtime, served.tokenizer, name, served.model_path,
        metrics.server_registry(runtime, name), grammars, served.config.auto_tool_parser,
        served.config.max_text_chars,
    )  # fmt: skip
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_body_bytes=served.config.max_body_bytes)
    api_key = load_api_key(served.config.api_key_file)
    if api_key is not None:  # added last: it runs first, before any body is read
        app.add_middleware(
            APIKeyAuth, api_key=api_key, protect_metrics=served.config.metrics_require_key
        )
    app.include_router(router)
    app.include_router(chat_router)
    return app


def endpoints() -> list[str]:
    """Every path the app serves (for ``--help``)."""
    return [route.path for r in (router, chat_router) for route in r.routes]
