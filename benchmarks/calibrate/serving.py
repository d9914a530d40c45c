"""The serving path's cost, measured on a real ``tokenlake serve``: what a served request, a
streamed token and a serving-loop iteration cost beyond the model engine and the control
plane, which the simulator already prices.

Three phases are driven by the wall-clock bench's streaming client: ``num_solo`` requests
one after another with one output token each, one request streaming ``max_tokens`` tokens,
then ``batch`` such requests at once (``prompt_len``-token prompts: their pages spread over
a pool's instances, so a decode step has the parts a served conversation's has); the server's iteration counter (``/metrics``) is read
around each. The time each phase kept the server busy, as its clients saw it (the solo
requests' TTFTs; the streams' first send to last token), is set against the simulator's for
the same requests on the same profile with no serving cost; what is left is the serving
path's, solved from the three phases:

- per request ``r``: ``(busy_solo - sim_solo) / num_solo`` (HTTP, tokenizer, admission, the
  stream's set-up; one token's streaming folded in);
- per token ``t`` and per iteration ``i``: ``busy - sim - requests x r = tokens x t +
  iterations x i`` for the single stream and the batch.

Wall time (``clock="wall"``) includes the server's threads waiting for one another (the GIL,
torch's and the kernels' thread pools on few cores), which is what a client waits for, and
also whatever else the machine runs: measure on a quiet machine. ``clock="cpu"`` uses the
server process's CPU time (``/proc/<pid>/stat``, every thread, idle polls subtracted)
instead: immune to other programs, blind to waiting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenlake.benchmarks.sim.cpu_profile import CpuProfile, ServingCost
from tokenlake.benchmarks.sim.served_cpu import Arrival, ServedSettings, simulate_served
from tokenlake.benchmarks.sim.served_cpu import to_requests as sim_requests
from tokenlake.benchmarks.wallclock.processes import stop_process

SEGMENT_LEN, NUM_SLOTS, CHUNK_LEN = 32, 512, 256
START_TIMEOUT_S = 300.0
IDLE_S = 1.0


@dataclass(frozen=True)
class ServingCosts:
    cost: ServingCost
    detail: dict


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenlake serve exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"tokenlake serve not healthy after {timeout_s:g} s")


def _sim_busy_s(profile: CpuProfile, timed, concurrent: bool, num_instances: int) -> float:
    """Seconds the simulated server spends on ``timed`` with no serving cost: the batch's
    makespan, or the solo requests' summed TTFTs."""
    profile = dataclasses.replace(profile, serving=())
    reqs = sim_requests([t.prompt_ids for t in timed], [t.max_tokens for t in timed], 32)
    arrivals = [Arrival(r, 0.0 if concurrent else 10.0 * i, None) for i, r in enumerate(reqs)]
    settings = ServedSettings(num_instances, SEGMENT_LEN, NUM_SLOTS, CHUNK_LEN)
    system = "tokenlake" if num_instances > 1 else "router"
    records, _ = simulate_served(system, profile, settings, arrivals, 1e9, SEGMENT_LEN)
    if concurrent:
        return max(r.finish_s for r in records)
    return sum(r.first_token_s - r.arrival_s for r in records)


