"""Authenticated control traffic: one per-cluster secret, an HMAC with a nonce on every frame.

Whoever starts the engines creates the secret (:meth:`ClusterSecret.generate`) and hands it
to every process of the cluster as a file of mode 0600 (:meth:`ClusterSecret.write`), whose
path may travel in the environment (``TOKENLAKE_SECRET_FILE``) or a spawn spec — never the
secret itself on a command line or in a log (its ``repr`` is hidden).

Frame layout (every ZeroMQ frame between processes of a cluster)::

    b"TL" | sender id (8 bytes) | counter (8 bytes, big endian) | HMAC-SHA256 (32) | body

The tag covers everything before and after it, and the frame's *audience*: the receiver's
endpoint for a request, the requester's sender id for a reply; so a frame captured on its
way to one engine does not verify at another. A receiver drops a frame whose tag does not
verify, and a replay: per sender id, counters must strictly increase (each sender's frames
to one receiver travel over one ordered connection).

Below the frames, an engine's socket admits only peers that hold the secret: it is a CURVE
server whose key pair is derived from the secret (:meth:`FrameAuth.curve_server`), and only
a client that knows its public key, which never travels, completes the handshake
(:meth:`FrameAuth.curve_client`). ZeroMQ buffers a whole multipart message before anyone
sees its first frame; this way nothing an outsider sends is buffered past one frame of the
handshake, and an outsider's flood never reaches the engine's loop.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
from collections import OrderedDict
from collections.abc import Mapping

import zmq
from zmq.utils import z85

from tokenlake.errors import InvalidArgumentError, TokenLakeError

SECRET_ENV = "TOKENLAKE_SECRET_FILE"
_MAGIC = b"TL"
_HEAD = struct.Struct(">2s8sQ")
_TAG_LEN = 32
_MIN_KEY = 16
_MAX_SENDERS = 4096


class AuthError(TokenLakeError):
    """A frame that is not authentic (bad tag, replayed, malformed)."""


def read_private_file(path: str, what: str, max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the file at ``path`` (a secret). Raises
    ``InvalidArgumentError`` naming ``what`` unless it is a regular file of this user that
    nobody else may read or write (mode 0600 or stricter; a symbolic link is refused)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise InvalidArgumentError(f"{what}: cannot open {path!r} ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or st.st_uid != os.getuid():
        os.close(fd)
        raise InvalidArgumentError(
            f"{what}: {path!r} must be a regular file of this user with mode 0600, "
            f"got mode {oct(st.st_mode & 0o777)}"
        )
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes)


class ClusterSecret:
    """The cluster's shared key. Never printed; stored only in 0600 files."""

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) < _MIN_KEY:
            raise InvalidArgumentError(f"key: expected at least {_MIN_KEY} bytes")
        self._key = key

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    @property
    def key(self) -> bytes:
        return self._key

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_bytes(32))

    def write(self, path: str) -> None:
        """Create ``path`` (it must not exist) with mode 0600 holding the key."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self._key.hex().encode())

    @classmethod
    def from_file(cls, path: str) -> ClusterSecret:
        """Read a key file; refuses one that others can read or that another user owns."""
        text = read_private_file(path, "secret file", 1024).strip()
        try:
            return cls(bytes.fromhex(text.decode()))
        except (ValueError, UnicodeDecodeError):
            raise InvalidArgumentError(f"secret file: {path!r} does not hold a hex key") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClusterSecret | None:
        """The key in the file named by ``TOKENLAKE_SECRET_FILE``, or ``None`` if unset."""
        path = (os.environ if environ is None else environ).get(SECRET_ENV)
        return cls.from_file(path) if path else None


class FrameAuth:
    """Seals outgoing frames and opens incoming ones for one process (one sender id)."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._key = secret.key
        self.sender = secrets.token_bytes(8)
        self._counter = 0
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._curve: dict[str, tuple[bytes, bytes]] = {}

    def _curve_pair(self, side: str) -> tuple[bytes, bytes]:
        """``(secret, public)`` CURVE keys of ``side`` (z85), derived from the secret."""
        if side not in self._curve:
            seed = hmac.new(self._key, f"tokenlake curve {side}".encode(), hashlib.sha256)
            secret = z85.encode(seed.digest())
            self._curve[side] = (secret, zmq.curve_public(secret))
        return self._curve[side]

    def curve_server(self, sock: zmq.Socket) -> None:
        """Admit only peers holding the secret to ``sock`` (before it binds)."""
        secret, public = self._curve_pair("server")
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_server = True

    def curve_client(self, sock: zmq.Socket) -> None:
        """Let ``sock`` (before it connects) pass a :meth:`curve_server` socket's handshake."""
        secret, public = self._curve_pair("client")
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_serverkey = self._curve_pair("server")[1]

    def seal(self, body: bytes, audience: bytes = b"") -> bytes:
        """``body`` sealed for ``audience`` (who alone may open it)."""
        self._counter += 1
        head = _HEAD.pack(_MAGIC, self.sender, self._counter)
        return head + self._tag(head, body, audience) + body

    def _tag(self, head: bytes, body: bytes, audience: bytes) -> bytes:
        mac = hmac.new(self._key, head, hashlib.sha256)
        mac.update(len(audience).to_bytes(2, "big") + audience)
        mac.update(body)
        return mac.digest()

    @staticmethod
    def sender_of(frame: bytes) -> bytes:
        """The sender id of a frame (to address a reply); meaningful once it was opened."""
        return frame[2:10]

    def open(self, frame: bytes, audience: bytes = b"") -> bytes:
        """The body of an authentic, fresh frame sealed for ``audience``; :class:`AuthError`
        otherwise."""
        if not isinstance(frame, bytes) or len(frame) < _HEAD.size + _TAG_LEN:
            raise AuthError("frame: too short to be authenticated")
        head, tag = frame[: _HEAD.size], frame[_HEAD.size : _HEAD.size + _TAG_LEN]
        body = frame[_HEAD.size + _TAG_LEN :]
        magic, sender, counter = _HEAD.unpack(head)
        if magic != _MAGIC:
            raise AuthError("frame: not a TokenLake frame")
        if not hmac.compare_digest(tag, self._tag(head, body, audience)):
            raise AuthError("frame: authentication failed")
        if counter <= self._seen.get(sender, 0):
            raise AuthError("frame: replayed")
        self._seen[sender] = counter
        self._seen.move_to_end(sender)
        while len(self._seen) > _MAX_SENDERS:
            self._seen.popitem(last=False)
        return body
