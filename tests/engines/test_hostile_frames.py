"""A seeded barrage of forged, malformed and unauthenticated frames against live engines:
none is executed (every instance's memory is bit-identical afterwards, no request succeeds),
none kills an engine, each is counted where it was stopped, and the cluster still computes
exact attention afterwards. Prints the figures."""

from __future__ import annotations

import hashlib

import msgpack
import numpy as np
import pytest
import zmq
from engine_helpers import SHAPE, child_pids, shm_entries
from harness import Harness, tokens

import tokenlake as tl
from tokenlake.engines.clusters.mp import MPCluster
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.transport import messages
from tokenlake.engines.transport.auth import ClusterSecret, FrameAuth

NUM_FRAMES = 72
SLOTS, C = 32, 16


def _i32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def _raw(payload: dict) -> bytes:
    return msgpack.packb(payload, use_bin_type=True)


def _stop_payload() -> dict:
    return msgpack.unpackb(messages.encode(messages.Stop(1)), raw=False)


def _templates(rng: np.random.Generator, max_rows: int):
    """``(kind, role, body)``: kind says where the frame must be stopped."""
    far = int(rng.integers(SLOTS, 10**6))
    neg = -int(rng.integers(1, 10**6))
    good_bq = dict(
        origin=0, epoch=1, binding=1, q_offset=0, rows=_i32([0, 1]), q_indptr=_i32([0, 2]),
        kv_indptr=_i32([0, 1]), kv_indices=_i32([3]), last_len=_i32([5]),
    )  # fmt: skip

    def bq(**change):
        return messages.BindQuery(1, **{**good_bq, **change})

    def bp(slot, offset, length):
        return messages.BindPut(1, 0, 1, 1, _i32([0]), _i32([length]), _i32([slot]), _i32([offset]))

    cfg = dict(
        num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
        num_slots=SLOTS, segment_len=C, max_q_rows=max_rows, max_kv_rows=max_rows, backend="",
    )  # fmt: skip
    stop = _stop_payload()
    return [
        ("unauthenticated", "query", ("random", rng.bytes(int(rng.integers(0, 300))))),
        ("unauthenticated", "transfer", ("plain", messages.encode(messages.Stop(1)))),
        ("unauthenticated", "query", ("wrong_key", messages.encode(messages.Configure(1, **cfg)))),
        ("unauthenticated", "query", ("tampered", messages.encode(messages.Stop(1)))),
        ("malformed", "query", ("multipart", b"x")),
        ("undecodable", "query", ("sealed", _raw({**stop, "v": 1}))),
        ("undecodable", "transfer", ("sealed", _raw({"v": messages.VERSION, "t": [1]}))),
        ("undecodable", "query", ("sealed", _raw({**stop, "t": "Exec"}))),
        ("undecodable", "query", ("sealed", _raw({**stop, "f": {"seq": True}}))),
        ("undecodable", "transfer", ("sealed", _raw({**stop, "f": {"seq": 1, "evil": 2}}))),
        ("undecodable", "query", ("sealed", _raw({**stop, "f": {"seq": 1.5}}))),
        ("undecodable", "transfer", ("sealed", messages.encode(messages.Stats(2**64 - 1)))),
        ("undecodable", "query", ("sealed", rng.bytes(int(rng.integers(1, 64))) + b"\xc1")),
        ("out_of_range", "transfer", ("sealed", messages.encode(bp(neg % -SLOTS - 1, 0, 1)))),
        ("out_of_range", "transfer", ("sealed", messages.encode(bp(far, 0, 1)))),
        ("out_of_range", "transfer", ("sealed", messages.encode(bp(0, C - 1, 2)))),
        ("out_of_range", "transfer", ("sealed", messages.encode(messages.CopyLocal(
            1, _i32([0]), _i32([0]), _i32([1]), _i32([10**6]))))),
        ("out_of_range", "transfer", ("sealed", messages.encode(messages.CopyLocal(
            1, _i32([7]), _i32([0]), _i32([1]), _i32([1]))))),
        ("out_of_range", "transfer", ("sealed", messages.encode(messages.CopyRemote(
            1, *(_i32([1]),) * 8)))),
        ("out_of_range", "query", ("sealed", messages.encode(bq(q_offset=-1000)))),
        ("out_of_range", "query", ("sealed", messages.encode(bq(kv_indices=_i32([far]))))),
        ("out_of_range", "query", ("sealed", messages.encode(bq(last_len=_i32([0]))))),
        ("out_of_range", "query", ("sealed", messages.encode(bq(kv_indptr=_i32([0, 2]))))),
        ("out_of_range", "query", ("sealed", messages.encode(bq(rows=_i32([0, max_rows]))))),
        ("out_of_range", "query", ("sealed", messages.encode(bq(origin=far)))),
        ("out_of_range", "query", ("sealed", messages.encode(messages.RunQuery(1, 0, far, 0, -1)))),
        ("out_of_range", "query", ("sealed", messages.encode(messages.RunQuery(1, 0, 1, 0, 5)))),
        ("out_of_range", "transfer", ("sealed", messages.encode(messages.Put(1, 0, 1, 0, 3)))),
        ("out_of_range", "query", ("sealed", messages.encode(
            messages.Configure(1, **{**cfg, "num_slots": 1 << 40})))),
        ("out_of_range", "query", ("sealed", messages.encode(
            messages.Configure(1, **{**cfg, "dtype": "int8"})))),
        ("out_of_range", "transfer", ("sealed", messages.encode(
            messages.Configure(1, **{**cfg, "backend": "evil"})))),
        ("out_of_range", "query", ("sealed", messages.encode(
            messages.Configure(1, **{**cfg, "logit_cap": rng.choice([np.nan, -1.0, 1e9])})))),
    ]  # fmt: skip


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _memory(cluster: MPCluster) -> str:
    digest = hashlib.sha256()
    for buffers in cluster.buffers:
        for name in ("pool", "out_o", "out_lse"):
            digest.update(buffers.raw[name].numpy().tobytes())
    return digest.hexdigest()


