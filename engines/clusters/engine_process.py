"""The process of a query or transfer engine: its spawn spec and its life — bind a socket,
report ready, join the point-to-point group, serve requests until told to stop or the
launching process is gone."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import zmq

from tokenlake.engines.core.engine_base import ROLES, EngineHost
from tokenlake.engines.transport import messages, process_group
from tokenlake.engines.transport.auth import ClusterSecret, FrameAuth
from tokenlake.engines.transport.peers import LauncherId
from tokenlake.engines.transport.process_group import GroupSpec
from tokenlake.engines.transport.sockets import Server


@dataclass(frozen=True)
class EngineSpec:
    """Everything a spawned engine process needs (pickled once by ``multiprocessing``)."""

    role: str
    host: EngineHost
    secret_path: str  # a 0600 file holding the cluster secret (never the secret itself)
    ready_endpoint: str
    bind_host: str
    launcher: LauncherId
    kernel_threads: int
    group: GroupSpec | None = None


def main(spec: EngineSpec) -> None:
    """Entry point of an engine process (``multiprocessing`` spawn target)."""
    if spec.role not in ROLES:
        raise ValueError(f"spec.role: expected one of {ROLES}, got {spec.role!r}")
    # Several engines share each host's cores: torch's own thread pool per process would
    # oversubscribe them (a descheduled OpenMP worker stalls a whole copy). The attention
    # kernels have their own pool, sized by kernel_threads.
    torch.set_num_threads(1)
    instance_id = spec.host.instance_id
    if spec.role == "query":
        from tokenlake.engines.core.query_engine import QueryEngine as engine_cls

        if spec.kernel_threads and spec.host.buffers[instance_id].raw["pool"].is_cpu:
            from tokenlake.engines.kernels import cpu

            cpu.set_num_threads(spec.kernel_threads)
    else:
        from tokenlake.engines.core.transfer_engine import TransferEngine as engine_cls
    secret = ClusterSecret.from_file(spec.secret_path)
    auth = FrameAuth(secret)
    ctx = zmq.Context()
    server = Server(ctx, spec.bind_host, auth)
    ready = ctx.socket(zmq.PUSH)
    ready.setsockopt(zmq.LINGER, 1000)
    group = None
    try:
        ready.connect(spec.ready_endpoint)
        ready.send(
            auth.seal(
                messages.encode(
                    messages.Ready(spec.role, instance_id, server.endpoint, os.getpid())
                ),
                spec.ready_endpoint.encode(),
            )
        )
        membership = None
        if spec.group is not None:
            rank = process_group.rank_of(spec.role, instance_id, spec.host.num_instances)
            store = process_group.make_store(spec.group, secret)
            membership = process_group.Membership(spec.group, store, rank)
            group = membership.join()
        engine = engine_cls(spec.host, group, membership)
        server.serve(engine.handle, spec.launcher, engine.stats)
    finally:
        process_group.shutdown(group)
        ready.close()
        server.close()
        ctx.term()
    # Everything is released; skip the interpreter's teardown of torch (seconds per process).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
