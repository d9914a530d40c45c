"""One SGLang worker as one instance of a shared pool: the worker's side of
:mod:`.control_service`.

:class:`SharedPoolRuntime` has :class:`.pool_runtime.PoolRuntime`'s interface, so the backend
and its request table do not know which they drive. The control plane is remote (one
request per forward to plan it, one to commit it); the data plane is local: the worker's
engine clients talk to every instance's query and transfer engines (co-processes sharing
the instances' buffers: shared memory on CPU, CUDA IPC on a GPU), and the worker's rows
go through its own instance's buffers. Prefix segments held by other workers are attended
through their query engines, exactly as the in-process data plane does.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time

import numpy as np
import torch
import zmq

from tokenlake import errors, plan_wire, wire
from tokenlake.config import ModelShape
from tokenlake.engines.client.driver import Driver
from tokenlake.engines.clusters.compute_worker import ComputeClients
from tokenlake.engines.dataplane_config import PeerFailedError
from tokenlake.engines.transport.auth import AuthError, ClusterSecret, FrameAuth
from tokenlake.engines.transport.peers import LinkMonitor
from tokenlake.engines.transport.sockets import Requester
from tokenlake.errors import InvalidArgumentError, IterationStateError, TokenLakeError
from tokenlake.plans import Chunk, Plans

from .attach import WorkerAttachment, attachment_from, endpoints_from
from .control_ops import request_prefix
from .pool_runtime import BoundIteration

_MAX_REPLY_BYTES = 1 << 28
_LOCATE_TRIES = 4


class ControlClient:
    """Requests to the control service: sealed, answered in order, each within ``timeout_s``
    in all (a dead or babbling service is an error, never a hang)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, auth: FrameAuth, timeout_s: float) -> None:
        self._auth, self._audience = auth, endpoint.encode()
        self._timeout_ms = int(timeout_s * 1000)
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLY_BYTES + 4096)
        auth.curve_client(self._sock)
        self._sock.connect(endpoint)
        self._seq = itertools.count()

    def call(self, op: str, **args):
        seq = next(self._seq)
        self._sock.send(self._auth.seal(wire.packb({"op": op, "seq": seq, **args}), self._audience))
        deadline = time.monotonic() + self._timeout_ms / 1000
        while self._sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            try:
                reply = wire.unpackb(self._auth.open(self._sock.recv(), self._auth.sender),
                                     _MAX_REPLY_BYTES)  # fmt: skip
            except (AuthError, wire.WireError):
                continue  # not an answer of the service's
            if not isinstance(reply, dict) or reply.get("seq") != seq:
                continue  # a late answer to a request that already timed out
            if reply.get("ok") is True:
                return reply.get("value")
            kind = getattr(errors, str(reply.get("kind")), TokenLakeError)
            if not (isinstance(kind, type) and issubclass(kind, TokenLakeError)):
                kind = TokenLakeError
            raise kind(f"control service: {reply.get('error')}")
        raise PeerFailedError(-1, "control", f"no answer to {op!r} in {self._timeout_ms} ms")

    def close(self) -> None:
        self._sock.close(linger=0)


