"""Running the API under uvicorn: in the foreground (the command line) or on a background
thread (tests, the demo), on a socket bound before start so port 0 works.

Connection limits are uvicorn's own settings: ``--limit-concurrency`` (a request past it
gets uvicorn's 503), ``--timeout-keep-alive`` and h11's bound on an incomplete request head.

Shutting down (SIGTERM or SIGINT in the foreground, :meth:`HTTPServer.shutdown` otherwise)
is vLLM's graceful one: uvicorn stops accepting connections at once and waits for the
running requests; those still running after ``--shutdown-timeout`` seconds are ended by the
runtime with ``finish_reason`` ``"abort"``, so that each stream still gets its final chunk and
``data: [DONE]``; a second signal ends them at once."""

from __future__ import annotations

import signal
import socket
import threading
import time

import uvicorn

from tokenlake.serve.api.app import create_app
from tokenlake.serve.build import Served

# after the grace period, what aborted streams get to send their last chunks
FLUSH_S = 5.0
MAX_HEAD_BYTES = 16 << 10  # h11's bound on a request line and headers not yet complete


class HTTPServer:
    """uvicorn serving ``served``'s API on ``host:port`` (``port`` 0: any free port)."""

    def __init__(self, served: Served, host: str, port: int, log_level: str = "warning") -> None:
        self.served = served
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        cfg = served.config
        config = uvicorn.Config(
            create_app(served), log_level=log_level,
            timeout_graceful_shutdown=round(cfg.shutdown_timeout + FLUSH_S),
            limit_concurrency=cfg.limit_concurrency, timeout_keep_alive=cfg.timeout_keep_alive,
            h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        )  # fmt: skip
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._abort_timer: threading.Timer | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve until SIGTERM or SIGINT (this thread must be the main one): the first
        signal shuts down gracefully, a second one aborts what still runs."""
        self.start()
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            while self._thread.is_alive():
                self._thread.join(0.5)  # signal handlers run between waits
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def start(self, timeout_s: float = 30.0) -> HTTPServer:
        """Serve on a background thread; returns once it accepts connections."""
        # uvicorn off the main thread installs no signal handlers (it would re-raise a
        # caught SIGTERM on its way out, killing this process before anything is closed)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="tokenlake-http",
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("http: the server did not start")
            time.sleep(0.01)
        return self

    def shutdown(self) -> None:
        """Stop accepting connections; requests still running after ``shutdown_timeout``
        seconds end with ``finish_reason`` ``"abort"`` (returns at once)."""
        if self._server.should_exit:
            self._abort()  # asked twice: end them now
            return
        self._server.should_exit = True
        grace = self.served.config.shutdown_timeout
        self._abort_timer = threading.Timer(grace, self._abort)
        self._abort_timer.daemon = True
        self._abort_timer.start()

    def _abort(self) -> None:
        self.served.runtime.abort_all()

    def _on_signal(self, signum, frame) -> None:
        self.shutdown()

    def close(self) -> None:
        """Stop serving (if started here), then stop the runtime and release everything."""
        if self._thread is not None:
            if not self._server.should_exit:
                self.shutdown()
                self._abort()  # nobody waits for a grace period here
            self._thread.join(timeout=self.served.config.shutdown_timeout + 2 * FLUSH_S)
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        self._sock.close()
        self.served.runtime.close()

    def __enter__(self) -> HTTPServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
