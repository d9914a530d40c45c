"""The API key: when one is set, every ``/v1/*`` request must carry
``Authorization: Bearer <key>`` or is answered 401 before its body is read (other paths,
``/health``, ``/metrics``, ``/tokenize`` and the like, stay open, as in vLLM).

The key is a secret, so it never travels on a command line (where ``ps`` shows it): it is
read from the 0600-style file ``--api-key-file`` names (vLLM takes ``--api-key`` or
``VLLM_API_KEY``; here neither a command line nor an environment variable's value carries a
secret, as for the cluster secret)."""

from __future__ import annotations

import hmac
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.api.errors import error_response

MAX_API_KEY_BYTES = 4096
PROTECTED_PREFIX = "/v1"


def load_api_key(api_key_file: str | None) -> str | None:
    """The key from ``api_key_file`` (its text, surrounding whitespace dropped); ``None``
    when no file is given. Raises ``InvalidArgumentError`` for an unreadable, empty or
    oversized file."""
    if api_key_file is None:
        return None
    path = Path(api_key_file)
    try:
        if path.stat().st_size > MAX_API_KEY_BYTES:
            raise InvalidArgumentError(
                f"api_key_file: {api_key_file!r} is over {MAX_API_KEY_BYTES} bytes"
            )
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgumentError(f"api_key_file: cannot read {api_key_file!r}: {e}") from None
    return _checked(text.strip(), "api_key_file")


def _checked(key: str, source: str) -> str:
    if not key or not key.isprintable():
        raise InvalidArgumentError(f"{source}: expected a non-empty printable key")
    return key


class APIKeyAuth:
    """ASGI middleware: ``/v1/*`` requests without ``Authorization: Bearer <api_key>`` get
    a 401 (the standard error body) and never reach ``app``; CORS preflights pass."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or not _protected(scope.get("path", ""))
        ):
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        response = error_response(
            401, "Unauthorized: send the API key as 'Authorization: Bearer <key>'",
            "AuthenticationError", {"www-authenticate": "Bearer", "connection": "close"},
        )  # fmt: skip
        await response(scope, receive, send)


def _protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")