class SharedPoolRuntime:
    """Worker ``attach.instance_id``'s view of the shared pool (see the module docstring)."""

    @classmethod
    def join(
        cls, endpoint: str, secret_path: str, instance_id: int, timeout_s: float = 10.0,
        kernel_backend: str | None = None,
    ) -> SharedPoolRuntime:  # fmt: skip
        """Join a running host knowing only its service's endpoint, the cluster secret's file
        and this worker's instance: the rest comes from the service (:mod:`.attach`). An
        instance whose worker died comes back empty; one still being dropped is asked for
        again until ``timeout_s``; one a live worker holds is refused by name."""
        ctx = zmq.Context()
        deadline = time.monotonic() + timeout_s
        try:
            client = ControlClient(ctx, endpoint, FrameAuth(ClusterSecret.from_file(secret_path)),
                                   timeout_s)  # fmt: skip
            try:
                while True:
                    try:
                        info = client.call("attach", instance=int(instance_id), pid=os.getpid())
                        break
                    except IterationStateError:  # still being dropped: not for long
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.1)
            finally:
                client.close()
        finally:
            ctx.destroy(linger=0)
        return cls(attachment_from(info, int(instance_id), endpoint, secret_path), kernel_backend)

    def __init__(self, attach: WorkerAttachment, kernel_backend: str | None = None) -> None:
        self.instance_id = attach.instance_id
        self.layout = attach.layout
        self.model: ModelShape = attach.layout.model
        self.kernel_backend = kernel_backend if kernel_backend is not None else attach.backend
        self.request_prefix = request_prefix(attach.instance_id)
        self.max_rows = min(attach.layout.max_q_rows, attach.layout.max_kv_rows)
        cfg = attach.dataplane
        auth = FrameAuth(ClusterSecret.from_file(attach.secret_path))
        self._ctx = zmq.Context()
        self.control = ControlClient(self._ctx, attach.control_endpoint, auth, cfg.timeout_s)
        hello = self.control.call("hello", instance=self.instance_id, pid=os.getpid())
        self._links = LinkMonitor(self._ctx, auth)  # a dead peer fails at once, not at timeout
        requester = Requester(self._ctx, cfg.timeout_s, cfg.poll_interval_s,
                              self._links.is_alive, auth)  # fmt: skip
        for key, endpoint in attach.endpoints.items():
            requester.connect(key, endpoint)
            self._links.watch(key, endpoint)
        self._endpoints = dict(attach.endpoints)
        self._members = int(hello.get("members", 0))  # engine restarts the host had
        n = attach.layout.num_instances
        driver = Driver(cfg, n, requester)
        driver.set_layout(attach.layout, attach.backend)
        driver.views = {i: b.views(attach.layout) for i, b in enumerate(attach.buffers)}
        driver.lost = set(hello["lost"])
        self._driver = driver
        self.clients = ComputeClients(driver, n)
        self.limits = plan_wire.PlanLimits(n, hello["num_slots"], hello["segment_len"])
        self.segment_len = int(hello["segment_len"])
        # one copy of the KV: SGLang's pages are this instance's slots (.one_copy)
        self.engine_slots = bool(hello.get("engine_slots"))
        self._reclaimed: list[int] = []
        self._inflight: BoundIteration | None = None

    @property
    def instance_pool_data(self) -> torch.Tensor:
        """This worker's instance's slots ``[L, S, 2, C, H_kv, D]`` (one copy: SGLang's KV)."""
        return self._driver.views[self.instance_id].pool.data

    # ---- requests ------------------------------------------------------------------------
    def match_len(self, token_ids: np.ndarray) -> int:
        return int(self.control.call("match", tokens=_int32(token_ids)))

    def stored_len(self, pool_id: str) -> int | None:
        return self.control.call("stored", instance=self.instance_id, pool_id=pool_id)

    def finish(self, pool_id: str) -> None:
        self._stash(self.control.call("finish", instance=self.instance_id, pool_id=pool_id))

    # ---- one copy: SGLang's pages are this instance's slots ------------------------------
    def release_slots(self, slots) -> list[int]:
        """SGLang freed these pages' slots: the ones it may reuse now (the pool still reads
        the others; they come back through :meth:`reclaimed`)."""
        return list(self.control.call("release", instance=self.instance_id, slots=_int32(slots)))

    def reclaimed(self) -> list[int]:
        """Slots released earlier that the pool has let go of since (from its replies)."""
        out, self._reclaimed = self._reclaimed, []
        return out

    def _stash(self, reclaimed) -> None:
        if reclaimed:
            self._reclaimed.extend(int(s) for s in reclaimed)

    def read_kv(self, token_ids: np.ndarray, lo: int, hi: int) -> torch.Tensor:
        """K and V of tokens ``lo:hi`` of a held prefix, read from the holders' slots in the
        mapped buffers: ``[num_layers, hi - lo, 2, H_kv, D]``. The placement is asked again
        after the read; a segment evicted or moved meanwhile is read again (bounded)."""
        if self._inflight is not None:
            raise IterationStateError("read_kv: an SGLang forward is in flight")
        tokens = _int32(token_ids[:hi])
        for _ in range(_LOCATE_TRIES):
            where = self.control.call("locate", tokens=tokens, lo=lo, hi=hi)
            out = self._read(where, lo, hi)
            if _same(where, self.control.call("locate", tokens=tokens, lo=lo, hi=hi)):
                return out
        raise IterationStateError(f"read_kv: the placement of tokens {lo}:{hi} kept changing")

    def _read(self, where: dict, lo: int, hi: int) -> torch.Tensor:
        m, c = self.model, self.layout.segment_len
        pairs = np.asarray(where["where"], dtype=np.int64).reshape(-1, 2)
        seg, offset = np.divmod(np.arange(lo, hi), c)
        seg -= int(where["first_segment"])
        out = torch.empty((m.num_layers, hi - lo, 2, m.num_kv_heads, m.head_dim),
                          dtype=m.torch_dtype)  # fmt: skip
        for instance in np.unique(pairs[seg, 0]).tolist():
            rows = np.flatnonzero(pairs[seg, 0] == instance)
            data = self._driver.views[instance].pool.data  # [L, S, 2, C, H_kv, D]
            slot = torch.from_numpy(pairs[seg[rows], 1]).to(data.device)
            off = torch.from_numpy(offset[rows]).to(data.device)
            out[:, torch.from_numpy(rows)] = data[:, slot, :, off].transpose(0, 1).to(out.device)
        return out

    def stats(self) -> dict:
        return self.control.call("stats")

    # ---- one iteration -------------------------------------------------------------------
    @property
    def inflight(self) -> BoundIteration | None:
        return self._inflight

    def begin(self, chunks: list[Chunk], engine_slots=None) -> BoundIteration:
        """Plan ``chunks`` on this worker's instance; ``engine_slots`` (one copy): per chunk,
        the slot of every segment it starts, where SGLang writes it."""
        if self._inflight is not None:
            raise IterationStateError("an SGLang forward is still in flight; commit or abort it")
        encoded = [plan_wire.encode(c) for c in chunks]
        extra = {}
        if engine_slots is not None:
            extra["engine_slots"] = [_int32(s) for s in engine_slots]
        reply = self.control.call("plan", instance=self.instance_id, chunks=encoded, **extra)
        plans = plan_wire.decode(reply["plans"], self.limits, Plans)
        if reply["members"] != self._members:
            self._reconnect(reply["members"])
        try:
            (qp,), (tp,) = plans.query_plans, plans.transfer_plans
            if qp.origin != self.instance_id:
                raise InvalidArgumentError(
                    f"plans: origin {qp.origin}, expected this worker's {self.instance_id}"
                )
            engine = self.clients.engine(qp.origin)
            q_buf, kv_buf = engine.init_query(qp), engine.init_transfer(tp)
        except BaseException:
            self._end("abort", plans.epoch)
            raise
        self._inflight = BoundIteration(plans, qp, q_buf, kv_buf, engine)
        return self._inflight

    def _reconnect(self, members: int) -> None:
        """Some instance's engines restarted (a worker joined a dropped instance again):
        connect to their new endpoints before this forward uses them."""
        info = self.control.call("attach", instance=self.instance_id, pid=os.getpid())
        channel = self._driver.channel
        for key, endpoint in endpoints_from(info, self.layout.num_instances).items():
            if self._endpoints.get(key) != endpoint:
                channel.disconnect(key)
                channel.connect(key, endpoint)
                self._links.watch(key, endpoint)
                self._endpoints[key] = endpoint
        self._driver.lost = set(info["lost"])
        self._members = members

    def put(self, it: BoundIteration, layer: int) -> None:
        if not self.engine_slots:  # one copy: SGLang wrote the new K/V into the slots
            it.engine.put(it.kv_buf, layer)

    def query(self, it: BoundIteration, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return it.engine.query(it.q_buf, layer)

    def commit(self) -> None:
        if self._inflight is not None:
            it, self._inflight = self._inflight, None
            try:
                it.engine.synchronize()
            except BaseException:
                self._end("abort", it.plans.epoch)
                raise
            self._end("commit", it.plans.epoch)

    def abort(self) -> None:
        if self._inflight is not None:
            it, self._inflight = self._inflight, None
            self._end("abort", it.plans.epoch)

    def _end(self, op: str, epoch: int) -> None:
        try:
            self._stash(self.control.call(op, instance=self.instance_id, epoch=epoch))
        finally:
            self.clients.retire(epoch)

    def close(self) -> None:
        """Give the instance up (another process may join it) and disconnect."""
        with contextlib.suppress(TokenLakeError):
            self.control.call("leave", instance=self.instance_id, pid=os.getpid())
        self.control.close()
        self._driver.channel.close()
        self._ctx.destroy(linger=0)


def _int32(token_ids) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(token_ids), dtype=np.int32)


def _same(a: dict, b: dict) -> bool:
    return a["first_segment"] == b["first_segment"] and np.array_equal(a["where"], b["where"])
