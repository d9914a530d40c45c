"""The query engine of one instance (DESIGN §2.2): partial attention with LSE of peers' query
rows over this instance's segments.

On one host it reads the origin's q rows straight from the origin's shared q buffer and
writes ``(o, lse)`` into the origin's shared output region (region = this instance's id). From
another host the rows arrive, and the results leave, over the point-to-point group.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenlake.engines import messages, process_group
from tokenlake.engines.engine_base import EngineBase, EngineHost
from tokenlake.engines.executor import BoundPart
from tokenlake.plans import HolderPart


@dataclass(eq=False)
class _QueryBinding:
    epoch: int
    q_offset: int
    part: BoundPart  # rows index the origin's q_buf
    packed: BoundPart  # rows 0..n-1: the rows as received from another host

    @property
    def num_rows(self) -> int:
        return self.part.num_rows


class QueryEngine(EngineBase):
    role = "query"

    def __init__(self, host: EngineHost, group=None) -> None:
        super().__init__(host, group)
        self.handlers[messages.BindQuery] = self.bind
        self.handlers[messages.RunQuery] = self.run

    def bind(self, m: messages.BindQuery) -> None:
        part = HolderPart(
            self.instance_id, m.rows, m.q_indptr, m.kv_indptr, m.kv_indices, m.last_len
        )
        self.drop_older(m.origin, m.epoch)
        self.bindings[(m.origin, m.binding)] = _QueryBinding(
            m.epoch,
            m.q_offset,
            BoundPart.from_part(part, self.device),
            BoundPart.from_part(part, self.device, packed=True),
        )

    def run(self, m: messages.RunQuery) -> None:
        b: _QueryBinding = self.binding(m.origin, m.binding)
        pool_layer = self.own.pool.layer(self.check_layer(m.layer))
        lo, hi = b.q_offset, b.q_offset + b.num_rows
        if m.tag < 0:
            origin = self.peer_views(m.origin)
            if self.sync is not None:
                self.sync.wait(m.origin)
            o, lse = b.part.attend(origin.q[lo:], pool_layer, self.backend)
            origin.out_o[self.instance_id, lo:hi].copy_(o)
            origin.out_lse[self.instance_id, lo:hi].copy_(lse)
            if self.sync is not None:
                self.sync.finish()
            return
        model = self.layout.model
        self.staging.reset()
        q = self.staging.empty((b.num_rows, model.num_q_heads, model.head_dim), model.torch_dtype)
        self._wait([process_group.recv(self.group, q, process_group.DRIVER_RANK, m.tag)], "q rows")
        o, lse = b.packed.attend(q, pool_layer, self.backend)
        o, lse = o.contiguous(), lse.contiguous()
        if self.sync is not None:
            self.sync.finish()
        self._wait(
            [
                process_group.send(self.group, o, process_group.DRIVER_RANK, m.tag + 1),
                process_group.send(self.group, lse, process_group.DRIVER_RANK, m.tag + 2),
            ],
            "(o, lse)",
        )

    def _wait(self, works: list, what: str) -> None:
        process_group.wait_works(
            [(w, process_group.DRIVER_RANK) for w in works],
            self.host.num_instances,
            self.host.timeout_s,
            what,
        )
