"""Real processes for the real-server tests: ``tokenlake sglang-host`` and SGLang's own
``python -m sglang.launch_server``, on CPU, driven over HTTP as a user would.

On a CPU machine SGLang's server needs its CPU engine (``SGLANG_USE_CPU_ENGINE=1``) and two
import stand-ins (``cpu_support/site``: torchvision and ``sgl_kernel``, importable in SGLang's
spawned processes through its ``sitecustomize``). Every process started here is stopped by
its process group (SIGTERM, then SIGKILL), and the SGLang load-snapshot files it mapped in
``/dev/shm`` (which SGLang leaves behind) are removed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

SITE = Path(__file__).parent / "cpu_support" / "site"
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
# the flags every CPU server of the tests takes (docs/sglang.md): SGLang's CPU default for a
# float32 checkpoint is float16, and its CPU KV cache is sized from the machine's memory
CPU_FLAGS = ("--device", "cpu", "--dtype", "float32", "--max-total-tokens")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_env(**extra: str) -> dict[str, str]:
    """SGLang's CPU engine, the CPU-test stand-ins on the path, one OpenMP thread per process
    (several servers share a small machine), and SGLang's model registry limited to Llama
    (the tests' tiny-random model; it would import its ~250 model modules at every start)."""
    env = dict(os.environ)
    paths = [str(SITE), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(PYTHONPATH=os.pathsep.join(paths), SGLANG_USE_CPU_ENGINE="1", OMP_NUM_THREADS="1",
               SGLANG_DISABLED_MODEL_ARCHS=",".join(_other_model_modules("llama")))  # fmt: skip
    env.update(extra)
    return env


def _other_model_modules(keep: str) -> list[str]:
    import importlib.util

    models = Path(importlib.util.find_spec("sglang.srt.models").submodule_search_locations[0])
    return sorted(p.stem for p in models.glob("*.py") if p.stem not in (keep, "__init__"))


@dataclass
class Process:
    """A started process and its own process group; its output goes to ``log``."""

    proc: subprocess.Popen
    log: Path
    log_start: int = 0  # this process's output starts here (a log may be reused)
    shm: set[str] = field(default_factory=set)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        with open(self.log, "rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def note_shm(self) -> None:
        """Remember the SGLang load-snapshot files the group has mapped (to remove them)."""
        for pid in _group_pids(self.proc.pid):
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            self.shm.update(w for w in maps.split() if w.startswith("/dev/shm/sglang_loads_"))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Stop the whole group: ``sig``, then SIGKILL after ``timeout_s``."""
        self.note_shm()
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, s)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        deadline = time.monotonic() + timeout_s  # the group's other members, too
        while _group_pids(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in _group_pids(self.proc.pid):
            os.kill(pid, signal.SIGKILL)
        for path in self.shm:
            Path(path).unlink(missing_ok=True)
        return self.proc.wait()


def _group_pids(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry.name))
    return out


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Process:
    with open(log, "ab") as out:
        start = out.tell()
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Process(proc, log, start)


@dataclass
class Host:
    """A running ``tokenlake sglang-host``."""

    process: Process
    port: int
    secret: str
    metrics_port: int

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def worker_config(self, path: Path, instance_id: int | None) -> Path:
        """A worker's ``--tokenlake-config`` (the three join keys)."""
        keys = {"control_endpoint": self.endpoint, "secret_file": self.secret}
        if instance_id is not None:
            keys["instance_id"] = instance_id
        path.write_text(json.dumps(keys))
        return path

    def call(self, op: str, **args):
        """One request to the host's control service, as a holder of the cluster secret."""
        import zmq

        from tokenlake.engines.sglang.shared_runtime import ControlClient
        from tokenlake.engines.transport.auth import ClusterSecret, FrameAuth

        ctx = zmq.Context()
        try:
            auth = FrameAuth(ClusterSecret.from_file(self.secret))
            client = ControlClient(ctx, self.endpoint, auth, REQUEST_TIMEOUT_S)
            try:
                return client.call(op, **args)
            finally:
                client.close()
        finally:
            ctx.destroy(linger=0)

    def metrics(self) -> dict[str, float]:
        """The host's ``/metrics`` samples (name with labels -> value)."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        out = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


def start_host(model: Path, tmp: Path, config: dict, *args: str, port: int = 0) -> Host:
    """Start ``tokenlake sglang-host`` for ``model`` with the pool ``config`` and wait until
    it says it is ready."""
    path = tmp / "tokenlake-host.json"
    path.write_text(json.dumps(config))
    port, metrics = port or free_port(), free_port()
    secret = str(tmp / "secret")
    cmd = [sys.executable, "-m", "tokenlake.serve.sglang_host", "--model-path", str(model),
           "--config", str(path), "--port", str(port), "--secret-file", secret,
           "--metrics-port", str(metrics), *args]  # fmt: skip
    process = spawn(cmd, tmp / f"host-{port}.log")
    wait_for_line(process, "ready", START_TIMEOUT_S)
    return Host(process, port, secret, metrics)


def wait_for_line(process: Process, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in process.log_text():
            return
        if not process.alive():
            raise RuntimeError(f"{process.log.name} exited:\n{process.log_text()[-3000:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{process.log.name}: no {text!r} in {timeout_s} s")


@dataclass
class Server:
    """A running ``python -m sglang.launch_server``."""

    process: Process
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> dict | None:
        """The JSON reply (``None`` if the reply is empty, as ``/abort_request``'s)."""
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            raw = reply.read()
        return json.loads(raw) if raw else None

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=REQUEST_TIMEOUT_S) as reply:
            return json.loads(reply.read())

    def generate(self, input_ids: list[int], max_new_tokens: int) -> dict:
        """Greedy decoding of ``input_ids``, with the logprobs of the chosen tokens."""
        return self.post("/generate", {
            "input_ids": input_ids, "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                "ignore_eos": True},
        })  # fmt: skip

    def wait_idle(self, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Until no request runs or waits, and then a little longer: SGLang checks its KV
        pool (``pool memory leak detected``) in every idle pass of its scheduler and dies on
        a leak, so a server still alive here has passed it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            loads = self.get("/v1/loads")["loads"]
            if all(x["num_running_reqs"] == 0 and x["num_waiting_reqs"] == 0 for x in loads):
                time.sleep(0.5)
                self.check_alive()
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.process.log.name}: not idle in {timeout_s} s")

    def wait_ready(self) -> None:
        wait_for_line(self.process, "The server is fired up and ready to roll", START_TIMEOUT_S)
        self.process.note_shm()

    def check_alive(self) -> None:
        if not self.process.alive():
            raise AssertionError(
                f"{self.process.log.name} died:\n{self.process.log_text()[-4000:]}"
            )


def start_sglang(
    model: Path, tmp: Path, backend: str, *args: str, max_total_tokens: int = 1024,
    env: dict[str, str] | None = None, flags: tuple[str, ...] = CPU_FLAGS, wait: bool = True,
) -> Server:  # fmt: skip
    """Start SGLang's real server on CPU with ``--attention-backend backend``; with ``wait``,
    wait until it is ready (its own warm-up request served)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *flags,
           str(max_total_tokens), "--attention-backend", backend, "--host", "127.0.0.1",
           "--port", str(port), *args]  # fmt: skip
    server = Server(spawn(cmd, tmp / f"sglang-{backend}-{port}.log", env or cpu_env()), port)
    if wait:
        server.wait_ready()
    return server


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)
