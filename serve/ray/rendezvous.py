"""How a launch's processes find each other, all through Ray and this driver (no typed
addresses): every engine announces its socket on the driver's ready socket (sealed with
the cluster secret; anything else is dropped), and the driver joins the point-to-point
group as rank 0 on a thread while the actors join through the authenticated store."""

from __future__ import annotations

import threading
import time

import numpy as np
import ray
import zmq

from tokenlake.engines.dataplane_config import PeerFailedError
from tokenlake.engines.transport import messages, process_group
from tokenlake.engines.transport.auth import AuthError, FrameAuth
from tokenlake.engines.transport.peers import bind_random
from tokenlake.wire import WireError


class ReadyInbox:
    """The driver's ready socket: engines started by ``serve`` calls report their endpoints
    here. ``endpoint`` is what the actors are told."""

    def __init__(self, ctx: zmq.Context, host: str, auth: FrameAuth) -> None:
        self._auth = auth
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = bind_random(self._sock, host)

    def collect(self, keys: list, serving: dict, deadline: float) -> dict:
        """The endpoints of the processes ``keys`` (``(role, instance_id)``) by key, once all
        reported; ``serving[key]`` is the process's ``serve`` reference, whose end means it
        exited. Raises :class:`PeerFailedError` for an early exit or at ``deadline``."""
        found = {}
        audience = self.endpoint.encode()
        while len(found) < len(keys):
            for key in keys:
                ref = serving[key]
                done, _ = ray.wait([ref], timeout=0)
                if done and key not in found:
                    err = error_of(ref)
                    raise PeerFailedError(key[1], key[0], f"exited at start-up: {err}")
            if time.monotonic() > deadline:
                missing = sorted(set(keys) - set(found))
                raise PeerFailedError(missing[0][1], missing[0][0], "not ready in time")
            if self._sock.poll(100):
                try:
                    msg = messages.decode(self._auth.open(self._sock.recv(), audience))
                except (AuthError, WireError):
                    continue  # not one of ours: dropped
                if (msg.role, msg.instance_id) in keys:
                    found[(msg.role, msg.instance_id)] = msg.endpoint
        return found

    def close(self) -> None:
        self._sock.close(linger=0)


class GroupJoiner(threading.Thread):
    """Joins the group ``spec`` as rank 0 on a thread: joining blocks until every rank
    joined, and the others join only once told to serve. Then ``group`` or ``error``."""

    def __init__(self, spec: process_group.GroupSpec, secret) -> None:
        super().__init__(name="tokenlake-group-join", daemon=True)
        self.spec, self.store = spec, process_group.make_store(spec, secret)
        self.group = self.error = None
        self.start()

    def run(self) -> None:
        try:
            self.group = process_group.connect(self.spec, self.store, process_group.DRIVER_RANK)
        except Exception as e:  # reported by the caller
            self.error = e


def regroup_message(seq: int, generation: int, endpoints: dict, instances: list[int]):
    """The :class:`messages.Regroup` telling a live process that ``instances`` rejoined
    (their query and transfer engines at ``endpoints[(role, i)]``)."""
    ids = sorted(instances)
    return messages.Regroup(
        seq, generation, np.asarray(ids, dtype=np.int32),
        tuple(endpoints[("query", i)] for i in ids), tuple(endpoints[("transfer", i)] for i in ids),
    )  # fmt: skip


def error_of(ref) -> BaseException | None:
    """The exception a finished Ray reference holds (``None``: it succeeded)."""
    try:
        ray.get(ref, timeout=0)
    except Exception as e:
        return e
    return None
