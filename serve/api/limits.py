"""A bound on what one HTTP request may make the server hold: a body over the limit is
answered 413 (the standard error body) before it is read whole. A declared
``Content-Length`` over the limit is refused before any of the body is read; a chunked body
is counted as it arrives and refused as soon as it passes the limit."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenlake.serve.api.errors import error_response


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
