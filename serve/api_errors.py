"""The API's errors, as vLLM answers them: a JSON body ``{"object": "error", "message",
"type", "param", "code"}`` for a request that failed before its response started, and an
error event then the end of the stream for one that failed while streaming."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tokenlake.errors import InvalidArgumentError


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Answer bad JSON or fields (400, each problem named), :class:`APIError` and the
    control plane's :class:`InvalidArgumentError` (400) with an error body."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        problems = []
        for e in exc.errors():
            if e.get("type") == "json_invalid":
                problems.append(f"body: invalid JSON ({e.get('ctx', {}).get('error', 'syntax')})")
                continue
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            problems.append(f"{where or 'body'}: {e.get('msg')}")
        return error_response(400, "; ".join(problems) or "invalid request", "BadRequestError")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.kind)

    @app.exception_handler(InvalidArgumentError)
    async def _bad_argument(request: Request, exc: InvalidArgumentError):
        return error_response(400, str(exc), "BadRequestError")


async def guarded(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose headers went out cannot change its status: an error becomes an
    error event, then the end of the stream."""
    try:
        async for item in stream:
            yield item
    except APIError as e:
        body = {"object": "error", "message": e.message, "type": e.kind, "code": e.status}
        yield sse({"error": body})
        yield "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
