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

from collections.abc import Callable, Mapping, Sequence
from functools import partial

import numpy as np
import zmq

from tokenlake import plan_wire, wire
from tokenlake.engines.clusters.compute_worker import ComputeSpec, main
from tokenlake.engines.clusters.launcher import Started, process_context, stop_processes
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError
from tokenlake.engines.transport import messages
from tokenlake.engines.transport.auth import AuthError, FrameAuth
from tokenlake.engines.transport.peers import LauncherId, bind_random
from tokenlake.engines.transport.sockets import Requester
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk, Plans
from tokenlake.wire import WireError

_MAX_RESULT_BYTES = 1 << 30


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
    ``cluster`` (an :class:`~tokenlake.engines.clusters.mp.MPCluster` on this host)."""

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
        self._groups, self._make_program = groups, make_program
        self._ctx = zmq.Context()
        self._procs: list[Started | None] = [None] * len(groups)
        self._closed = False
        self.config = cfg
        self._auth = FrameAuth(cluster.secret)
        self._requester = Requester(
            self._ctx, cfg.timeout_s, cfg.poll_interval_s, self._alive, self._auth
        )
        try:
            self._spawn(cluster, range(len(groups)))
        except BaseException:
            self.close()
            raise

    def _spawn(self, cluster, ks) -> None:
        """Start the processes of groups ``ks`` over ``cluster``'s engines as they are now,
        and connect to each once it reported ready."""
        cfg = self.config
        ready = self._ctx.socket(zmq.PULL)
        ready.setsockopt(zmq.LINGER, 0)
        endpoint = bind_random(ready, cfg.host)
        spawn = process_context()
        for k in ks:
            g = self._groups[k]
            spec = ComputeSpec(
                g, cfg, cluster.layout, cluster.backend, tuple(cluster.buffers),
                cluster.endpoints, frozenset(cluster.lost), cluster.secret_path,
                self._make_program, endpoint, LauncherId.this_process(),
            )  # fmt: skip
            p = spawn.Process(target=main, args=(spec,), name=f"tokenlake-compute-{g[0]}")
            p.daemon = True
            p.start()
            self._procs[k] = Started(p)
        try:
            pending = set(ks)
            while pending:
                for k in pending:
                    if not self._procs[k].alive():
                        code = self._procs[k].process.exitcode
                        raise PeerFailedError(self._groups[k][0], "compute", f"exited ({code})")
                if ready.poll(int(cfg.startup_timeout_s * 1000)) == 0:
                    k = min(pending)
                    raise PeerFailedError(self._groups[k][0], "compute", "not ready in time")
                try:
                    msg = messages.decode(self._auth.open(ready.recv(), endpoint.encode()))
                except (AuthError, WireError):
                    continue
                k = self._owner[msg.instance_id]
                if k in pending:
                    self._requester.connect(("compute", k), msg.endpoint)
                    pending.discard(k)
        finally:
            ready.close(linger=0)

    def restart(self, cluster, instance_id: int) -> None:
        """After ``cluster.restart(instance_id)``: a fresh process for the group holding
        ``instance_id`` (the old one, if still running, is killed), and every other process
        reconnects to that group's new engines (``Regroup``)."""
        k = self._owner.get(instance_id)
        if k is None:
            raise InvalidArgumentError(f"instance_id: {instance_id} has no compute process")
        old = self._procs[k]
        self._requester.disconnect(("compute", k))
        if old is not None:
            stop_processes([old], 0.0)
        self._spawn(cluster, [k])
        ids = self._groups[k]
        endpoints = cluster.endpoints
        regroup = partial(
            messages.Regroup, generation=0, instance_ids=np.asarray(ids, dtype=np.int32),
            query_endpoints=tuple(endpoints[("query", i)] for i in ids),
            transfer_endpoints=tuple(endpoints[("transfer", i)] for i in ids),
        )  # fmt: skip
        tickets = [
            self._requester.request(("compute", j), lambda seq: regroup(seq))
            for j, p in enumerate(self._procs)
            if j != k and p is not None and p.alive()
        ]
        self._requester.wait(tickets, f"regroup {list(ids)}")

    def _alive(self, key) -> bool:
        p = self._procs[key[1]]
        return p is not None and p.alive()

    def failures(self) -> list[int]:
        """The instances whose compute process died (killed, crashed), seen also while no
        iteration runs."""
        return sorted(i for i, k in self._owner.items() if not self._alive(("compute", k)))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def run(self, plans: Plans, chunks: Mapping[int | str, Chunk]) -> list:
        """Send every process its sub-batches of ``plans`` (with their chunks), wait for all,
        return each process's decoded result (processes without work return ``None``)."""
        return run_steps(self._requester, plans, chunks, self._owner, len(self._procs))

    def retire(self, epoch: int) -> None:
        """Tell every process the control plane committed or aborted ``epoch``."""
        tickets = [  # a dead process is reported by failures() instead
            self._requester.request(("compute", k), lambda seq: messages.Retire(seq, epoch))
            for k in range(len(self._procs))
            if self._alive(("compute", k))
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
        stop_processes([p for p in self._procs if p is not None], 5.0)
        if requester is not None:
            requester.close()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> ComputeProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
