"""The two sides of the SGLang wall-clock bench, as real processes on 127.0.0.1:

- ``tokenlake``: one ``tokenlake sglang-host`` (the pool's control plane and engines) and N
  ``python -m sglang.launch_server --attention-backend tokenlake`` servers, each one instance
  of the pool (its ``--tokenlake-config`` holds the three join keys), behind SGLang routers
  with load-only policies;
- ``baseline``: N ``python -m sglang.launch_server`` servers with their own radix caches
  (SGLang's ``torch_native`` attention on a CPU), behind ``sglang_router --policy
  cache_aware`` routers.

Equal KV memory per server: a baseline server's cache holds ``max_total_tokens``; a TokenLake
server's SGLang cache holds ``tokenlake_sglang_tokens`` and its pool instance the rest (a
server started by ``sglang.launch_server`` keeps two copies: SGLang's cache and the pool's
slots). Every server takes the same chunked-prefill size. Each side's processes are process
groups of the bench's :class:`~tokenlake.benchmarks.wallclock.processes.Fleet`; their CPU
seconds are read from /proc.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tokenlake.benchmarks.wallclock.processes import Fleet, free_port, group_pids

SGLANG_COUNTERS = ("sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                   "sglang:cached_tokens_total")  # fmt: skip


@dataclass(frozen=True)
class SGLangSettings:
    """What every SGLang server of one comparison gets."""

    model_dir: Path
    served_name: str
    max_total_tokens: int  # KV tokens per server, both sides
    chunked_prefill_size: int
    tokenlake_sglang_tokens: int  # TokenLake side: SGLang's own cache; the pool gets the rest
    segment_len: int = 32
    device: str = "cpu"
    pythonpath: str = ""  # put first on every SGLang process's PYTHONPATH (CPU stand-ins)
    baseline_attention: str = "torch_native"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.tokenlake_sglang_tokens < self.max_total_tokens:
            raise ValueError(
                f"tokenlake_sglang_tokens: expected 0 < it < max_total_tokens "
                f"({self.max_total_tokens}), got {self.tokenlake_sglang_tokens}"
            )
        if self.pool_slots < 1:
            raise ValueError(f"max_total_tokens - tokenlake_sglang_tokens: expected at least "
                             f"one segment ({self.segment_len} tokens)")  # fmt: skip

    @property
    def pool_slots(self) -> int:
        """Pool slots per instance: the TokenLake server's share of the KV memory."""
        return (self.max_total_tokens - self.tokenlake_sglang_tokens) // self.segment_len

    def env(self) -> dict[str, str]:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        if self.pythonpath:
            rest = env.get("PYTHONPATH", "")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (self.pythonpath, rest)))
        return env

    def server_argv(self, port: int, attention: str, kv_tokens: int, *extra: str) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path",
                str(self.model_dir), "--served-model-name", self.served_name, "--device",
                self.device, "--dtype", "float32", "--max-total-tokens", str(kv_tokens),
                "--chunked-prefill-size", str(self.chunked_prefill_size),
                "--attention-backend", attention, "--enable-metrics", "--random-seed",
                str(self.seed), "--log-level", "warning", "--host", "127.0.0.1",
                "--port", str(port), *extra]  # fmt: skip


@dataclass
class Side:
    """One side's processes: its servers' URLs, its routers' URLs by system name, every
    process group (for CPU seconds) and the SGLang files it left in /dev/shm."""

    name: str
    servers: list[str]
    procs: list = field(default_factory=list)
    routers: dict[str, str] = field(default_factory=dict)
    shm: set[str] = field(default_factory=set)
    host_metrics: str = ""  # the TokenLake host's /metrics base URL

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of every process of the side, reaped children included."""
        return sum(self.cpu_by_role().values())

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds per ``kind:process name`` (kind: host, server or router; the name as
        the process set it, e.g. ``server:sglang::scheduler``): where a side's time goes."""
        tick = os.sysconf("SC_CLK_TCK")
        out: dict[str, float] = {}
        for proc in self.procs:
            argv = " ".join(map(str, proc.args))
            kind = "host" if "sglang_host" in argv else "router" if "router" in argv else "server"
            for pid in group_pids(proc.pid):
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                comm = stat[stat.index("(") + 1 : stat.rindex(")")]
                fields = stat.rsplit(")", 1)[1].split()
                key = f"{kind}:{comm}"  # utime stime cutime cstime
                out[key] = out.get(key, 0.0) + sum(int(x) for x in fields[11:15]) / tick
        return out

    def note_shm(self) -> None:
        """Remember SGLang's load-snapshot files the side mapped (SGLang leaves them)."""
        for proc in self.procs:
            for pid in group_pids(proc.pid):
                try:
                    maps = Path(f"/proc/{pid}/maps").read_text()
                except OSError:
                    continue
                self.shm.update(w for w in maps.split() if w.startswith("/dev/shm/sglang_"))

    def remove_shm(self) -> None:
        for path in self.shm:
            Path(path).unlink(missing_ok=True)


