"""The wall-clock bench's processes: ``tokenlake serve`` servers and the SGLang router, each on
127.0.0.1 and a free port, waited for with a deadline, and stopped by their process ids when
the block ends (also on errors and Ctrl-C)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROUTER_PIP = 'pip install "sglang-router==0.3.2"  (or: pip install "tokenlake[bench]")'
STOP_TIMEOUT_S = 15.0
POLL_S = 0.25


class ProcessError(RuntimeError):
    """A server or the router did not start or died; the message ends with its log's tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_router() -> None:
    """Raise :class:`ProcessError` naming the pip command when the router is not installed."""
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise ProcessError(f"the SGLang router (sglang_router) is not installed: {ROUTER_PIP}")


@dataclass(frozen=True)
class ServerSettings:
    """What every ``tokenlake serve`` of one comparison gets (per instance the same)."""

    model_dir: Path
    served_name: str
    segment_len: int = 32
    num_slots: int = 96
    chunk_len: int = 256
    data_plane: str = "local"
    seed: int = 0


@dataclass
class Fleet:
    """Processes started here; :meth:`close` stops every one (terminate, then kill)."""

    start_timeout_s: float = 300.0
    procs: list[tuple[subprocess.Popen, object, str]] = field(default_factory=list)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, argv: list[str], what: str) -> subprocess.Popen:
        log = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in close()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((proc, log, what))
        return proc

    def _tail(self, proc: subprocess.Popen) -> str:
        for p, log, _ in self.procs:
            if p is proc:
                log.seek(0)
                return log.read()[-3000:].decode(errors="replace")
        return ""

    def _wait_healthy(self, proc: subprocess.Popen, url: str, what: str) -> None:
        import httpx

        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ProcessError(f"{what} exited ({proc.returncode}):\n{self._tail(proc)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(POLL_S)
        raise ProcessError(
            f"{what} not healthy after {self.start_timeout_s:g} s:\n{self._tail(proc)}"
        )

    def serve(self, settings: ServerSettings, num_instances: int, torch_threads: int) -> str:
        """Start ``tokenlake serve --num-instances num_instances``; its base URL once healthy."""
        port = free_port()
        s = settings
        argv = [sys.executable, "-m", "tokenlake.serve", "--model", str(s.model_dir),
                "--served-model-name", s.served_name, "--num-instances", str(num_instances),
                "--segment-len", str(s.segment_len), "--num-slots", str(s.num_slots),
                "--chunk-len", str(s.chunk_len), "--data-plane", s.data_plane,
                "--torch-threads", str(torch_threads), "--seed", str(s.seed),
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
        what = f"tokenlake serve --num-instances {num_instances} (port {port})"
        proc = self._spawn(argv, what)
        url = f"http://127.0.0.1:{port}"
        self._wait_healthy(proc, url, what)
        return url

    def router(self, worker_urls: list[str], extra_args: tuple[str, ...] = ()) -> str:
        """Start the SGLang router (cache-aware policy) in front of ``worker_urls``."""
        require_router()
        port, metrics_port = free_port(), free_port()
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
                *worker_urls, "--policy", "cache_aware", "--host", "127.0.0.1",
                "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics_port), "--log-level", "warn",
                *extra_args]  # fmt: skip
        what = f"sglang router (port {port})"
        proc = self._spawn(argv, what)
        url = f"http://127.0.0.1:{port}"
        self._wait_healthy(proc, url, what)
        return url

    def close(self) -> None:
        """Stop every process started here, newest first, each by its own id."""
        while self.procs:
            proc, log, _ = self.procs.pop()
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=STOP_TIMEOUT_S)
            log.close()
