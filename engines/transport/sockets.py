"""Control-message transports. Over ZeroMQ: the caller side (:class:`Requester`) and the
engine side (:class:`Server`); every wait is bounded in time, and a peer whose process has
exited fails its waiters at once instead of at the timeout; every frame is sealed and
checked with the cluster secret (:mod:`tokenlake.engines.transport.auth`), and the engine's loop
survives any input: a frame that is not authentic is dropped and counted, one that does not
decode is answered and counted. In one process: :class:`LocalChannel`, which hands the same
messages to the same engine objects. Both answer every request through :func:`dispatch`."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

import zmq

from tokenlake.engines.dataplane_config import PeerFailedError, RemoteEngineError
from tokenlake.engines.transport import messages
from tokenlake.engines.transport.auth import AuthError, FrameAuth
from tokenlake.engines.transport.peers import LauncherId, PeerKey, bind_random
from tokenlake.latency import observe
from tokenlake.wire import WireError


class Requester:
    """The caller's sockets to every engine: one DEALER per engine, replies matched by ``seq``.

    ``is_alive(key)`` tells whether an engine's process still runs. Replies that nobody
    waits for any more (after a failure) are dropped.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        timeout_s: float,
        poll_interval_s: float,
        is_alive: Callable[[PeerKey], bool],
        auth: FrameAuth,
    ) -> None:
        self._ctx = ctx
        self._auth = auth
        self.stats: Counter = Counter()
        self._timeout_s = timeout_s
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._is_alive = is_alive
        self._sockets: dict[PeerKey, zmq.Socket] = {}
        self._audience: dict[PeerKey, bytes] = {}
        self._keys: dict[zmq.Socket, PeerKey] = {}
        self._poller = zmq.Poller()
        self._next_seq = 1
        self._outstanding: set[tuple[PeerKey, int]] = set()
        self._replies: dict[tuple[PeerKey, int], messages.Reply] = {}

    def connect(self, key: PeerKey, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._auth.curve_client(sock)
        sock.connect(endpoint)
        self._audience[key] = endpoint.encode()
        self._sockets[key] = sock
        self._keys[sock] = key
        self._poller.register(sock, zmq.POLLIN)

    def disconnect(self, key: PeerKey) -> None:
        sock = self._sockets.pop(key, None)
        if sock is not None:
            self._poller.unregister(sock)
            del self._keys[sock]
            sock.close(linger=0)
        self._outstanding = {t for t in self._outstanding if t[0] != key}
        self._replies = {t: r for t, r in self._replies.items() if t[0] != key}

    def close(self) -> None:
        for key in list(self._sockets):
            self.disconnect(key)

    @property
    def keys(self) -> list[PeerKey]:
        return list(self._sockets)

    def new_seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def send(self, key: PeerKey, message: object) -> tuple[PeerKey, int]:
        """Send a request (a message with a ``seq`` from :meth:`new_seq`); returns its ticket."""
        sock = self._sockets.get(key)
        if sock is None:
            raise PeerFailedError(key[1], key[0], "marked lost; not reachable")
        sock.send(self._auth.seal(messages.encode(message), self._audience[key]))
        ticket = (key, message.seq)
        self._outstanding.add(ticket)
        return ticket

    def request(self, key: PeerKey, make: Callable[[int], object]) -> tuple[PeerKey, int]:
        """``send(key, make(seq))`` with a fresh ``seq``."""
        return self.send(key, make(self.new_seq()))

    def outstanding(self, key: PeerKey | None = None) -> list[tuple[PeerKey, int]]:
        return [t for t in self._outstanding if key is None or t[0] == key]

    def wait(
        self,
        tickets: Iterable[tuple[PeerKey, int]],
        what: str,
        others: Callable[[], int] | None = None,
    ) -> list[bytes]:
        """Wait until every ticket is answered (and ``others()``, polled alongside, returns 0
        things pending). Raises :class:`PeerFailedError` when a peer's process exits or does
        not answer within the timeout, :class:`RemoteEngineError` when an engine answered
        with an error. The tickets are forgotten either way. Returns the replies' payloads in
        ticket order."""
        tickets = list(tickets)
        pending = set(tickets)
        answered: dict = {}
        deadline = time.monotonic() + self._timeout_s
        try:
            while True:
                self._collect(pending, answered)
                busy = others() if others is not None else 0
                if not pending and not busy:
                    return [answered.get(t, b"") for t in tickets]
                for key in sorted({k for k, _ in pending}):
                    if key not in self._sockets or not self._is_alive(key):
                        raise PeerFailedError(key[1], key[0], f"process exited during {what}")
                left = deadline - time.monotonic()
                if left <= 0:
                    if not pending:  # the caller's others() names its own laggard
                        return [answered.get(t, b"") for t in tickets]
                    key = min(k for k, _ in pending)
                    raise PeerFailedError(
                        key[1], key[0], f"no answer to {what} within {self._timeout_s:g} s"
                    )
                # point-to-point works complete without a socket event: poll them often
                poll_ms = 1 if busy else min(self._poll_ms, max(1, int(left * 1000)))
                self._poller.poll(poll_ms)
        finally:
            self._outstanding -= set(tickets)
            for t in tickets:
                self._replies.pop(t, None)

    def _collect(self, pending: set, answered: dict) -> None:
        """Drain every socket without blocking; remove answered tickets from ``pending``."""
        for sock, key in list(self._keys.items()):
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    reply = messages.decode(self._auth.open(data, self._auth.sender))
                except (AuthError, WireError):
                    self.stats["rejected_replies"] += 1
                    continue
                if not isinstance(reply, messages.Reply):
                    self.stats["rejected_replies"] += 1
                    continue
                ticket = (key, reply.seq)
                if ticket in self._outstanding:
                    self._replies[ticket] = reply
        for ticket in [t for t in pending if t in self._replies]:
            reply = self._replies.pop(ticket)
            pending.discard(ticket)
            answered[ticket] = reply.payload
            if not reply.ok:
                raise RemoteEngineError(f"{ticket[0][0]} engine {ticket[0][1]}: {reply.error}")


class Server:
    """An engine's ROUTER socket. :meth:`serve` runs ``handle(message)`` for each authentic
    request in arrival order and answers with a :class:`messages.Reply`; it returns after a
    :class:`messages.Stop`, or when the launching process is gone (no orphans). Nothing a
    peer sends ends the loop.

    Only peers holding the cluster secret pass the socket's CURVE handshake
    (:meth:`FrameAuth.curve_server`): ZeroMQ drops anyone else's connection before it
    buffers more than one frame of the handshake (at most ``MAXMSGSIZE`` bytes per
    connection, freed at once), and within ``HANDSHAKE_IVL`` if it stays silent, so an
    outsider's flood costs this loop nothing; each refused handshake is counted
    (``refused_handshakes``, and as ``unauthenticated_frames``: what it sent was never
    read)."""

    _HANDSHAKE_MS = 5000
    _REFUSED = (
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )

    def __init__(self, ctx: zmq.Context, host: str, auth: FrameAuth) -> None:
        self._auth = auth
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, messages.MAX_FRAME_BYTES + 4096)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, self._HANDSHAKE_MS)
        auth.curve_server(self._sock)
        self._events = self._sock.get_monitor_socket(self._REFUSED)
        self.endpoint = bind_random(self._sock, host)
        self._audience = self.endpoint.encode()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._events, zmq.POLLIN)

    def serve(
        self, handle: Callable[[object], bytes | None], launcher: LauncherId, stats: Counter
    ) -> None:
        while True:
            ready = dict(self._poller.poll(1000))
            if self._events in ready:
                self._count_refused(stats)
            if self._sock not in ready:
                if not launcher.alive():
                    return
                continue
            if self._serve_one(handle, stats):
                return

    def _count_refused(self, stats: Counter) -> None:
        for _ in range(1024):  # bounded: the rest is read at the next wake-up
            try:
                self._events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            stats["refused_handshakes"] += 1
            stats["unauthenticated_frames"] += 1

    def _serve_one(self, handle, stats: Counter) -> bool:
        """Answer one frame; true after a Stop."""
        frames = self._sock.recv_multipart()
        try:
            if len(frames) != 2:
                stats["malformed_frames"] += 1
                return False
            identity, frame = frames
            try:
                body = self._auth.open(frame, self._audience)
            except AuthError:
                stats["unauthenticated_frames"] += 1
                return False
            to = FrameAuth.sender_of(frame)
            try:
                message = messages.decode(body)
            except WireError as e:
                stats["rejected_frames"] += 1
                self._reply(identity, to, messages.Reply(-1, False, str(e)))
                return False
            self._reply(identity, to, dispatch(handle, message, stats))
            return isinstance(message, messages.Stop)
        except Exception:  # never die of input: count it and go on
            stats["internal_errors"] += 1
            return False

    def _reply(self, identity: bytes, to: bytes, reply: messages.Reply) -> None:
        self._sock.send_multipart([identity, self._auth.seal(messages.encode(reply), to)])

    def close(self) -> None:
        self._sock.disable_monitor()
        self._events.close(linger=0)
        self._sock.close(linger=0)


