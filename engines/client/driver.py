"""What the engine clients of one process share: the channel to every engine (ZeroMQ or
in-process), views of the buffers of every instance this process can map, the
point-to-point group to other hosts, and the ledger of between-host puts still in flight.

Inside one host every bulk write is a direct (P2P) write by the process that holds the data,
as NCCL's P2P and shared-memory transports do: a put writes the origin's ``kv_buf`` rows
straight into the destination's pool, a segment copy copies pool to pool. Only between hosts
does a transfer engine receive over ``torch.distributed`` point-to-point. The ledger makes
those asynchronous yet ordered: a query of layer ``l`` first waits for the client's puts of
layer ``l``, and :meth:`Driver.flush` for all of them.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import numpy as np

from tokenlake.engines.core import puts
from tokenlake.engines.core.host_tier import HostTierStore
from tokenlake.engines.core.shared_buffers import InstanceViews, Layout
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError
from tokenlake.engines.kernels.flashinfer_attention import make_planner
from tokenlake.engines.transport import messages, process_group
from tokenlake.errors import InvalidArgumentError
from tokenlake.latency import observe
from tokenlake.plans import TransferPlan
from tokenlake.validate import canonical_device

_TAG_SPACE = 1 << 30
# counter keys of the client calls, built once (a put is a few microseconds)
_CALL_KEYS = {op: (f"{op}_calls", f"{op}_bytes", f"{op}_seconds") for op in ("query", "put")}


class Driver:
    """Shared by every :class:`~tokenlake.engines.client.engine_client.EngineClient` of a process.

    ``channel`` is a :class:`~tokenlake.engines.transport.sockets.Requester` or a
    :class:`~tokenlake.engines.transport.sockets.LocalChannel`; ``views`` holds every instance whose
    buffers this process maps (on another host: only its own are used). ``hosts[i]`` names
    the host (node) of instance ``i`` when instances span several (``None``: one host, or
    one per instance with ``config.separate_hosts``).
    """

    def __init__(
        self,
        config: DataPlaneConfig,
        num_instances: int,
        channel,
        group=None,
        events=None,
        hosts: tuple[str, ...] | None = None,
    ) -> None:
        if hosts is not None and len(hosts) != num_instances:
            raise ValueError(f"hosts: expected {num_instances} entries, got {len(hosts)}")
        self.config = config
        self.num_instances = num_instances
        self.channel = channel
        self.group = group
        self.hosts = hosts
        self.events = events  # client-side interprocess CUDA events (GPU only)
        self.layout: Layout | None = None
        self.views: dict[int, InstanceViews] = {}
        self.backend: str | None = None
        self.planner = None
        self.lost: set[int] = set()
        self.tier: HostTierStore | None = None  # the host tier below the pools, if any
        self.num_served = num_instances  # instances of the pool served now (see reset)
        self._puts: dict[int, list] = defaultdict(list)  # layer -> tickets
        self._works: dict[int, list] = defaultdict(list)  # layer -> (work, peer, tensor)
        self._next_tag = 0
        self._next_binding = 0
        self.stats: Counter = Counter()  # this process's clients: calls, bytes, latency

    def count_call(self, op: str, start: float, nbytes: int) -> None:
        """A client ``op`` (query / put) that began at ``start`` (perf_counter) is done."""
        calls, nbytes_key, seconds = _CALL_KEYS[op]
        self.stats[calls] += 1
        self.stats[nbytes_key] += nbytes
        observe(self.stats, seconds, time.perf_counter() - start)

    # ---- topology ------------------------------------------------------------------------
    def same_host(self, a: int, b: int) -> bool:
        if a == b:
            return True
        if self.config.separate_hosts:
            return False
        return self.hosts is None or self.hosts[a] == self.hosts[b]

    def rank(self, role: str, instance_id: int) -> int:
        return process_group.rank_of(role, instance_id, self.num_instances)

    def new_tag(self) -> int:
        """A tag block of 4 consecutive tags, unique among transfers in flight."""
        tag = self._next_tag
        self._next_tag = (self._next_tag + 4) % _TAG_SPACE
        return tag

    def new_binding(self) -> int:
        self._next_binding += 1
        return self._next_binding

    def configure(self, keys: list, layout: Layout, backend: str | None) -> None:
        """Lay every engine in ``keys`` (and this process's views) out for ``layout``."""
        m = layout.model
        tickets = [
            self.channel.request(
                key,
                lambda seq: messages.Configure(
                    seq,
                    m.num_layers,
                    m.num_q_heads,
                    m.num_kv_heads,
                    m.head_dim,
                    m.dtype,
                    layout.num_slots,
                    layout.segment_len,
                    layout.max_q_rows,
                    layout.max_kv_rows,
                    backend or "",
                    m.logit_cap,
                ),
            )  # fmt: skip
            for key in keys
        ]
        self.channel.wait(tickets, "configure")
        self.set_layout(layout, backend)

    def set_layout(self, layout: Layout, backend: str | None) -> None:
        """This process's side of a layout: the backend and, on CUDA, the FlashInfer planner
        of the clients' own parts."""
        self.layout, self.backend = layout, backend
        self.planner = make_planner(layout, backend, canonical_device(self.config.device))

    # ---- the put ledger ------------------------------------------------------------------
    def record_put(self, layer: int, ticket, work=None, peer: int = -1, tensor=None) -> None:
        self._puts[layer].append(ticket)
        if work is not None:
            self._works[layer].append(self.watch(work, peer, tensor))

    def watch(self, work, peer: int, tensor=None) -> tuple:
        """``(future, peer, tensor)`` for :meth:`wait`; ``tensor`` stays alive until then."""
        return (process_group.watch(work, self.config.timeout_s), peer, tensor)

    def wait_puts(self, layer: int, what: str) -> None:
        """Wait for every between-host put of ``layer`` still in flight."""
        tickets, works = self._puts.pop(layer, []), self._works.pop(layer, [])
        if tickets or works:
            self.wait(tickets, works, what)

    def flush(self, what: str) -> None:
        """Wait for every put in flight, all layers."""
        for layer in sorted(set(self._puts) | set(self._works)):
            self.wait_puts(layer, what)

    def wait(self, tickets: list, works: list, what: str) -> None:
        """Wait for replies ``tickets`` and point-to-point ``works`` ``(work, peer_rank, ...)``
        together, so an engine's error reply surfaces at once instead of as a stuck
        transfer. Raises :class:`PeerFailedError` / :class:`RemoteEngineError`."""
        pending = [(w[0], w[1]) for w in works]

        def poll() -> int:
            pending[:] = process_group.poll_works(pending, self.num_instances, what)
            return len(pending)

        self.channel.wait(tickets, what, poll if pending else None)
        if pending:  # the replies came, but a transfer did not finish in time
            role, instance = process_group.peer_of(pending[0][1], self.num_instances)
            raise PeerFailedError(instance, role, f"{what}: transfer not done in time")

    def forget(self, instance_id: int) -> None:
        """Drop in-flight work addressed to a lost instance (it will never answer)."""
        ranks = {self.rank(r, instance_id) for r in ("query", "transfer")}
        for layer in list(self._puts):
            self._puts[layer] = [t for t in self._puts[layer] if t[0][1] != instance_id]
        for layer in list(self._works):
            self._works[layer] = [w for w in self._works[layer] if w[1] not in ranks]

    def quiesce(self, what: str) -> None:
        """Wait until every live engine answered everything sent to it, so no request of an
        aborted iteration can land after the next one starts."""
        self.flush(what)
        self.channel.wait(self.channel.outstanding(), what)

    # ---- the host tier ----------------------------------------------------------------------
    def run_tier_moves(self, plan: TransferPlan) -> None:
        """Execute a transfer plan's host-tier runs, demotions first (each reads a slot the
        plan writes next), then loads (:class:`HostTierStore`). The plan was checked
        against the tier's blocks (``plan_checks``); the slots must be on this host."""
        if not plan.num_demotions and not plan.num_loads:
            return
        tier, origin = self.tier, plan.origin
        for name in ("demote_src_instance", "load_dst_instance"):
            for instance in getattr(plan, name).tolist():
                if not self.same_host(origin, instance):
                    raise InvalidArgumentError(
                        f"transfer_plan.{name}: instance {instance} is on another host than "
                        f"origin {origin}; allowed: instances of the host tier's host"
                    )
        for instance, slot, block in zip(
            plan.demote_src_instance.tolist(), plan.demote_src_slot.tolist(),
            plan.demote_dst_block.tolist(), strict=True,
        ):  # fmt: skip
            tier.demote(self.views[instance].pool, slot, block)
        loads = [
            (block, self.views[instance].pool, slot)
            for block, instance, slot in zip(
                plan.load_src_block.tolist(),
                plan.load_dst_instance.tolist(),
                plan.load_dst_slot.tolist(),
                strict=True,
            )  # fmt: skip
        ]
        tier.load(loads)
        if plan.num_copies:  # a copy-on-extend may read a loaded slot
            tier.wait()
        segment = self.layout.segment_len * self.layout.model.kv_bytes_per_token
        self.stats["tier_demotions"] += plan.num_demotions
        self.stats["tier_loads"] += plan.num_loads
        self.stats["tier_bytes"] += (plan.num_demotions + plan.num_loads) * segment

    def wait_tier(self, layer: int) -> None:
        """Before a query of ``layer``: the loads of that layer landed (CUDA; a no-op on CPU)."""
        if self.tier is not None:
            self.tier.wait(layer)

    # ---- segment copies (copy-on-extend, replication orders) -----------------------------
    def run_copies(self, plan: TransferPlan) -> None:
        """Execute a transfer plan's copy orders and wait for them. Copies this process can
        reach (both sides on the origin's host) are direct; a copy inside another host is one
        message to that host's transfer engine; between hosts a send/receive pair."""
        origin = plan.origin
        local = defaultdict(list)  # dst -> [(src, src_slot, dst_slot, n)]
        recv = defaultdict(list)  # dst -> [(peer, slot, n, tag)]
        send = defaultdict(list)  # src -> [(peer, slot, n, tag)]
        for src, s_slot, dst, d_slot, n in zip(
            plan.copy_src_instance.tolist(),
            plan.copy_src_slot.tolist(),
            plan.copy_dst_instance.tolist(),
            plan.copy_dst_slot.tolist(),
            plan.copy_len.tolist(),
            strict=True,
        ):
            if self.same_host(origin, src) and self.same_host(origin, dst):
                puts.copy_segment(self.views[src].pool, s_slot, self.views[dst].pool, d_slot, n)
            elif self.same_host(src, dst):
                local[dst].append((src, s_slot, d_slot, n))
            else:
                tag = self.new_tag()
                recv[dst].append((self.rank("transfer", src), d_slot, n, tag))
                send[src].append((self.rank("transfer", dst), s_slot, n, tag))
        tickets = []
        for dst, rows in local.items():
            cols = _columns(rows, 4)
            tickets.append(
                self.channel.request(
                    ("transfer", dst), lambda seq, c=cols: messages.CopyLocal(seq, *c)
                )
            )
        # every engine's receives are posted before any send is waited on (see CopyRemote)
        for instance in sorted(set(recv) | set(send)):
            r, s = _columns(recv[instance], 4), _columns(send[instance], 4)
            tickets.append(
                self.channel.request(
                    ("transfer", instance),
                    lambda seq, r=r, s=s: messages.CopyRemote(seq, *r, *s),
                )
            )
        if tickets:
            self.channel.wait(tickets, "segment copies")


def _columns(rows: list[tuple], width: int) -> list[np.ndarray]:
    arr = np.asarray(rows, dtype=np.int32).reshape(-1, width)
    return [np.ascontiguousarray(arr[:, k]) for k in range(width)]
