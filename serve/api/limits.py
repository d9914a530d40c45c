"""A bound on what one HTTP request may make the server hold: a body over the limit is
answered 413 (the standard error body) before it is read whole. A declared
``Content-Length`` over the limit is refused before any of the body is read; a chunked body
is counted as it arrives and refused as soon as it passes the limit.

Once parsed, a body's text is checked before anything reads it (:func:`check_text`): every
string must be encodable as UTF-8 (JSON's ``"\\ud800"`` escape decodes to a lone surrogate,
which the tokenizer and the response encoder cannot take), and the text is bounded in
characters (``--max-text-chars``), well below what ``--max-body-bytes`` lets through, so that
no request holds a tokenizer for long. Both are a 400 naming the field."""

from __future__ import annotations

from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenlake.serve.api.errors import APIError, error_response


class BodyLimit:
    """ASGI middleware: requests whose body exceeds ``max_body_bytes`` get a 413; others
    reach ``app`` with their body replayed from what was read."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is None:
            response = error_response(400, "Content-Length: not a byte count", "BadRequestError")
            await response(scope, receive, send)
            return
        if declared > limit:
            await self._too_large(scope, receive, send, f"{declared} bytes")
            return
        chunks: list[bytes] = []
        size = 0
        # a body within the limit arrives in at most limit + 1 messages (the last may be empty)
        for _ in range(limit + 2):
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was complete
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                await self._too_large(scope, receive, send, f"more than {limit} bytes")
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        else:
            await self._too_large(scope, receive, send, "too many body chunks")
            return
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        message = (
            f"body: {what} exceeds the server's limit of {self.max_body_bytes} bytes "
            "(--max-body-bytes)"
        )
        response = error_response(413, message, "RequestTooLargeError")
        response.headers["connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """The declared body length (0 when none is declared); ``None`` when it is not a
    number (HTTP servers usually refuse such a request before it gets here)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            if not text.isascii() or not text.isdigit():
                return None
            return int(text) if len(text) < 19 else 1 << 62  # past any limit; int() is bounded
    return 0


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` as one message, then what the client sends next
    (a disconnect, which streaming handlers watch for)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def check_text(body: BaseModel, max_chars: int) -> None:
    """Raise :class:`APIError` (400, ``param`` the top-level field) for a string that is not
    valid Unicode, or when the strings of ``body`` hold more than ``max_chars`` characters
    in all (the field holding the most is named)."""
    chars: dict[str, int] = {}
    for name in type(body).model_fields:
        value = getattr(body, name)
        chars[name] = _chars(name, value)
    total = sum(chars.values())
    if total > max_chars:
        name = max(chars, key=chars.__getitem__)
        raise APIError(400, f"{name}: the request's text is {total} characters, over this "
                       f"server's limit of {max_chars} (--max-text-chars)", param=name)  # fmt: skip


def _chars(name: str, value: object) -> int:
    """Characters of every string in ``value`` (dict keys too), walked without recursion
    (a body nests as deep as the JSON parser allows)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{name}: a string is not valid Unicode (a lone surrogate "
                               f"{item[e.start]!a} at character {e.start})", param=name) from None  # fmt: skip
            total += len(item)
        elif isinstance(item, BaseModel):
            stack.extend(getattr(item, f) for f in type(item).model_fields)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return total
