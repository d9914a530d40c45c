"""``tokenlake serve --help`` as a user reads it: every endpoint the app serves is listed
(taken from the running app's routes, so the help cannot drift from them), and the dtype
help says what ``auto`` does with an fp16 checkpoint (served in fp32)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")


def test_help_lists_every_endpoint_and_the_fp16_dtype_rule(server):
    from tokenlake.serve.cli import build_parser

    out = build_parser().format_help()  # what --help prints
    app = server._server.config.app
    docs = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # FastAPI's own
    routes = []
    for top in app.routes:  # an included router is one entry holding its routes
        routes += getattr(getattr(top, "original_router", None), "routes", [top])
    paths = {r.path for r in routes if r.path not in docs}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/metrics"} <= paths
    listed = out.split("Endpoints:", 1)[1].split(".\n", 1)[0]
    assert {p.strip() for p in listed.split(",")} == paths
    dtype = " ".join(out.split("\n  --dtype", 1)[1].split("\n  --num-instances", 1)[0].split())
    assert "fp16" in dtype and "fp32" in dtype