def dispatch(
    handle: Callable[[object], bytes | None], message, stats: Counter | None = None
) -> messages.Reply:
    """Run one request and answer it (with the bytes the handler returns, if any); an error
    is answered and counted, never raised."""
    seq = getattr(message, "seq", -1)
    start = time.perf_counter()
    try:
        payload = handle(message)
        if stats is not None:  # per message type: RunQuery_seconds, Put_seconds, ...
            observe(stats, f"{type(message).__name__}_seconds", time.perf_counter() - start)
        return messages.Reply(seq, True, "", payload or b"")
    except Exception as e:  # reported to the caller, who raises RemoteEngineError
        if stats is not None:
            stats["errors"] += 1
            if isinstance(e, PeerFailedError):
                stats["peer_failures"] += 1
        return messages.Reply(seq, False, f"{type(e).__name__}: {e}")


class LocalChannel:
    """The in-process transport: requests go to engine objects of this process, answered
    at once by :func:`dispatch`, so errors surface exactly as over ZeroMQ."""

    def __init__(self, engines: dict[PeerKey, object]) -> None:
        self._engines = engines
        self._next_seq = 1
        self._replies: dict[tuple[PeerKey, int], messages.Reply] = {}

    @property
    def keys(self) -> list[PeerKey]:
        return list(self._engines)

    def new_seq(self) -> int:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def send(self, key: PeerKey, message: object) -> tuple[PeerKey, int]:
        engine = self._engines.get(key)
        if engine is None:
            raise PeerFailedError(key[1], key[0], "marked lost; not reachable")
        self._replies[(key, message.seq)] = dispatch(engine.handle, message, engine.stats)
        return (key, message.seq)

    def request(self, key: PeerKey, make: Callable[[int], object]) -> tuple[PeerKey, int]:
        return self.send(key, make(self.new_seq()))

    def outstanding(self, key: PeerKey | None = None) -> list[tuple[PeerKey, int]]:
        return []  # every request is answered when sent

    def wait(self, tickets, what: str, others: Callable[[], int] | None = None) -> list[bytes]:
        failed, payloads = None, []
        for ticket in tickets:
            reply = self._replies.pop(ticket, None)
            payloads.append(reply.payload if reply is not None else b"")
            if reply is not None and not reply.ok and failed is None:
                failed = RemoteEngineError(f"{ticket[0][0]} engine {ticket[0][1]}: {reply.error}")
        if failed is not None:
            raise failed
        return payloads

    def disconnect(self, key: PeerKey) -> None:
        self._engines.pop(key, None)

    def close(self) -> None:
        self._engines.clear()
