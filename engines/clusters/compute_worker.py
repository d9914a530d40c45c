"""A compute process itself (the spawn target of
:class:`~tokenlake.engines.clusters.compute_process.ComputeProcesses`): its engine clients for every
instance, and a server loop answering the scheduler process's authenticated requests — run an
iteration's part with the program built in the process, regroup after a membership change,
report counters, stop. Whatever arrives is decoded and checked (:mod:`tokenlake.plan_wire`)
before it runs."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from tokenlake import plan_wire, wire
from tokenlake.engines.client.driver import Driver
from tokenlake.engines.clusters.base import ClusterBase
from tokenlake.engines.core.shared_buffers import InstanceBuffers, Layout
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.transport import messages, process_group
from tokenlake.engines.transport.auth import ClusterSecret, FrameAuth
from tokenlake.engines.transport.peers import LauncherId, LinkMonitor
from tokenlake.engines.transport.process_group import GroupSpec
from tokenlake.engines.transport.sockets import Requester, Server
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk, Plans


@dataclass(frozen=True)
class ComputeSpec:
    """What a spawned compute process needs (pickled once by ``multiprocessing``)."""

    instance_ids: tuple[int, ...]
    config: DataPlaneConfig
    layout: Layout
    backend: str | None
    buffers: tuple[InstanceBuffers, ...]
    endpoints: dict[tuple[str, int], str]
    lost: frozenset[int]
    secret_path: str
    make_program: Callable[[], Callable]
    ready_endpoint: str
    launcher: LauncherId
    group: GroupSpec | None = None  # with compute_clients: this process is a rank
    hosts: tuple[str, ...] | None = None  # the host of every instance (see Driver)


class ComputeClients(ClusterBase):
    """A compute process's engine clients: ``engine(i)`` for every instance of the cluster
    (a process drives only its own, but any id resolves)."""

    def __init__(self, driver: Driver, num_instances: int) -> None:
        self._driver = driver
        self.stats: Counter = Counter()  # frames this process's server rejected
        self._make_clients(num_instances)


class _Worker:
    def __init__(
        self, spec: ComputeSpec, ctx: zmq.Context, auth: FrameAuth, secret: ClusterSecret
    ) -> None:
        n = spec.layout.num_instances
        self.links = LinkMonitor(
            ctx, auth
        )  # a peer that died is failed at once, not at the timeout
        self.requester = Requester(
            ctx, spec.config.timeout_s, spec.config.poll_interval_s, self.links.is_alive, auth
        )
        for key, endpoint in spec.endpoints.items():
            if key[1] not in spec.lost:
                self._connect(key, endpoint)
        self.membership, group = None, None
        if spec.group is not None:
            if not spec.group.compute_clients or len(spec.instance_ids) != 1:
                raise InvalidArgumentError("group: a compute rank drives exactly one instance")
            rank = process_group.rank_of("compute", spec.instance_ids[0], n)
            store = process_group.make_store(spec.group, secret)
            self.membership = process_group.Membership(spec.group, store, rank)
            group = self.membership.join()
        driver = Driver(spec.config, n, self.requester, group, hosts=spec.hosts)
        driver.set_layout(spec.layout, spec.backend)
        driver.views = {
            i: b.views(spec.layout) for i, b in enumerate(spec.buffers) if b is not None
        }
        driver.lost = set(spec.lost)
        self.driver = driver
        self.clients = ComputeClients(driver, n)
        self.spec = spec
        self.limits = plan_wire.PlanLimits(n, spec.layout.num_slots, spec.layout.segment_len)
        self.program = spec.make_program()

    def _connect(self, key, endpoint: str) -> None:
        self.requester.disconnect(key)
        self.requester.connect(key, endpoint)
        self.links.watch(key, endpoint)

    def regroup(self, m: messages.Regroup) -> None:
        """Restarted instances rejoined: talk to their new engines, re-form the group."""
        ids = plan_wire.check_array("instance_ids", m.instance_ids)
        plan_wire.check_values("instance_ids", ids, 0, self.spec.layout.num_instances)
        if not len(ids) == len(m.query_endpoints) == len(m.transfer_endpoints):
            raise InvalidArgumentError("endpoints: one query and one transfer endpoint per id")
        for i, q_ep, t_ep in zip(
            ids.tolist(), m.query_endpoints, m.transfer_endpoints, strict=True
        ):
            for key, ep in ((("query", i), q_ep), (("transfer", i), t_ep)):
                if not ep.startswith("tcp://"):
                    raise InvalidArgumentError(f"endpoints: expected tcp://, got {ep!r}")
                self._connect(key, ep)
            self.driver.lost.discard(i)
        if self.membership is not None:
            group = self.membership.join(m.generation)
            process_group.shutdown(self.driver.group)
            self.driver.group = group

    def handle(self, m) -> bytes | None:
        if isinstance(m, messages.RunStep):
            plans = plan_wire.decode(m.plans, self.limits, Plans)
            mine = set(self.spec.instance_ids)
            if any(qp.origin not in mine for qp in plans.query_plans):
                raise InvalidArgumentError(f"plans: a sub-batch of another process than {mine}")
            chunks = [plan_wire.decode(c, self.limits, Chunk) for c in m.chunks]
            result = self.program(self.clients, plans, {c.request_id: c for c in chunks})
            return wire.packb(result)
        if isinstance(m, messages.Retire):
            self.clients.retire(m.epoch)
            return None
        if isinstance(m, messages.Regroup):
            self.regroup(m)
            return None
        if isinstance(m, messages.Stats):
            return wire.packb(dict(self.clients.stats))
        if isinstance(m, messages.Stop):
            return None
        raise InvalidArgumentError(f"message: a compute process does not handle {type(m).__name__}")


def main(spec: ComputeSpec) -> None:
    """Entry point of a compute process (``multiprocessing`` spawn target)."""
    torch.set_num_threads(1)
    secret = ClusterSecret.from_file(spec.secret_path)
    auth = FrameAuth(secret)
    ctx = zmq.Context()
    server = Server(ctx, spec.config.host, auth)
    ready = ctx.socket(zmq.PUSH)
    ready.setsockopt(zmq.LINGER, 1000)
    try:
        worker = _Worker(spec, ctx, auth, secret)
        ready.connect(spec.ready_endpoint)
        ready.send(
            auth.seal(
                messages.encode(
                    messages.Ready("compute", spec.instance_ids[0], server.endpoint, os.getpid())
                ),
                spec.ready_endpoint.encode(),
            )
        )
        server.serve(worker.handle, spec.launcher, worker.clients.stats)
    finally:
        ready.close()
        server.close()
        ctx.destroy(linger=0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
