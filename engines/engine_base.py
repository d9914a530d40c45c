"""What the query and the transfer engine processes share: their spawn spec, start-up
(socket, readiness, process group), buffer layout and message dispatch."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from tokenlake.config import ModelShape
from tokenlake.engines import messages, process_group
from tokenlake.engines.process_group import GroupSpec
from tokenlake.engines.shared_buffers import InstanceBuffers, InstanceViews, Layout
from tokenlake.engines.transport import Server
from tokenlake.errors import InvalidArgumentError

ROLES = ("query", "transfer")


@dataclass(frozen=True)
class EngineSpec:
    """Everything a spawned engine process needs (pickled once by ``multiprocessing``).

    ``buffers`` holds the shared storage of every instance on this engine's host: all of
    them on one host, only its own when instances are separate hosts.
    ``event_handles`` are the client's interprocess CUDA events per instance (GPU only).
    """

    role: str
    instance_id: int
    num_instances: int
    buffers: dict[int, InstanceBuffers]
    ready_endpoint: str
    host: str
    parent_pid: int
    kernel_threads: int
    timeout_s: float
    group: GroupSpec | None = None
    event_handles: dict[int, bytes] | None = None


class EngineBase:
    """Dispatches decoded messages to ``handlers`` by type; owns the buffer views."""

    def __init__(self, spec: EngineSpec, group) -> None:
        self.spec = spec
        self.instance_id = spec.instance_id
        self.group = group
        self.layout: Layout | None = None
        self.views: dict[int, InstanceViews] = {}
        self.backend: str | None = None
        self.bindings: dict[tuple[int, int], object] = {}
        self.staging = None  # point-to-point buffers, when instances are separate hosts
        self.sync = None
        if spec.event_handles:
            from tokenlake.engines.gpu import EventWaiter

            device = next(iter(spec.buffers.values())).raw["pool"].device
            self.sync = EventWaiter(device, spec.event_handles)
        self.handlers: dict[type, Callable[[object], None]] = {
            messages.Configure: self.configure,
            messages.Stop: lambda message: None,
        }

    @property
    def own(self) -> InstanceViews:
        if self.layout is None:
            raise InvalidArgumentError("engine: not configured (send Configure first)")
        return self.views[self.instance_id]

    @property
    def device(self) -> torch.device:
        return self.spec.buffers[self.instance_id].raw["pool"].device

    def handle(self, message: object) -> None:
        handler = self.handlers.get(type(message))
        if handler is None:
            raise InvalidArgumentError(
                f"message: a {self.spec.role} engine does not handle {type(message).__name__}"
            )
        handler(message)

    def configure(self, m: messages.Configure) -> None:
        model = ModelShape(m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim, m.dtype)
        layout = Layout(
            model,
            self.spec.num_instances,
            m.num_slots,
            m.segment_len,
            m.max_q_rows,
            m.max_kv_rows,
        )
        self.views = {i: b.views(layout) for i, b in self.spec.buffers.items()}
        self.layout = layout
        if self.group is not None:
            if hasattr(self.staging, "close"):
                self.staging.close()
            self.staging = process_group.make_staging(
                self.group, self.spec.group.backend, _staging_bytes(layout), self.device
            )
        self.backend = m.backend or None
        self.bindings.clear()

    def peer_views(self, origin: int) -> InstanceViews:
        views = self.views.get(origin)
        if views is None:
            raise InvalidArgumentError(f"origin: instance {origin} is not on this host")
        return views

    def check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.own.pool.num_layers:
            raise InvalidArgumentError(f"layer: expected 0..{self.own.pool.num_layers - 1}")
        return layer

    def drop_older(self, origin: int, epoch: int) -> None:
        """Forget ``origin``'s bindings of earlier iterations (they can never run again)."""
        self.bindings = {
            k: b for k, b in self.bindings.items() if k[0] != origin or b.epoch >= epoch
        }

    def binding(self, origin: int, binding: int):
        found = self.bindings.get((origin, binding))
        if found is None:
            raise InvalidArgumentError(f"binding: unknown binding {binding} of origin {origin}")
        return found


def _staging_bytes(layout: Layout) -> int:
    """Room for the largest single transfer an engine receives or sends: a query part's q
    rows and results, one layer of put rows, or two segments of all layers."""
    m, item = layout.model, layout.model.dtype_bytes
    q = layout.max_q_rows * m.num_q_heads * (m.head_dim * (item + 4) + 4)
    kv = layout.max_kv_rows * 2 * m.num_kv_heads * m.head_dim * item
    segments = 2 * m.num_layers * 2 * layout.segment_len * m.num_kv_heads * m.head_dim * item
    return q + kv + segments + 4096


def main(spec: EngineSpec) -> None:
    """Entry point of an engine process (``multiprocessing`` spawn target)."""
    if spec.role not in ROLES:
        raise ValueError(f"spec.role: expected one of {ROLES}, got {spec.role!r}")
    # Several engines share each host's cores: torch's own thread pool per process would
    # oversubscribe them (a descheduled OpenMP worker stalls a whole copy). The attention
    # kernels have their own pool, sized by kernel_threads.
    torch.set_num_threads(1)
    if spec.role == "query":
        from tokenlake.engines.query_engine import QueryEngine as engine_cls

        if spec.kernel_threads and spec.buffers[spec.instance_id].raw["pool"].is_cpu:
            from tokenlake.kernels import cpu

            cpu.set_num_threads(spec.kernel_threads)
    else:
        from tokenlake.engines.transfer_engine import TransferEngine as engine_cls
    ctx = zmq.Context()
    server = Server(ctx, spec.host)
    ready = ctx.socket(zmq.PUSH)
    ready.setsockopt(zmq.LINGER, 1000)
    group = store = None
    try:
        ready.connect(spec.ready_endpoint)
        ready.send(
            messages.encode(
                messages.Ready(spec.role, spec.instance_id, server.endpoint, os.getpid())
            )
        )
        if spec.group is not None:
            rank = process_group.rank_of(spec.role, spec.instance_id, spec.num_instances)
            store = process_group.make_store(spec.group, is_master=False)
            group = process_group.connect(spec.group, store, rank)
        engine = engine_cls(spec, group)
        server.serve(engine.handle, spec.parent_pid)
    finally:
        process_group.shutdown(group)
        ready.close()
        server.close()
        ctx.term()
    # Everything is released; skip the interpreter's teardown of torch (seconds per process).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
