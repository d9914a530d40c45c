"""State the compute-engine clients of one launcher share: the sockets to every engine, the
point-to-point group, the ledger of puts still in flight, and segment-copy execution.

The ledger is what makes ``put`` asynchronous yet ordered: a put only records its tickets
here and returns; a query of layer ``l`` (from any client) first waits for every put of
layer ``l``, and ``init_transfer`` waits for all of them (its copies read earlier puts, and
it hands out kv rows those puts may still be reading).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from tokenlake.engines import messages, process_group
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError
from tokenlake.engines.shared_buffers import InstanceViews, Layout
from tokenlake.engines.transport import Requester
from tokenlake.plans import TransferPlan

_TAG_SPACE = 1 << 30


class Driver:
    """Shared by every :class:`~tokenlake.engines.engine_client.EngineClient` of a cluster."""

    def __init__(
        self,
        config: DataPlaneConfig,
        num_instances: int,
        requester: Requester,
        group=None,
        events=None,
    ) -> None:
        self.config = config
        self.num_instances = num_instances
        self.requester = requester
        self.group = group
        self.events = events  # client-side interprocess CUDA events (GPU only)
        self.layout: Layout | None = None
        self.views: dict[int, InstanceViews] = {}
        self.backend: str | None = None
        self.lost: set[int] = set()
        self._puts: dict[int, list] = defaultdict(list)  # layer -> tickets
        self._works: dict[int, list] = defaultdict(list)  # layer -> (work, peer, tensor)
        self._next_tag = 0
        self._next_binding = 0

    # ---- topology ------------------------------------------------------------------------
    def same_host(self, a: int, b: int) -> bool:
        return a == b or not self.config.separate_hosts

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

    # ---- the put ledger ------------------------------------------------------------------
    def record_put(self, layer: int, ticket, work=None, peer: int = -1, tensor=None) -> None:
        self._puts[layer].append(ticket)
        if work is not None:
            self._works[layer].append(self.watch(work, peer, tensor))

    def watch(self, work, peer: int, tensor=None) -> tuple:
        """``(future, peer, tensor)`` for :meth:`wait`; ``tensor`` stays alive until then."""
        return (process_group.watch(work, self.config.timeout_s), peer, tensor)

    def wait_puts(self, layer: int, what: str) -> None:
        """Wait for every put of ``layer`` still in flight (all clients)."""
        tickets, works = self._puts.pop(layer, []), self._works.pop(layer, [])
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

        self.requester.wait(tickets, what, poll if pending else None)
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
        self.requester.wait(self.requester.outstanding(), what)

    # ---- segment copies (copy-on-extend, replication) ------------------------------------
    def run_copies(self, plan: TransferPlan) -> None:
        """Execute a transfer plan's copy orders and wait for them: one message per
        destination transfer engine on the source's host, else a send/receive pair."""
        local = defaultdict(list)  # dst -> [(src, src_slot, dst_slot, n)]
        recv = defaultdict(list)  # dst -> [(peer, slot, n, tag)]
        send = defaultdict(list)  # src -> [(peer, slot, n, tag)]
        for i in range(plan.num_copies):
            src, dst = int(plan.copy_src_instance[i]), int(plan.copy_dst_instance[i])
            s_slot, d_slot, n = (
                int(plan.copy_src_slot[i]),
                int(plan.copy_dst_slot[i]),
                int(plan.copy_len[i]),
            )
            if self.same_host(src, dst):
                local[dst].append((src, s_slot, d_slot, n))
            else:
                tag = self.new_tag()
                recv[dst].append((self.rank("transfer", src), d_slot, n, tag))
                send[src].append((self.rank("transfer", dst), s_slot, n, tag))
        tickets = []
        for dst, rows in local.items():
            cols = _columns(rows, 4)
            tickets.append(
                self.requester.request(
                    ("transfer", dst), lambda seq, c=cols: messages.CopyLocal(seq, *c)
                )
            )
        # every engine's receives are posted before any send is waited on (see CopyRemote)
        for instance in sorted(set(recv) | set(send)):
            r, s = _columns(recv[instance], 4), _columns(send[instance], 4)
            tickets.append(
                self.requester.request(
                    ("transfer", instance),
                    lambda seq, r=r, s=s: messages.CopyRemote(seq, *r, *s),
                )
            )
        self.requester.wait(tickets, "segment copies")


def _columns(rows: list[tuple], width: int) -> list[np.ndarray]:
    arr = np.asarray(rows, dtype=np.int32).reshape(-1, width)
    return [np.ascontiguousarray(arr[:, k]) for k in range(width)]
