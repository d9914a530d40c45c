"""The API's errors, as vLLM answers them: a JSON body ``{"error": {"message", "type",
"param", "code"}}`` (the shape the ``openai`` client parses; ``param`` names the field at
fault when there is one, ``code`` is the HTTP status) for a request that failed before its
response started (every 4xx and 5xx the app gives, including unknown paths, unparsable
bodies and internal errors), and the same body as an event, then the end of the stream, for
one that failed while streaming."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenlake.errors import InvalidArgumentError

log = logging.getLogger(__name__)

MAX_PROBLEMS = 5  # a body with a million bad items gets a short answer
MAX_SHOWN_CHARS = 200  # of a client's value quoted back in an error message
_KINDS = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowedError",
          413: "RequestTooLargeError", 503: "ServiceUnavailableError"}  # fmt: skip


class APIError(Exception):
    """An answer other than 200: ``status``, a message naming what was wrong, the error's
    ``kind`` (its ``type``) and the request field at fault (``param``), if one is."""

    def __init__(
        self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    message = _encodable(message)  # it may quote a client's lone surrogate
    param = None if param is None else _encodable(param)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode escaped (``\\udc00``)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(
    status: int,
    message: str,
    kind: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    body = error_body(status, message, kind, param)
    return JSONResponse(body, status_code=status, headers=headers)


def shown(value: object) -> str:
    """``value`` as an error message quotes it: cut to a few hundred characters."""
    text = str(value)
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[:MAX_SHOWN_CHARS]}... ({len(text)} characters)"


def validation_message(exc: RequestValidationError) -> str:
    """Each problem of a bad body as ``field: what is wrong`` (the first few)."""
    problems = []
    errors = exc.errors()
    for e in errors[:MAX_PROBLEMS]:
        if e.get("type") == "json_invalid":
            problems.append(f"body: invalid JSON ({e.get('ctx', {}).get('error', 'syntax')})")
            continue
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        problems.append(f"{shown(where or 'body')}: {shown(e.get('msg'))}")
    if len(errors) > MAX_PROBLEMS:
        problems.append(f"and {len(errors) - MAX_PROBLEMS} more problems")
    return "; ".join(problems) or "invalid request"


def _first_field(exc: RequestValidationError) -> str | None:
    """The first bad field's top-level name (``logit_bias`` of ``logit_bias.7``)."""
    for e in exc.errors()[:1]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if loc and e.get("type") != "json_invalid":
            return shown(loc[0])
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Answer bad JSON or fields (400, each problem named), :class:`APIError`, the control
    plane's :class:`InvalidArgumentError` (400), HTTP errors of the framework (404, 405,
    an unparsable body) and anything unexpected (500) with the error body."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(
            400, validation_message(exc), "BadRequestError", param=_first_field(exc)
        )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.kind, param=exc.param)

    @app.exception_handler(InvalidArgumentError)
    async def _bad_argument(request: Request, exc: InvalidArgumentError):
        message = str(exc)  # the control plane's messages start with the argument's name
        head = message.split(":", 1)[0]
        param = head if ":" in message and head.isidentifier() else None
        return error_response(400, message, "BadRequestError", param=param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        message = str(exc.detail)
        if exc.status_code == 400 and exc.__cause__ is not None:
            # the framework could not parse the body: JSON nested deeper than the parser
            # allows, an integer of thousands of digits, bytes that are not UTF-8
            message = f"body: not parsable as JSON ({type(exc.__cause__).__name__})"
        elif exc.status_code in (404, 405):
            message = f"{request.method} {request.url.path}: {exc.detail}"
        kind = _KINDS.get(exc.status_code, "HTTPError")
        return error_response(exc.status_code, message, kind, exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "internal error", "InternalServerError")


async def guarded(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream whose headers went out cannot change its status: an error becomes an
    error event, then the end of the stream."""
    try:
        async for item in stream:
            yield item
    except APIError as e:
        yield sse(error_body(e.status, e.message, e.kind, e.param))
        yield "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
