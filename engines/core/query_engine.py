"""The query engine of one instance (docs/architecture.md#the-floors): partial attention with LSE of peers' query
rows over this instance's segments.

On one host it reads the origin's q rows straight from the origin's shared q buffer and
writes ``(o, lse)`` into the origin's shared output region (region = this instance's id). From
another host the rows arrive, and the results leave, over the point-to-point group. Every
bound part is checked against this engine's geometry before it is kept: rows inside the
origin's buffers, CSR offsets covering their arrays, slots and lengths inside the pool.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

from tokenlake.engines.core.engine_base import EngineBase, EngineHost
from tokenlake.engines.core.executor import BoundPart
from tokenlake.engines.transport import doorbell, messages, process_group
from tokenlake.errors import InvalidArgumentError
from tokenlake.latency import observe
from tokenlake.plan_wire import check_array, check_id, check_indptr, check_values
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

    def __init__(self, host: EngineHost, group=None, membership=None) -> None:
        super().__init__(host, group, membership)
        self.handlers[messages.BindQuery] = self.bind
        self.handlers[messages.RunQuery] = self.run
        self.doorbells: doorbell.DoorbellServer | None = None
        raw = host.buffers[self.instance_id].doorbells
        if raw is not None and group is None:  # every origin is on this host
            area = doorbell.DoorbellArea(raw, host.num_instances)
            self.doorbells = doorbell.DoorbellServer(area, self.ring, self._count_error)
        # one kernel call at a time where the doorbell thread and the message loop share the
        # pool; without doorbells there is one thread (and an in-process cluster stays copyable)
        self._attend_lock = threading.Lock() if self.doorbells else contextlib.nullcontext()

    def configure(self, m: messages.Configure) -> None:
        super().configure(m)
        if self.doorbells is not None:
            self.doorbells.rebase()  # nothing rung for the old layout is served
            if not self.doorbells.started:
                self.doorbells.start()

    def bind(self, m: messages.BindQuery) -> None:
        lim, rows_cap = self.limits, self.layout.max_q_rows
        check_id("origin", m.origin, lim.num_instances)
        offset = check_id("q_offset", m.q_offset, rows_cap)
        rows = check_array("rows", m.rows)
        if offset + len(rows) > rows_cap:
            raise InvalidArgumentError(f"rows: {len(rows)} rows from {offset} overflow {rows_cap}")
        check_values("rows", rows, 0, rows_cap - offset)
        num_reqs = len(check_array("q_indptr", m.q_indptr)) - 1
        check_indptr("q_indptr", m.q_indptr, max(num_reqs, 0), len(rows))
        check_indptr(
            "kv_indptr", m.kv_indptr, num_reqs, len(check_array("kv_indices", m.kv_indices))
        )
        check_values("kv_indices", m.kv_indices, 0, lim.num_slots)
        check_values(
            "last_len", check_array("last_len", m.last_len, num_reqs), 1, lim.segment_len + 1
        )
        part = HolderPart(self.instance_id, rows, m.q_indptr, m.kv_indptr, m.kv_indices, m.last_len)
        kernel = dict(
            planner=self.planner, logit_cap=self.layout.model.logit_cap, page_len=lim.segment_len
        )
        binding = _QueryBinding(
            m.epoch,
            offset,
            BoundPart.from_part(part, self.device, **kernel),
            BoundPart.from_part(part, self.device, packed=True, **kernel),
        )
        self.add_binding(m.origin, m.epoch, m.binding, binding)
        if self.doorbells is not None:
            self.doorbells.wake()  # its layers are rung next

    def ring(self, origin: int, binding: int, layer: int) -> None:
        """A doorbell: ``origin`` asks for ``binding``'s part at ``layer`` (the words came
        from shared memory: checked like a message's fields)."""
        start, t0 = time.perf_counter(), time.thread_time_ns()
        self.stats["doorbell_calls"] += 1
        try:
            check_id("binding", binding, 1 << 62)
            b: _QueryBinding = self.binding(origin, binding)
            self._attend_shared(origin, b, self.check_layer(layer))
        finally:
            self.stats["query_thread_ns"] += time.thread_time_ns() - t0
        # timed like a RunQuery message: one latency count per call that succeeded
        observe(self.stats, "RunQuery_seconds", time.perf_counter() - start)

    def _count_error(self, error: Exception) -> None:
        self.stats["errors"] += 1

    def run(self, m: messages.RunQuery) -> None:
        t0 = time.thread_time_ns()
        try:
            self._run(m)
        finally:  # this engine's share of the work (benchmarks charge it to this instance)
            self.stats["query_thread_ns"] += time.thread_time_ns() - t0

    def _run(self, m: messages.RunQuery) -> None:
        b: _QueryBinding = self.binding(m.origin, m.binding)
        pool_layer = self.own.pool.layer(self.check_layer(m.layer))
        remote = m.tag != -1
        self.check_tag(m.tag, remote)
        if not remote:
            self._attend_shared(m.origin, b, m.layer)
            return
        self.stats["query_calls"] += 1
        model = self.layout.model
        self.staging.reset()
        q = self.staging.empty((b.num_rows, model.num_q_heads, model.head_dim), model.torch_dtype)
        client = self.client_rank(m.origin)
        self._wait([process_group.recv(self.group, q, client, m.tag)], client, "q rows")
        with self._attend_lock:
            o, lse = b.packed.attend(q, pool_layer, self.backend)
        o, lse = o.contiguous(), lse.contiguous()
        if self.sync is not None:
            self.sync.finish()
        self._wait(
            [
                process_group.send(self.group, o, client, m.tag + 1),
                process_group.send(self.group, lse, client, m.tag + 2),
            ],
            client,
            "(o, lse)",
        )
        self.stats["query_bytes"] += q.numel() * q.element_size() + (o.numel() + lse.numel()) * 4

    def _attend_shared(self, origin_id: int, b: _QueryBinding, layer: int) -> None:
        """Read the origin's q rows from its shared q buffer, write ``(o, lse)`` into its
        shared output region (``layer`` checked by the caller)."""
        pool_layer = self.own.pool.layer(layer)
        lo, hi = b.q_offset, b.q_offset + b.num_rows
        origin = self.peer_views(origin_id)
        with self._attend_lock:
            self.stats["query_calls"] += 1
            if self.sync is not None:
                self.sync.wait(origin_id)
            o, lse = b.part.attend(origin.q[lo:], pool_layer, self.backend)
            origin.out_o[self.instance_id, lo:hi].copy_(o)
            origin.out_lse[self.instance_id, lo:hi].copy_(lse)
            if self.sync is not None:
                self.sync.finish()
        self.stats["query_bytes"] += o.numel() * 4 + lse.numel() * 4

    def _wait(self, works: list, peer: int, what: str) -> None:
        process_group.wait_works(
            [(w, peer) for w in works], self.host.num_instances, self.host.timeout_s, what
        )