def test_hostile_frames_are_never_executed_and_never_kill_an_engine():
    pids_before, shm_before = child_pids(), shm_entries()
    config = tl.PoolConfig(SHAPE, 2, num_slots=SLOTS, segment_len=C)
    dataplane = DataPlaneConfig(max_q_rows=128, max_kv_rows=128, timeout_s=20.0)
    rng = np.random.default_rng(1234)
    with MPCluster(config, dataplane, backend="cpu") as cluster:
        h = Harness(2, C, SLOTS, backend="cpu")
        h.cluster = cluster.reset(h.pool.config, "cpu")
        ids = tokens(5, 3 * C + 3)
        assert h.step([[tl.Chunk("r", ids, 0)]]) <= h.tolerance  # some KV to protect
        before_memory, before_stats = _memory(cluster), cluster.engine_stats()
        auth, wrong = FrameAuth(cluster.secret), FrameAuth(ClusterSecret.generate())
        ctx = zmq.Context()
        socks = {}
        for key, endpoint in cluster.endpoints.items():
            socks[key] = ctx.socket(zmq.DEALER)
            socks[key].setsockopt(zmq.LINGER, 0)
            auth.curve_client(socks[key])  # an insider: outsiders never pass the handshake
            socks[key].connect(endpoint)
        sent = {"unauthenticated": 1, "malformed": 0, "undecodable": 0, "out_of_range": 0}
        answered, executed = 0, 0
        # a replayed frame: an authentic Stats request, answered once, then replayed
        stats_frame = auth.seal(
            messages.encode(messages.Stats(7)), cluster.endpoints[("query", 0)].encode()
        )
        socks[("query", 0)].send(stats_frame)
        assert socks[("query", 0)].poll(20_000)
        socks[("query", 0)].recv()
        # a frame sealed for one engine does not verify at another
        socks[("query", 1)].send(auth.seal(messages.encode(messages.Stop(1)), b"elsewhere"))
        for k in range(NUM_FRAMES):
            templates = _templates(rng, dataplane.max_q_rows)
            kind, role, (how, body) = templates[int(rng.integers(len(templates)))]
            if k % 12 == 0:
                kind, role, how, body = "unauthenticated", "query", "replay", b""
            key = (role, int(rng.integers(2)))
            if how == "replay":  # to the engine it was sealed for, or to another one
                key = ("query", int(rng.integers(2)))
            sock, audience = socks[key], cluster.endpoints[key].encode()
            if how == "replay":
                sock.send(stats_frame)
            elif how in ("random", "plain"):
                sock.send(body)
            elif how == "wrong_key":
                sock.send(wrong.seal(body, audience))
            elif how == "tampered":
                frame = bytearray(auth.seal(body, audience))
                frame[-1] ^= 0x5A
                sock.send(bytes(frame))
            elif how == "multipart":
                sock.send_multipart([auth.seal(messages.encode(messages.Stop(1)), audience), b"x"])
            else:
                sock.send(auth.seal(body, audience))
            sent[kind] += 1
            if kind in ("undecodable", "out_of_range"):  # answered, with an error
                assert sock.poll(20_000), f"no answer to frame {k} ({kind})"
                reply = messages.decode(auth.open(sock.recv(), auth.sender))
                answered += 1
                executed += int(reply.ok)
        for key, sock in socks.items():
            if sock.poll(300):  # nothing else may be answered
                raise AssertionError(
                    f"{key}: {messages.decode(auth.open(sock.recv(), auth.sender))}"
                )
            sock.close()
        ctx.term()
        alive = [key for key, pid in cluster.pids.items() if _running(pid)]
        deaths = len(cluster.pids) - len(alive)
        after = cluster.engine_stats()
        delta = {
            name: sum(after[k].get(name, 0) - before_stats[k].get(name, 0) for k in cluster.pids)
            for name in ("unauthenticated_frames", "malformed_frames", "rejected_frames", "errors")
        }
        total = sum(sent.values())
        print(
            f"\nhostile frames: {total} sent ({sent['unauthenticated']} unauthenticated or "
            f"replayed, {sent['malformed']} malformed, {sent['undecodable']} undecodable, "
            f"{sent['out_of_range']} out of range): {executed} executed, {deaths} engine deaths; "
            f"counted {delta}"
        )
        assert total >= 50 and executed == 0 and deaths == 0
        assert _memory(cluster) == before_memory
        assert delta == {
            "unauthenticated_frames": sent["unauthenticated"],
            "malformed_frames": sent["malformed"],
            "rejected_frames": sent["undecodable"],
            "errors": sent["out_of_range"],
        }
        assert answered == sent["undecodable"] + sent["out_of_range"]
        # the engines still serve, exactly
        ids = np.append(ids, 1)
        assert h.step([[tl.Chunk("r", ids, len(ids) - 1)]]) <= h.tolerance
    assert child_pids() <= pids_before and shm_entries() <= shm_before


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-s"])


def test_a_request_number_past_signed_64_bits_is_refused():
    """An authentic ``Stats(seq=2**64-1)`` is not a message (counters are signed 64-bit)."""
    with pytest.raises(messages.ProtocolError, match="seq"):
        messages.decode(messages.encode(messages.Stats(2**64 - 1)))
    assert messages.decode(messages.encode(messages.Stats(7))) == messages.Stats(7)
