"""Peer processes and their liveness: who launched an engine (so it ends with its launcher),
free ports, and :class:`LinkMonitor`, which sees a peer process die from its closed sockets
long before any timeout."""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq

PeerKey = tuple[str, int]  # (role, instance_id)


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


@dataclass(frozen=True)
class LauncherId:
    """A process identified by pid and start time (a pid alone may be reused): the process
    that started an engine, so the engine ends when it is gone (no orphans), or a started
    process whose life is read here rather than from whoever forked it."""

    pid: int
    start_time: int | None

    @classmethod
    def this_process(cls) -> LauncherId:
        return cls.of(os.getpid())

    @classmethod
    def of(cls, pid: int) -> LauncherId:
        """Process ``pid`` as it runs now (never alive if it is already gone)."""
        return cls(pid, _start_time(pid))

    def alive(self) -> bool:
        return self.start_time is not None and _start_time(self.pid) == self.start_time


def bind_random(sock: zmq.Socket, host: str) -> str:
    """Bind ``sock`` to a free TCP port on ``host``; returns the endpoint."""
    sock.bind(f"tcp://{host}:0")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class LinkMonitor:
    """Whether peer processes are still there, from the connections to them: a process
    that dies (killed, crashed) has its sockets closed by the kernel, which a ZeroMQ socket
    monitor reports at once, long before any timeout (a lost host is seen by the timeout).

    One silent DEALER per watched peer; a peer whose connection dropped stays down. Use
    from one thread."""

    _EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED

    def __init__(self, ctx: zmq.Context, auth) -> None:
        self._ctx = ctx
        self._auth = auth  # a FrameAuth: the engines admit only the secret's holders
        self._links: dict[PeerKey, tuple[zmq.Socket, zmq.Socket]] = {}
        self._down: set[PeerKey] = set()

    def watch(self, key: PeerKey, endpoint: str) -> None:
        self.forget(key)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._auth.curve_client(sock)
        monitor = sock.get_monitor_socket(self._EVENTS)
        sock.connect(endpoint)
        self._links[key] = (sock, monitor)

    def forget(self, key: PeerKey) -> None:
        link = self._links.pop(key, None)
        if link is not None:
            sock, monitor = link
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        self._down.discard(key)

    def is_alive(self, key: PeerKey) -> bool:
        """False once ``key``'s connection dropped (unwatched keys are alive)."""
        self.poll()
        return key not in self._down

    def poll(self) -> set[PeerKey]:
        """Read pending events; returns every peer seen down so far."""
        from zmq.utils.monitor import recv_monitor_message

        for key, (_, monitor) in self._links.items():
            while key not in self._down:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._down.add(key)
        return set(self._down)

    def close(self) -> None:
        for key in list(self._links):
            self.forget(key)