def _servers(fleet: Fleet, settings: SGLangSettings, attention: str, kv_tokens: int,
             extras: list[list[str]]) -> tuple[list[str], list]:  # fmt: skip
    spawned = []
    for extra in extras:
        port = free_port()
        argv = settings.server_argv(port, attention, kv_tokens, *extra)
        what = f"sglang.launch_server --attention-backend {attention} (port {port})"
        spawned.append((fleet.spawn(argv, settings.env()), f"http://127.0.0.1:{port}", what))
    return fleet.started(spawned), [p for p, _, _ in spawned]


def start_baseline(fleet: Fleet, settings: SGLangSettings, num_servers: int) -> Side:
    """N SGLang servers with their own radix caches (no router yet)."""
    urls, procs = _servers(fleet, settings, settings.baseline_attention,
                           settings.max_total_tokens, [[] for _ in range(num_servers)])  # fmt: skip
    return Side("baseline", urls, procs)


def start_tokenlake(fleet: Fleet, settings: SGLangSettings, num_servers: int, tmp: Path) -> Side:
    """One ``tokenlake sglang-host`` for ``num_servers`` instances and as many SGLang servers
    joined to it (no router yet)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "tokenlake-host.json"
    config.write_text(json.dumps({"num_instances": num_servers, "num_slots": settings.pool_slots,
                                  "segment_len": settings.segment_len}))  # fmt: skip
    port, metrics_port, secret = free_port(), free_port(), tmp / "secret"
    argv = [sys.executable, "-m", "tokenlake.serve.sglang_host", "--model-path",
            str(settings.model_dir), "--config", str(config), "--port", str(port),
            "--secret-file", str(secret), "--metrics-port", str(metrics_port)]  # fmt: skip
    host = fleet.spawn(argv, settings.env())
    # the host's metrics server answers every path once the pool is up
    fleet.started([(host, f"http://127.0.0.1:{metrics_port}", "tokenlake sglang-host")])
    extras = []
    for i in range(num_servers):
        worker = tmp / f"worker{i}.json"
        worker.write_text(json.dumps({"control_endpoint": f"tcp://127.0.0.1:{port}",
                                      "secret_file": str(secret), "instance_id": i}))  # fmt: skip
        extras.append(["--tokenlake-config", str(worker)])
    try:
        urls, procs = _servers(fleet, settings, "tokenlake", settings.tokenlake_sglang_tokens,
                               extras)  # fmt: skip
    except BaseException:
        fleet.stop([host])
        raise
    return Side("tokenlake", urls, [host, *procs], host_metrics=f"http://127.0.0.1:{metrics_port}")


def add_router(fleet: Fleet, side: Side, system: str, router_args: tuple[str, ...]) -> str:
    """Start an SGLang router in front of ``side``'s servers as system ``system``."""
    url, proc = fleet.router(side.servers, router_args)
    side.procs.append(proc)
    side.routers[system] = url
    return url


def parse_sglang_counters(text: str) -> dict[str, float]:
    """SGLang's /metrics text -> each of :data:`SGLANG_COUNTERS` summed over its labels."""
    out = dict.fromkeys(SGLANG_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rpartition(" ")[2])
    return out


def scrape_counters(urls: list[str], timeout_s: float = 10.0) -> list[dict[str, float]]:
    import httpx

    return [parse_sglang_counters(httpx.get(f"{u}/metrics", timeout=timeout_s).text)
            for u in urls]  # fmt: skip
