"""What the query and the transfer engine share, in a process of their own or in the
caller's: the buffers of their host, the layout, the bindings, counters, and dispatch of
messages whose every field is checked against the engine's own geometry before anything
is touched (a message is hostile until checked)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenlake import plan_wire, wire
from tokenlake.config import ModelShape
from tokenlake.engines.core.shared_buffers import InstanceBuffers, InstanceViews, Layout
from tokenlake.engines.kernels.flashinfer_attention import make_planner
from tokenlake.engines.transport import messages, process_group
from tokenlake.errors import InvalidArgumentError
from tokenlake.plan_wire import check_id

ROLES = ("query", "transfer")
BACKENDS = ("", "torch", "cpu", "flashinfer")
TAG_SPACE = 1 << 30
MAX_BINDINGS_PER_ORIGIN = 64


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
    """Dispatches decoded messages to ``handlers`` by type; owns the buffer views and the
    counters (:attr:`stats`, answered to a :class:`messages.Stats`)."""

    role = ""

    def __init__(self, host: EngineHost, group=None, membership=None) -> None:
        self.host = host
        self.instance_id = host.instance_id
        self.group = group
        self.membership = membership  # process_group.Membership: client ranks, re-forming
        self.layout: Layout | None = None
        self.views: dict[int, InstanceViews] = {}
        self.backend: str | None = None
        self.bindings: dict[tuple[int, int], object] = {}
        self.staging = None  # point-to-point buffers, when instances are separate hosts
        self.planner = None  # FlashInfer state, on CUDA
        self.stats: Counter = Counter()
        self.sync = None
        if host.event_handles:
            from tokenlake.engines.transport.gpu import EventWaiter

            self.sync = EventWaiter(self.device, host.event_handles)
        self.handlers: dict[type, Callable[[object], bytes | None]] = {
            messages.Configure: self.configure,
            messages.Stats: lambda m: wire.packb(dict(self.stats)),
            messages.Regroup: self.regroup,
            messages.Stop: lambda m: None,
        }

    @property
    def own(self) -> InstanceViews:
        if self.layout is None:
            raise InvalidArgumentError("engine: not configured (send Configure first)")
        return self.views[self.instance_id]

    @property
    def device(self) -> torch.device:
        return self.host.buffers[self.instance_id].raw["pool"].device

    @property
    def limits(self) -> plan_wire.PlanLimits:
        lay = self.own.pool and self.layout  # raises until configured
        return plan_wire.PlanLimits(lay.num_instances, lay.num_slots, lay.segment_len)

    def handle(self, message: object) -> bytes | None:
        handler = self.handlers.get(type(message))
        if handler is None:
            raise InvalidArgumentError(
                f"message: a {self.role} engine does not handle {type(message).__name__}"
            )
        return handler(message)

    def configure(self, m: messages.Configure) -> None:
        if m.backend not in BACKENDS:
            raise InvalidArgumentError(f"backend: expected one of {BACKENDS}, got {m.backend!r}")
        model = ModelShape(
            m.num_layers, m.num_q_heads, m.num_kv_heads, m.head_dim, m.dtype, m.logit_cap
        )
        for name in ("num_slots", "segment_len", "max_q_rows", "max_kv_rows"):
            check_id(name, getattr(m, name) - 1, 1 << 40)
        layout = Layout(
            model, self.host.num_instances, m.num_slots, m.segment_len, m.max_q_rows, m.max_kv_rows
        )
        views = {i: b.views(layout) for i, b in self.host.buffers.items()}  # checks the fit
        self._make_staging(layout)
        self.views, self.layout = views, layout
        self.backend = m.backend or None
        self.planner = make_planner(layout, self.backend, self.device)
        self.bindings.clear()

    def _make_staging(self, layout: Layout) -> None:
        if self.group is not None:
            if hasattr(self.staging, "close"):
                self.staging.close()
            self.staging = process_group.make_staging(
                self.group, self.host.group_backend, _staging_bytes(layout), self.device
            )

    def regroup(self, m: messages.Regroup) -> None:
        """Re-form the point-to-point group under generation ``m.generation`` with restarted
        peers (every live process of the cluster is told at once); no-op without a group."""
        check_id("generation", m.generation, 1 << 40)
        if self.membership is None:
            return
        group = self.membership.join(m.generation)
        process_group.shutdown(self.group)
        self.group = group
        if self.layout is not None:
            self._make_staging(self.layout)

    def client_rank(self, origin: int) -> int:
        """The rank a cross-host ``origin``'s queries and puts come from."""
        check_id("origin", origin, self.host.num_instances)
        if self.membership is None:
            return process_group.DRIVER_RANK
        return self.membership.client_rank(origin)

    # ---- checks of message fields against this engine's geometry --------------------------
    def peer_views(self, origin: int) -> InstanceViews:
        check_id("origin", origin, self.host.num_instances)
        views = self.views.get(origin)
        if views is None:
            raise InvalidArgumentError(f"origin: instance {origin} is not on this host")
        return views

    def check_layer(self, layer: int) -> int:
        return check_id("layer", layer, self.own.pool.num_layers)

    def check_tag(self, tag: int, remote: bool) -> int:
        """``-1`` (shared buffers, on this host) or a point-to-point tag block."""
        if not remote:
            if tag != -1:
                raise InvalidArgumentError(f"tag: expected -1 on one host, got {tag!r}")
            return tag
        if self.group is None:
            raise InvalidArgumentError("tag: this engine has no point-to-point group")
        return check_id("tag", tag, TAG_SPACE)

    def check_rank(self, name: str, ranks) -> None:
        world = 1 + 2 * self.host.num_instances
        plan_wire.check_values(name, plan_wire.check_array(name, ranks), 0, world)
        own = process_group.rank_of(self.role, self.instance_id, self.host.num_instances)
        if len(ranks) and bool((ranks == own).any()):
            raise InvalidArgumentError(f"{name}: this engine's own rank {own}")

    def add_binding(self, origin: int, epoch: int, binding: int, value) -> None:
        """Bind ``value`` as ``(origin, binding)``; forget ``origin``'s bindings of earlier
        iterations (they can never run again)."""
        check_id("origin", origin, self.host.num_instances)
        check_id("epoch", epoch, 1 << 62)
        check_id("binding", binding, 1 << 62)
        kept = {k: b for k, b in self.bindings.items() if k[0] != origin or b.epoch >= epoch}
        if sum(k[0] == origin for k in kept) >= MAX_BINDINGS_PER_ORIGIN:
            raise InvalidArgumentError(
                f"binding: origin {origin} holds {MAX_BINDINGS_PER_ORIGIN} bindings already"
            )
        kept[(origin, binding)] = value
        self.bindings = kept

    def binding(self, origin: int, binding: int):
        found = self.bindings.get((origin, binding))
        if found is None:
            raise InvalidArgumentError(f"binding: unknown binding {binding!r} of origin {origin!r}")
        return found


def _staging_bytes(layout: Layout) -> int:
    """Room for the largest single transfer an engine receives or sends: a query part's q
    rows and results, one layer of put rows, or two segments of all layers."""
    m, item = layout.model, layout.model.dtype_bytes
    q = layout.max_q_rows * m.num_q_heads * (m.head_dim * (item + 4) + 4)
    kv = layout.max_kv_rows * 2 * m.num_kv_heads * m.head_dim * item
    segments = 2 * m.num_layers * 2 * layout.segment_len * m.num_kv_heads * m.head_dim * item
    return q + kv + segments + 4096
