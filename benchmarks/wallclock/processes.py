"""The wall-clock bench's processes: ``tokenlake serve`` or SGLang servers and the SGLang
router, each on 127.0.0.1 and a free port and the leader of its own process group, waited for
with a deadline, and stopped with their groups: a system's processes after each of its runs,
every process left when the fleet's block ends (also on errors and Ctrl-C, from whichever
thread)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROUTER_PIP = 'pip install "sglang-router==0.3.2"  (or: pip install "tokenlake[bench]")'
STOP_TIMEOUT_S = 15.0
POLL_S = 0.25


class ProcessError(RuntimeError):
    """A server or the router did not start or died; the message ends with its log's tail."""


def stop_process(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Terminate ``proc`` and wait for it; kill it if it does not end within ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.append(int(entry.name))
    return out


def stop_group(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop ``proc``, the leader of its own process group, and every process of the group
    (servers that spawn their own workers): SIGTERM, then SIGKILL after ``timeout_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        deadline = time.monotonic() + timeout_s
        while (proc.poll() is None or group_pids(proc.pid)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if proc.poll() is not None and not group_pids(proc.pid):
            return
    proc.wait(timeout=timeout_s)


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
    tbt_slo_ms: float = 0.0  # the servers' TBT target (--tbt-slo-ms; 0: none)


class Fleet:
    """Processes started here, each with its log in a temporary file."""

    def __init__(self, start_timeout_s: float = 300.0, log_dir: Path | None = None) -> None:
        self.start_timeout_s = start_timeout_s
        self.log_dir = log_dir  # keep every process's output there (default: deleted)
        self._procs: dict[int, tuple[subprocess.Popen, object]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def spawn(self, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``argv`` (with ``env``, default this process's) as the leader of its own
        process group; :meth:`stop` stops the whole group."""
        with self._lock:
            if self._closed:
                raise ProcessError("the fleet is closed: no new process")
            if self.log_dir is None:
                log = tempfile.TemporaryFile()  # noqa: SIM115 -- closed in stop()
            else:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                name = Path(argv[2] if len(argv) > 2 else argv[0]).name
                log = tempfile.NamedTemporaryFile(  # noqa: SIM115 -- closed in stop()
                    "w+b", prefix=f"{name}-", suffix=".log", dir=self.log_dir, delete=False
                )
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)  # fmt: skip
            self._procs[proc.pid] = (proc, log)
        return proc

    def _tail(self, proc: subprocess.Popen) -> str:
        with self._lock:
            entry = self._procs.get(proc.pid)
            if entry is None:
                return ""
            entry[1].seek(0)
            return entry[1].read()[-3000:].decode(errors="replace")

    def check_alive(self, procs: list[subprocess.Popen]) -> None:
        """Raise :class:`ProcessError` with the log's tail if one of ``procs`` has exited."""
        for proc in procs:
            if proc.poll() is not None:
                raise ProcessError(f"{' '.join(proc.args[:3])} (pid {proc.pid}) exited "
                                   f"({proc.returncode}):\n{self._tail(proc)}")  # fmt: skip

    def log_of(self, proc: subprocess.Popen) -> str:
        """The tail of ``proc``'s output (a process started here and not yet stopped)."""
        return self._tail(proc)

    def _wait_healthy(self, proc: subprocess.Popen, url: str, what: str, deadline: float) -> None:
        import httpx

        while time.monotonic() < deadline:
            if self._closed:  # closed from another thread (an error, Ctrl-C): stop waiting
                raise ProcessError(f"{what}: the fleet was closed while it started")
            if proc.poll() is not None:
                raise ProcessError(f"{what} exited ({proc.returncode}):\n{self._tail(proc)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(POLL_S)
        raise ProcessError(
            f"{what} not healthy after {self.start_timeout_s:g} s:\n{self._tail(proc)}"
        )

    def started(self, spawned: list[tuple[subprocess.Popen, str, str]]) -> list[str]:
        """Wait for every (process, url, what); on a failure stop them all and raise."""
        deadline = time.monotonic() + self.start_timeout_s
        try:
            for proc, url, what in spawned:
                self._wait_healthy(proc, url, what, deadline)
        except BaseException:
            self.stop([p for p, _, _ in spawned])
            raise
        return [url for _, url, _ in spawned]

    def serve(self, settings: ServerSettings, num_servers: int, num_instances: int,
              torch_threads: int) -> tuple[list[str], list[subprocess.Popen]]:  # fmt: skip
        """Start ``num_servers`` ``tokenlake serve --num-instances num_instances`` at once;
        their base URLs once all are healthy, and their processes."""
        s, spawned = settings, []
        for _ in range(num_servers):
            port = free_port()
            argv = [sys.executable, "-m", "tokenlake.serve", "--model", str(s.model_dir),
                    "--served-model-name", s.served_name, "--num-instances", str(num_instances),
                    "--segment-len", str(s.segment_len), "--num-slots", str(s.num_slots),
                    "--chunk-len", str(s.chunk_len), "--data-plane", s.data_plane,
                    "--torch-threads", str(torch_threads), "--seed", str(s.seed),
                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                    "--tbt-slo-ms", f"{s.tbt_slo_ms:g}"]  # fmt: skip
            what = f"tokenlake serve --num-instances {num_instances} (port {port})"
            spawned.append((self.spawn(argv), f"http://127.0.0.1:{port}", what))
        return self.started(spawned), [p for p, _, _ in spawned]

    def router(self, worker_urls: list[str],
               extra_args: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen]:  # fmt: skip
        """Start the SGLang router (cache-aware policy) in front of ``worker_urls``."""
        require_router()
        port, metrics_port = free_port(), free_port()
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
                *worker_urls, "--policy", "cache_aware", "--host", "127.0.0.1",
                "--port", str(port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(metrics_port), "--log-level", "warn",
                *extra_args]  # fmt: skip
        proc = self.spawn(argv)
        (url,) = self.started([(proc, f"http://127.0.0.1:{port}", f"sglang router (port {port})")])
        return url, proc

    def stop(self, procs: list[subprocess.Popen]) -> None:
        """Stop these processes (started here), newest first, each by its own id."""
        for proc in reversed(procs):
            with self._lock:
                entry = self._procs.pop(proc.pid, None)
            if entry is None:
                continue
            stop_group(proc)
            entry[1].close()

    def close(self) -> None:
        """Stop every process still running; no new one starts after this."""
        with self._lock:
            self._closed = True
            procs = [p for p, _ in self._procs.values()]
        self.stop(procs)

    @property
    def pids(self) -> list[int]:
        with self._lock:
            return list(self._procs)
