"""What the query and the transfer engine share, in a process of their own or in the
caller's: the buffers of their host, the layout, the bindings and message dispatch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenlake.config import ModelShape
from tokenlake.engines import messages, process_group
from tokenlake.engines.shared_buffers import InstanceBuffers, InstanceViews, Layout
from tokenlake.errors import InvalidArgumentError

ROLES = ("query", "transfer")


@dataclass(frozen=True)
class EngineHost:
    """Where an engine runs: its instance, and the storage of every instance on its host
    (all of them on one host, only its own when instances are separate hosts).
    ``event_handles`` are the clients' interprocess CUDA events per instance (GPU only)."""

    instance_id: int
    num_instances: int
    buffers: dict[int, InstanceBuffers]
    timeout_s: float
    group_backend: str = "gloo"
    event_handles: dict[int, bytes] | None = None


class EngineBase:
    """Dispatches decoded messages to ``handlers`` by type; owns the buffer views."""

    role = ""

    def __init__(self, host: EngineHost, group=None) -> None:
        self.host = host
        self.instance_id = host.instance_id
        self.group = group
        self.layout: Layout | None = None
        self.views: dict[int, InstanceViews] = {}
        self.backend: str | None = None
        self.bindings: dict[tuple[int, int], object] = {}
        self.staging = None  # point-to-point buffers, when instances are separate hosts
        self.sync = None
        if host.event_handles:
            from tokenlake.engines.gpu import EventWaiter

            self.sync = EventWaiter(self.device, host.event_handles)
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
        return self.host.buffers[self.instance_id].raw["pool"].device

    def handle(self, message: object) -> None:
        handler = self.handlers.get(type(message))
        if handler is None:
            raise InvalidArgumentError(
                f"message: a {self.role} engine does not handle {type(message).__name__}"
            )
        handler(message)

    def configure(self, m: messages.Configure) -> None:
        model = ModelShape(m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim, m.dtype)
        layout = Layout(
            model,
            self.host.num_instances,
            m.num_slots,
            m.segment_len,
            m.max_q_rows,
            m.max_kv_rows,
        )
        self.views = {i: b.views(layout) for i, b in self.host.buffers.items()}
        self.layout = layout
        if self.group is not None:
            if hasattr(self.staging, "close"):
                self.staging.close()
            self.staging = process_group.make_staging(
                self.group, self.host.group_backend, _staging_bytes(layout), self.device
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
