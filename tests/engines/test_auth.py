"""The cluster secret and frame authentication: 0600 key files only, never printed; a frame
verifies only with the key, untampered, and once; the rendezvous store answers only
authentic requests."""

from __future__ import annotations

import os
import time

import pytest
import zmq

from tokenlake import wire
from tokenlake.engines.transport.auth import SECRET_ENV, AuthError, ClusterSecret, FrameAuth
from tokenlake.engines.transport.auth_store import AuthStore, StoreServer
from tokenlake.errors import InvalidArgumentError


def test_secret_files_are_private_and_the_key_is_never_printed(tmp_path):
    secret = ClusterSecret.generate()
    path = str(tmp_path / "key")
    secret.write(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert ClusterSecret.from_file(path).key == secret.key
    assert ClusterSecret.from_env({SECRET_ENV: path}).key == secret.key
    assert ClusterSecret.from_env({}) is None
    assert secret.key.hex() not in repr(secret) and secret.key.hex() not in str(secret)
    with pytest.raises(FileExistsError):
        secret.write(path)  # never overwrites
    os.chmod(path, 0o644)
    with pytest.raises(InvalidArgumentError, match="0600"):
        ClusterSecret.from_file(path)
    with pytest.raises(InvalidArgumentError, match="key"):
        ClusterSecret(b"short")


def test_frames_verify_once_with_the_key_only():
    secret = ClusterSecret.generate()
    alice, bob = FrameAuth(secret), FrameAuth(secret)
    frame = alice.seal(b"hello")
    assert bob.open(frame) == b"hello"
    with pytest.raises(AuthError, match="replayed"):
        bob.open(frame)
    later = alice.seal(b"again")
    assert bob.open(later) == b"again"
    addressed = alice.seal(b"to carol", b"carol")
    with pytest.raises(AuthError, match="failed"):
        FrameAuth(secret).open(addressed, b"dave")  # sealed for another receiver
    assert FrameAuth(secret).open(addressed, b"carol") == b"to carol"
    mallory = FrameAuth(ClusterSecret.generate())
    for bad in (
        mallory.seal(b"hello"),
        frame[:-1] + bytes([frame[-1] ^ 1]),  # body tampered
        frame[:5] + bytes([frame[5] ^ 1]) + frame[6:],  # sender tampered
        b"",
        b"TL" + b"\0" * 10,
        b"XX" + alice.seal(b"x")[2:],
    ):
        with pytest.raises(AuthError):
            FrameAuth(secret).open(bad)


def test_store_answers_authentic_requests_only():
    secret = ClusterSecret.generate()
    server = StoreServer(secret, "127.0.0.1")
    store = AuthStore(server.endpoint, secret, timeout_s=10.0)
    try:
        store.set("k", b"v")
        assert store.get("k") == b"v" and store.add("n", 3) == 3 and store.check(["k"])
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.endpoint)
        forged = FrameAuth(ClusterSecret.generate()).seal(
            wire.packb([1, "get", "k"]), server.endpoint.encode()
        )
        for frame in (forged, wire.packb([1, "get", "k"]), b"\xc1"):
            sock.send(frame)
        assert sock.poll(500) == 0  # no answer, no oracle
        sock.send_multipart([b"a", b"b"])
        assert store.get("k") == b"v"  # still serving
        # the two sockets' frames are not ordered with each other: wait (bounded) for the last
        deadline = time.monotonic() + 5.0
        while server.rejected < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.rejected == 4
        sock.close()
        ctx.term()
    finally:
        store.close()
        server.close()
