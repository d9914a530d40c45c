"""Compute processes: compute engines in processes of their own, separate from the scheduler.

The scheduler process (the only one holding the control plane's ``Pool``) sends each
compute process the part of an iteration's plans for the instances it drives, over an
authenticated-by-launch ZeroMQ socket in the versioned plan wire format; the process runs
them through its own engine clients (the same clients every transport uses) with the
iteration driver, and answers with its program's result::

    with MPCluster(pool.config, dataplane) as cluster, \\
         ComputeProcesses(cluster, [[0], [1]], partial(SyntheticProgram, shape, 0)) as compute:
        plans = pool.gen_plans(batches)
        results = compute.run(plans, chunks)     # one decoded result per process
        pool.commit(plans); compute.retire(plans.epoch)

A program is built once in the process by a picklable factory and called as
``program(cluster, plans, chunks)`` per iteration; it returns plain values
(:func:`tokenlake.wire.packb`). Instance groups must hold whole batches (a DoP > 1 batch runs
in one process). One host only: the processes map the instances' shared buffers.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import zmq

from tokenlake import plan_wire, wire
from tokenlake.engines import messages, process_group
from tokenlake.engines.auth import AuthError, ClusterSecret, FrameAuth
from tokenlake.engines.cluster_base import ClusterBase
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError
from tokenlake.engines.driver import Driver
from tokenlake.engines.launcher import process_context, stop_processes
from tokenlake.engines.peers import LauncherId, LinkMonitor, bind_random
from tokenlake.engines.process_group import GroupSpec
from tokenlake.engines.shared_buffers import InstanceBuffers, Layout
from tokenlake.engines.transport import Requester, Server
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk, Plans
from tokenlake.wire import WireError

_MAX_RESULT_BYTES = 1 << 30


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
        self.links = LinkMonitor(ctx)  # a peer that died is failed at once, not at the timeout
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


def run_steps(
    requester: Requester,
    plans: Plans,
    chunks: Mapping[int | str, Chunk],
    owner: Mapping[int, int],
    num_processes: int,
) -> list:
    """Run one iteration on compute processes ``("compute", k)`` of ``requester``: process
    ``owner[i]`` runs the sub-batches whose origin is instance ``i``. Returns each process's
    decoded result (``None`` for those without work)."""
    parts: dict[int, list[int]] = {}
    for s, qp in enumerate(plans.query_plans):
        k = owner.get(qp.origin)
        if k is None:
            raise InvalidArgumentError(f"plans: instance {qp.origin} has no compute process")
        parts.setdefault(k, []).append(s)
    for group in plans.groups:
        if len({owner.get(i) for i in group}) > 1:
            raise InvalidArgumentError(f"plans: batch group {group} spans compute processes")
    tickets = {}
    for k, subs in sorted(parts.items()):
        part = Plans(
            plans.epoch,
            tuple(plans.query_plans[s] for s in subs),
            tuple(plans.transfer_plans[s] for s in subs),
            plans.groups,
        )
        ids = {rid for s in subs for rid in plans.query_plans[s].request_ids}
        encoded_plans = plan_wire.encode(part)
        encoded = [plan_wire.encode(chunks[rid]) for rid in ids]
        tickets[k] = requester.request(
            ("compute", k),
            lambda seq, p=encoded_plans, c=encoded: messages.RunStep(seq, p, c),
        )
    payloads = requester.wait(list(tickets.values()), f"iteration {plans.epoch}")
    out: list = [None] * num_processes
    for k, payload in zip(tickets, payloads, strict=True):
        out[k] = wire.unpackb(payload, _MAX_RESULT_BYTES)
    return out


class ComputeProcesses:
    """One compute process per instance group of ``groups``, driving the engines of
    ``cluster`` (an :class:`~tokenlake.engines.mp_cluster.MPCluster` on this host)."""

    def __init__(
        self, cluster, groups: Sequence[Sequence[int]], make_program: Callable[[], Callable]
    ) -> None:
        cfg: DataPlaneConfig = cluster.config
        if cfg.separate_hosts:
            raise InvalidArgumentError("cluster: compute processes need one host")
        groups = [tuple(int(i) for i in g) for g in groups]
        flat = [i for g in groups for i in g]
        if not groups or sorted(flat) != sorted(set(flat)) or not all(groups):
            raise InvalidArgumentError(f"groups: expected disjoint non-empty groups, got {groups}")
        self._owner = {i: k for k, g in enumerate(groups) for i in g}
        self._ctx = zmq.Context()
        self._procs: list = []
        self._closed = False
        self.config = cfg
        try:
            self._spawn(cluster, groups, make_program)
        except BaseException:
            self.close()
            raise

    def _spawn(self, cluster, groups, make_program) -> None:
        cfg = self.config
        ready = self._ctx.socket(zmq.PULL)
        ready.setsockopt(zmq.LINGER, 0)
        endpoint = bind_random(ready, cfg.host)
        spawn = process_context()
        for g in groups:
            spec = ComputeSpec(
                g, cfg, cluster.layout, cluster.backend, tuple(cluster.buffers),
                cluster.endpoints, frozenset(cluster.lost), cluster.secret_path, make_program,
                endpoint, LauncherId.this_process(),
            )  # fmt: skip
            p = spawn.Process(target=main, args=(spec,), name=f"tokenlake-compute-{g[0]}")
            p.daemon = True
            p.start()
            self._procs.append(p)
        self._auth = FrameAuth(cluster.secret)
        self._requester = Requester(
            self._ctx, cfg.timeout_s, cfg.poll_interval_s, self._alive, self._auth
        )
        try:
            found = 0
            while found < len(groups):
                for k, p in enumerate(self._procs):
                    if p.exitcode is not None:
                        raise PeerFailedError(groups[k][0], "compute", f"exited ({p.exitcode})")
                if ready.poll(int(cfg.startup_timeout_s * 1000)) == 0:
                    raise PeerFailedError(groups[0][0], "compute", "not ready in time")
                try:
                    msg = messages.decode(self._auth.open(ready.recv(), endpoint.encode()))
                except (AuthError, WireError):
                    continue
                k = self._owner[msg.instance_id]
                self._requester.connect(("compute", k), msg.endpoint)
                found += 1
        finally:
            ready.close(linger=0)

    def _alive(self, key) -> bool:
        return self._procs[key[1]].exitcode is None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(self, plans: Plans, chunks: Mapping[int | str, Chunk]) -> list:
        """Send every process its sub-batches of ``plans`` (with their chunks), wait for all,
        return each process's decoded result (processes without work return ``None``)."""
        return run_steps(self._requester, plans, chunks, self._owner, len(self._procs))

    def retire(self, epoch: int) -> None:
        """Tell every process the control plane committed or aborted ``epoch``."""
        tickets = [
            self._requester.request(("compute", k), lambda seq: messages.Retire(seq, epoch))
            for k in range(len(self._procs))
        ]
        self._requester.wait(tickets, f"retire {epoch}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        requester = getattr(self, "_requester", None)
        if requester is not None:
            for key in requester.keys:
                if self._alive(key):
                    requester.request(key, messages.Stop)
        stop_processes(self._procs, 5.0)
        if requester is not None:
            requester.close()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> ComputeProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
