"""The API key: when one is set, every ``/v1/*`` request, ``/tokenize`` and ``/detokenize``
(and ``/metrics`` with ``--metrics-require-key``) must carry ``Authorization: Bearer <key>``
or is answered 401 before its body is read; ``/health``, ``/ping``, ``/version`` and
``/metrics`` otherwise stay open, for probes and scrapers.

The key is a secret, so it never travels on a command line (where ``ps`` shows it): it is
read from the file ``--api-key-file`` names, which must be this user's and of mode 0600, as
the cluster secret's (vLLM takes ``--api-key`` or ``VLLM_API_KEY``; here neither a command
line nor an environment variable's value carries a secret)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenlake.engines.transport.auth import read_private_file
from tokenlake.errors import InvalidArgumentError
from tokenlake.serve.api.errors import error_response

MAX_API_KEY_BYTES = 4096
PROTECTED_PREFIX = "/v1"
PROTECTED_PATHS = ("/tokenize", "/detokenize")  # they run the tokenizer: not for anyone
METRICS_PATH = "/metrics"


def load_api_key(api_key_file: str | None) -> str | None:
    """The key from ``api_key_file`` (its text, surrounding whitespace dropped); ``None``
    when no file is given. Raises ``InvalidArgumentError`` for an unreadable, empty or
    oversized file."""
    if api_key_file is None:
        return None
    data = read_private_file(api_key_file, "api_key_file", MAX_API_KEY_BYTES + 1)
    if len(data) > MAX_API_KEY_BYTES:
        raise InvalidArgumentError(
            f"api_key_file: {api_key_file!r} is over {MAX_API_KEY_BYTES} bytes"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"api_key_file: cannot read {api_key_file!r}: {e}") from None
    return _checked(text.strip(), "api_key_file")


def _checked(key: str, source: str) -> str:
    if not key or not key.isprintable():
        raise InvalidArgumentError(f"{source}: expected a non-empty printable key")
    return key


class APIKeyAuth:
    """ASGI middleware: requests to ``/v1/*``, ``/tokenize``, ``/detokenize`` (and
    ``/metrics`` with ``protect_metrics``) without ``Authorization: Bearer <api_key>`` get a
    401 (the standard error body) and never reach ``app``; CORS preflights pass."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._paths = PROTECTED_PATHS + ((METRICS_PATH,) if protect_metrics else ())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") == "OPTIONS"
            or not self._protected(scope.get("path", ""))
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

    def _protected(self, path: str) -> bool:
        path = path.rstrip("/") or "/"  # "/tokenize/" is redirected to "/tokenize"
        return (
            path == PROTECTED_PREFIX
            or path.startswith(PROTECTED_PREFIX + "/")
            or path in self._paths
        )
