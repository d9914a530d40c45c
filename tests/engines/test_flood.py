"""An unauthenticated flood at a live engine while real requests run: multipart messages of
32 x 32 MiB and 16 MiB junk frames from plain ZeroMQ sockets, 32 MiB frames from raw TCP
connections that speak the handshake's first step, handshakes with a wrong key. Every real
request completes exactly within the default timeout, the engine refuses each flooding
connection (counted), and its resident memory after the flood stays within a bound (prints
the growth and the peak)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import zmq
from engine_helpers import SHAPE
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.engines.clusters.mp import MPCluster
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.transport.auth import ClusterSecret, FrameAuth

C = 16
MIB = 1 << 20
GROWTH_BOUND = 128 * MIB
FLOOD_S = 3.0
NUM_RAW_FRAMES = 24  # each 32 MiB, sent before the handshake completes
# a request's length before the next takes its place: the steps depend on the machine's
# speed, the pool's 2 x 32 slots of C tokens must not
MAX_REQUEST_TOKENS = 12 * C


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/{pid}/status")


def _greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting (64 bytes) proposing ``mechanism``."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" * 32


def _raw_frames(host: str, port: int, count: int, stop: threading.Event) -> None:
    """Open a connection, propose CURVE, send one 32 MiB frame, repeat."""
    junk = b"\x5a" * (32 * MIB)
    head = b"\x06" + (len(junk)).to_bytes(8, "big")  # long command frame
    for _ in range(count):
        if stop.is_set():
            return
        try:
            with socket.create_connection((host, port), timeout=5) as s:
                s.sendall(_greeting(b"CURVE") + head)
                s.sendall(junk)
                s.settimeout(2)
                while s.recv(65536):  # until the engine drops the connection
                    pass
        except OSError:
            pass  # dropped mid-send: what the engine should do


def _zmq_flood(ctx: zmq.Context, endpoint: str, stop: threading.Event) -> None:
    """Plain sockets (no key) and a wrong-key one, sending big multipart messages and junk."""
    part, junk = b"\x11" * (32 * MIB), b"\x22" * (16 * MIB)
    socks = []
    for wrong_key in (False, False, True):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt(zmq.RECONNECT_IVL, 20)
        if wrong_key:
            FrameAuth(ClusterSecret.generate()).curve_client(sock)
        sock.connect(endpoint)
        socks.append(sock)
    deadline = time.monotonic() + FLOOD_S
    while not stop.is_set() and time.monotonic() < deadline:
        for sock in socks:
            try:
                sock.send_multipart([part] * 32, zmq.NOBLOCK, copy=False)
                for _ in range(51):
                    sock.send(junk, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
        time.sleep(0.05)
    for sock in socks:
        sock.close(linger=0)


def test_unauthenticated_flood_neither_grows_memory_nor_delays_real_requests():
    config = tl.PoolConfig(SHAPE, 2, num_slots=32, segment_len=C)
    dataplane = DataPlaneConfig(max_q_rows=128, max_kv_rows=128)  # the default timeout
    with MPCluster(config, dataplane, backend="cpu") as cluster:
        h = Harness(2, C, 32, backend="cpu")
        h.cluster = cluster.reset(config, "cpu")
        ids = {r: tokens(50 + k, 4 * C + 3) for k, r in enumerate(("a", "b"))}
        assert h.step([[tl.Chunk("a", ids["a"], 0)], [tl.Chunk("b", ids["b"], 0)]]) <= 1e-5
        target = ("query", 1)
        pid, endpoint = cluster.pids[target], cluster.endpoints[target]
        before = cluster.engine_stats()[target]
        rss_before = _status_bytes(pid, "VmRSS")
        host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
        stop, ctx = threading.Event(), zmq.Context()
        attackers = [
            threading.Thread(target=_zmq_flood, args=(ctx, endpoint, stop)),
            threading.Thread(target=_raw_frames, args=(host, int(port), NUM_RAW_FRAMES, stop)),
        ]
        for t in attackers:
            t.start()
        slowest, served, step = 0.0, 0, 0
        started = set(ids)
        try:
            deadline = time.monotonic() + FLOOD_S
            while time.monotonic() < deadline or any(t.is_alive() for t in attackers[1:]):
                step += 1
                t0 = time.monotonic()
                chunks = []
                for rid in list(ids):
                    if (
                        len(ids[rid]) >= MAX_REQUEST_TOKENS
                    ):  # a new request, so the pool never fills
                        h.pool.finish(rid)
                        del ids[rid]
                        rid = f"{rid}'"
                        ids[rid] = tokens(step, 4 * C + 3)
                    ids[rid] = np.append(ids[rid], step % 991)
                    start = h.pool.num_stored_tokens(rid) if rid in started else 0
                    started.add(rid)
                    chunks.append([tl.Chunk(rid, ids[rid], start)])
                assert h.step(chunks) <= 1e-5
                assert set(cluster.engine_stats()) >= {target}
                slowest = max(slowest, time.monotonic() - t0)
                served += 1
                if step > 2000:  # bounded
                    break
        finally:
            stop.set()
            for t in attackers:
                t.join(60)
            ctx.destroy(linger=0)
        time.sleep(0.5)  # the last refused connections are torn down
        after = cluster.engine_stats()[target]
        rss_after, rss_peak = _status_bytes(pid, "VmRSS"), _status_bytes(pid, "VmHWM")
        refused = after.get("refused_handshakes", 0) - before.get("refused_handshakes", 0)
        growth = rss_after - rss_before
        print(
            f"\nflood at {target}: {served} real iterations served (slowest "
            f"{slowest:.3f} s, timeout {dataplane.timeout_s:g} s); {refused} connections "
            f"refused at the handshake; resident memory {rss_before / MIB:.1f} -> "
            f"{rss_after / MIB:.1f} MiB (growth {growth / MIB:+.1f} MiB, peak "
            f"{rss_peak / MIB:.1f} MiB)"
        )
        assert refused >= 2 and served >= 1
        assert after.get("errors", 0) == before.get("errors", 0)
        assert growth < GROWTH_BOUND, growth
        assert cluster.failures() == []  # the engine lives on
