"""The rendezvous store of the point-to-point group, behind the cluster secret: the
replacement of torch's ``TCPStore`` (which anyone who reaches its port may read and write).

:class:`StoreServer` runs on a daemon thread of the launching process and answers
authenticated requests (:class:`~tokenlake.engines.transport.auth.FrameAuth`) on a ZeroMQ socket;
:class:`AuthStore` is the ``torch.distributed.Store`` every rank passes to its process
group. Unauthenticated or malformed frames are dropped and counted.
"""

from __future__ import annotations

import datetime
import threading
import time

import torch.distributed as dist
import zmq

from tokenlake import wire
from tokenlake.engines.transport.auth import AuthError, ClusterSecret, FrameAuth
from tokenlake.engines.transport.peers import bind_random

_MAX_FRAME = 1 << 24


class StoreServer:
    """A key-value store served on ``endpoint`` until :meth:`close`."""

    def __init__(self, secret: ClusterSecret, host: str) -> None:
        self._auth = FrameAuth(secret)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME)
        self.endpoint = bind_random(self._sock, host)
        self._audience = self.endpoint.encode()
        self.rejected = 0
        self._data: dict[str, bytes] = {}
        self._waiting: list[tuple[tuple, int, str]] = []  # (identity, seq, key) of gets
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="tokenlake-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(100):
                continue
            frames = self._sock.recv_multipart()
            try:
                if len(frames) != 2:
                    raise AuthError("frame: expected one frame")
                request = wire.unpackb(self._auth.open(frames[1], self._audience), _MAX_FRAME)
                if not isinstance(request, list) or len(request) < 2:
                    raise AuthError("request: malformed")
                self._handle((frames[0], FrameAuth.sender_of(frames[1])), request)
            except Exception:  # hostile or broken input: dropped, counted, never fatal
                self.rejected += 1

    def _handle(self, identity: tuple[bytes, bytes], request: list) -> None:
        seq, op, args = request[0], request[1], request[2:]
        data = self._data
        if op == "set":
            data[str(args[0])] = bytes(args[1])
            ready = [w for w in self._waiting if w[2] in data]
            self._waiting = [w for w in self._waiting if w[2] not in data]
            for ident, s, key in ready:
                self._reply(ident, s, data[key])
            result = None
        elif op == "get":
            key = str(args[0])
            if key not in data:
                self._waiting.append((identity, seq, key))
                return
            result = data[key]
        elif op == "add":
            key = str(args[0])
            value = int(data.get(key, b"0")) + int(args[1])
            data[key] = str(value).encode()
            result = value
        elif op == "check":
            result = all(str(k) in data for k in args[0])
        elif op == "delete":
            result = data.pop(str(args[0]), None) is not None
        elif op == "num_keys":
            result = len(data)
        elif op == "compare_set":
            key, expected, desired = str(args[0]), bytes(args[1]), bytes(args[2])
            current = data.get(key)
            if (current is None and not expected) or current == expected:
                data[key] = desired
                result = desired
            else:
                result = current if current is not None else expected
        else:
            raise AuthError(f"request: unknown operation {op!r}")
        self._reply(identity, seq, result)

    def _reply(self, identity: tuple[bytes, bytes], seq: int, result: object) -> None:
        """``identity``: the requester's socket identity and sender id."""
        frame = self._auth.seal(wire.packb([seq, result]), identity[1])
        self._sock.send_multipart([identity[0], frame])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close(linger=0)
        self._ctx.term()


class AuthStore(dist.Store):
    """A ``torch.distributed.Store`` talking to a :class:`StoreServer`; every wait is
    bounded by ``timeout_s``."""

    def __init__(self, endpoint: str, secret: ClusterSecret, timeout_s: float) -> None:
        super().__init__()
        self._auth = FrameAuth(secret)
        self._timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._audience = endpoint.encode()
        self._lock = threading.Lock()
        self._seq = 0

    def _call(self, op: str, *args, timeout_s: float | None = None) -> object:
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._sock.send(self._auth.seal(wire.packb([seq, op, *args]), self._audience))
            deadline = time.monotonic() + (timeout_s or self._timeout_s)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(max(1, int(left * 1000))):
                    raise TimeoutError(f"store: no answer to {op} within {self._timeout_s:g} s")
                try:
                    frame = self._sock.recv()
                    reply = wire.unpackb(self._auth.open(frame, self._auth.sender), _MAX_FRAME)
                except (AuthError, wire.WireError):
                    continue  # not from our server: ignored
                if isinstance(reply, list) and len(reply) == 2 and reply[0] == seq:
                    return reply[1]

    def set(self, key: str, value) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, int(amount))

    def compare_set(self, key: str, expected, desired) -> bytes:
        enc = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        return self._call("compare_set", key, enc(expected), enc(desired))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = timeout.total_seconds() if timeout is not None else None
        for key in keys:
            self._call("get", key, timeout_s=seconds)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", key))

    def num_keys(self) -> int:
        return int(self._call("num_keys"))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
