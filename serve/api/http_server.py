"""Running the API under uvicorn: in the foreground (the command line) or on a background
thread (tests, the demo), on a socket bound before start so port 0 works."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from tokenlake.serve.api.app import create_app
from tokenlake.serve.build import Served


class HTTPServer:
    """uvicorn serving ``served``'s API on ``host:port`` (``port`` 0: any free port)."""

    def __init__(self, served: Served, host: str, port: int, log_level: str = "warning") -> None:
        self.served = served
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(
            create_app(served), log_level=log_level, timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        """Serve in this thread until interrupted (SIGINT/SIGTERM)."""
        self._server.run(sockets=[self._sock])

    def start(self, timeout_s: float = 30.0) -> HTTPServer:
        """Serve on a background thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.run, name="tokenlake-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("http: the server did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        """Stop serving (if started here), then stop the runtime and release everything."""
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=15)
        self._sock.close()
        self.served.runtime.close()

    def __enter__(self) -> HTTPServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
