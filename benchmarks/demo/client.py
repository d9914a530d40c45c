"""The demo's client side (:mod:`tokenlake.benchmarks.demo.main`): start ``python -m tokenlake.serve``,
wait until it is healthy, replay sessions of turns through its streaming completions API
(TTFT, TBT and cached tokens per turn) and scrape its Prometheus metrics."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tokenlake.benchmarks.progress import Progress

MODEL_NAME = "tiny-random"


@dataclass(eq=False)
class Turn:
    index: int  # position in the trace
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    ttft_s: float = float("nan")
    tbt_s: list[float] = field(default_factory=list)
    cached: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, args, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "tokenlake.serve", "--model", str(model_dir),
        "--served-model-name", MODEL_NAME, "--num-instances", str(args.instances),
        "--segment-len", str(512 // args.scale), "--num-slots", str(args.slots),
        "--chunk-len", str(8 * 512 // args.scale), "--port", str(port),
        "--torch-threads", "1", "--log-level", "warning",
    ]  # fmt: skip
    return subprocess.Popen(cmd)


def wait_healthy(client, proc: subprocess.Popen, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s")


def run_turn(client, turn: Turn) -> None:
    body = {
        "model": MODEL_NAME, "prompt": turn.prompt, "max_tokens": turn.max_tokens,
        "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    t0 = last = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request {turn.index}: HTTP {r.status_code}: {r.read()!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"request {turn.index}: {event['error']}")
            if event.get("usage"):
                turn.cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in event["choices"]:
                ids = choice.get("token_ids") or []
                now = time.perf_counter()
                if ids and not turn.output:
                    turn.ttft_s = now - t0
                elif ids:
                    turn.tbt_s.append(now - last)
                last = now
                turn.output.extend(ids)


def replay(url: str, sessions: list[list[Turn]], speedup: float) -> float:
    import httpx

    progress = Progress(sum(map(len, sessions)), "turns answered")
    done = [0]
    lock = threading.Lock()
    start = time.perf_counter()

    def session(turns: list[Turn]) -> None:
        with httpx.Client(base_url=url, timeout=300) as client:
            for turn in turns:
                delay = turn.arrival_s / speedup - (time.perf_counter() - start)
                if delay > 0:
                    time.sleep(delay)
                run_turn(client, turn)
                with lock:
                    done[0] += 1
                    progress.update(done[0])

    with concurrent.futures.ThreadPoolExecutor(len(sessions)) as pool:
        for f in [pool.submit(session, s) for s in sessions]:
            f.result()
    progress.close()
    return time.perf_counter() - start


def scrape(client) -> dict[str, float]:
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("tokenlake:") and "instance=" not in line:
            name, value = line.split(" ", 1)[0].split("{", 1)[0], line.rsplit(" ", 1)[1]
            out[name.removeprefix("tokenlake:")] = float(value)
    return out


def quiet_http_client_logs() -> None:
    """httpx logs every request at INFO: hundreds of lines that would bury the demo's own
    progress lines. Kept at debug level, where one asks for them."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
