"""SIGTERM to a real ``tokenlake serve`` (``--data-plane compute``: engine, compute and fork
server processes) with 12 streams open: new connections are refused at once, the streams
that can finish within ``--shutdown-timeout`` finish, every other one ends with a final
chunk whose ``finish_reason`` is ``"abort"``, and every stream ends with ``data: [DONE]``;
``serve`` exits 0, and every process it started (the fork server, the engines and compute
processes, multiprocessing's resource tracker) has exited by then."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from process_helpers import descendants, gone

httpx = pytest.importorskip("httpx")

HANG_GUARD_S = 180.0  # a guard against a hang only
# max_tokens: a short stream finishes within the grace period; a long one cannot (4,000
# iterations in 3 s). The pool holds all twelve at once (2,048 slots of 8 tokens per
# instance), so that none waits for another's KV.
SHORT, LONG = 6, 4000
GRACE_S = 3


def num_requests(url: str) -> int:
    """Requests the runtime received, from ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=HANG_GUARD_S).text
    found = re.search(r"^tokenlake:requests_total\{[^}]*\} (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


class Stream:
    """One streamed completion read on its own thread: its chunks' finish reasons, whether
    it ended with ``[DONE]``, how many tokens it got."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int) -> None:
        self.reasons: list[str] = []
        self.done = False
        self.num_tokens = 0
        self.error: BaseException | None = None
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body,
                              timeout=HANG_GUARD_S) as r:  # fmt: skip
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    self.num_tokens += len(choice.get("token_ids") or ())
                    if choice["finish_reason"] is not None:
                        self.reasons.append(choice["finish_reason"])
        except BaseException as e:  # reported by the test
            self.error = e


def test_sigterm_drains_streams_then_aborts_the_rest_and_leaves_no_process():
    args = [
        sys.executable, "-m", "tokenlake.serve", "--model", "tiny-random", "--num-instances",
        "2", "--data-plane", "compute", "--no-profile", "--torch-threads", "1",
        "--segment-len", "8", "--num-slots", "2048", "--chunk-len", "32", "--port", "0",
        "--shutdown-timeout", str(GRACE_S), "--max-num-seqs", "16",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        deadline = time.monotonic() + HANG_GUARD_S
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "serve exited before it served"
            found = re.search(r"serving .* at (http://[\d.:]+)", line)
            url = found.group(1) if found else None
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain the log
        helpers = descendants(proc.pid)
        streams = [Stream(url, [5 + k, 6, 7], SHORT if k % 2 else LONG) for k in range(12)]
        deadline = time.monotonic() + HANG_GUARD_S
        while (received := num_requests(url)) < len(streams):  # all reached the runtime
            errors = [s.error for s in streams if s.error is not None]
            assert not errors and time.monotonic() < deadline, (received, errors)
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + HANG_GUARD_S
        host, port = url.removeprefix("http://").rsplit(":", 1)
        while True:  # new connections are refused while the long streams still run
            try:
                socket.create_connection((host, int(port)), timeout=5).close()
            except OSError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
        still_running = sum(not s.reasons for s in streams)
        code = proc.wait(HANG_GUARD_S)
        left = [pid for pid in helpers if not gone(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for s in streams:
        s.thread.join(HANG_GUARD_S)
    short = [s for k, s in enumerate(streams) if k % 2]
    long = [s for k, s in enumerate(streams) if not k % 2]
    print(
        f"\nSIGTERM with 12 streams: {still_running} still running when new connections were "
        f"refused; short {[s.reasons for s in short]}, long {[s.reasons for s in long]} "
        f"({[s.num_tokens for s in long]} tokens); exit code {code}; "
        f"{len(helpers)} helper processes, {len(left)} left"
    )
    assert code == 0
    assert still_running > 0
    assert all(s.error is None and s.done and len(s.reasons) == 1 for s in streams)
    for s, max_tokens in [(s, SHORT) for s in short] + [(s, LONG) for s in long]:
        assert s.reasons == (["length"] if s.num_tokens == max_tokens else ["abort"])
    assert all(s.reasons == ["length"] for s in short)  # finished within the grace period
    assert all(s.reasons == ["abort"] for s in long)
    assert len(helpers) >= 5 and left == []  # fork server, 2 x (query, transfer, compute)