def measure_serving(
    model_name: str,
    profile: CpuProfile,
    num_instances: int = 1,
    torch_threads: int = 1,
    batch: int = 8,
    max_tokens: int = 256,
    num_solo: int = 32,
    seed: int = 0,
    clock: str = "wall",
    prompt_len: int = 512,
) -> ServingCosts:
    """Start ``tokenlake serve`` with ``num_instances`` instances on ``torch_threads``
    threads for ``model_name`` (as the wall-clock bench writes it), measure the phases, stop
    it (also on errors). ``clock``: ``wall`` (default: the time the clients waited, what
    the SLO sees: it includes the server's threads waiting for one another and for the
    cores) or ``cpu`` (the server process's CPU time)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock: expected 'wall' or 'cpu', got {clock!r}")

    from tokenlake.benchmarks.wallclock.client import ALPHABET, drive
    from tokenlake.benchmarks.wallclock.processes import free_port
    from tokenlake.benchmarks.wallclock.serving_compare import prepare_model
    from tokenlake.benchmarks.wallclock.workloads import TimedRequest

    rng = np.random.default_rng(seed)

    def prompts(n: int, tokens: int, length: int) -> list:
        return [
            TimedRequest(
                f"cal-{length}-{i}",
                0.0,
                tuple(int(x) for x in rng.integers(0, len(ALPHABET), length)),
                tokens,
                None,
            )  # fmt: skip
            for i in range(n)
        ]

    solo, one, many = (
        prompts(num_solo, 1, 64),
        prompts(1, max_tokens, prompt_len),
        prompts(batch, max_tokens, prompt_len),
    )
    with tempfile.TemporaryDirectory(prefix="tokenlake-calibrate-") as tmp:
        model_dir = prepare_model(model_name, Path(tmp), seed)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [sys.executable, "-m", "tokenlake.serve", "--model", str(model_dir),
                "--served-model-name", "cal", "--num-instances", str(num_instances),
                "--segment-len", str(SEGMENT_LEN), "--num-slots", str(NUM_SLOTS),
                "--chunk-len", str(CHUNK_LEN), "--torch-threads", str(torch_threads),
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_healthy(proc, url, START_TIMEOUT_S)
            drive(url, "cal", prompts(1, 2, 16), 1.0, salt=0, limit_s=120.0)  # warm-up
            c0 = process_cpu_s(proc.pid)
            time.sleep(IDLE_S)
            idle_rate = (process_cpu_s(proc.pid) - c0) / IDLE_S
            phases = []
            for reqs in (solo, one, many):
                c0, n0, w0 = process_cpu_s(proc.pid), _iterations(url), time.perf_counter()
                if reqs is solo:  # one after another
                    records = [drive(url, "cal", [r], 1.0, salt=0, limit_s=120.0)[0] for r in reqs]
                else:
                    records = drive(url, "cal", reqs, 1e6, salt=0, limit_s=300.0)
                wall = time.perf_counter() - w0
                if not all(r.finished for r in records):
                    raise RuntimeError(f"a calibration request failed: {records[0].error}")
                cpu = process_cpu_s(proc.pid) - c0 - idle_rate * wall
                if reqs is solo:  # the time the requests kept the server busy, as clients see it
                    busy = sum(r.ttft_s for r in records)
                else:
                    busy = max(r.token_s[-1] for r in records) - min(r.sent_s for r in records)
                phases.append((cpu if clock == "cpu" else busy, _iterations(url) - n0))
        finally:
            stop_process(proc)
    (cpu_solo, _), (cpu_one, it_one), (cpu_many, it_many) = phases
    sim_solo = _sim_busy_s(profile, solo, False, num_instances)
    per_request = max(0.0, (cpu_solo - sim_solo) / num_solo)
    # tokens x t + iterations x i = what is left, for the single stream and the batch
    left = [cpu_one - _sim_busy_s(profile, one, True, num_instances) - per_request,
            cpu_many - _sim_busy_s(profile, many, True, num_instances) - batch * per_request]  # fmt: skip
    a = np.array([[max_tokens, it_one], [batch * max_tokens, it_many]], dtype=float)
    per_token, per_iteration = np.linalg.lstsq(a, np.array(left), rcond=None)[0]
    if per_token < 0 or per_iteration < 0:  # noise: one of them nil, the other takes it all
        per_token = max(0.0, left[1] / (batch * max_tokens)) if per_iteration < 0 else 0.0
        per_iteration = max(0.0, left[0] / it_one) if per_token == 0 else 0.0
    detail = {
        "clock": clock, "busy_s": [round(c, 4) for c, _ in phases],
        "iterations": [n for _, n in phases],
        "left_s": [round(x, 4) for x in left], "idle_cpu_per_s": round(idle_rate, 4),
        "num_solo": num_solo, "batch": batch, "max_tokens": max_tokens,
    }  # fmt: skip
    cost = ServingCost(
        num_instances, torch_threads, round(per_request, 6), round(float(per_token), 7),
        round(float(per_iteration), 7),
    )  # fmt: skip
    return ServingCosts(cost, {"num_instances": num_instances, **detail})


def _iterations(url: str) -> int:
    """The server's ``tokenlake:iterations_total`` counter."""
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=10.0).text.splitlines():
        if line.startswith("tokenlake:iterations_total"):
            return int(float(line.rpartition(" ")[2]))
    return 0  # not counted yet
