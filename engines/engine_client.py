"""The compute-engine side of one instance: ``init_query``/``query``/``init_transfer``/``put``
(the same API as :class:`tokenlake.engines.local_cluster.LocalEngine`), executed by the
query and transfer engine processes of the cluster.

Plans are validated here against the pool's active epoch (the control plane lives with the
clients); engines learn plans from bind messages. ``q_buf``/``kv_buf`` are views of this
instance's shared buffers, carved consecutively per iteration (capacity:
``DataPlaneConfig.max_q_rows`` / ``max_kv_rows``).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from tokenlake.engines import executor, messages, process_group
from tokenlake.engines.driver import Driver
from tokenlake.errors import InvalidArgumentError, StalePlanError
from tokenlake.plans import QueryPlan, TransferPlan
from tokenlake.pool import Pool
from tokenlake.validate import check_int, check_tensor


@dataclass(eq=False)
class _BoundQuery:
    plan: QueryPlan
    binding: int
    offset: int
    parts: list[executor.PreparedPart]
    buf: torch.Tensor
    identity: bool  # one holder covering every row in order: no merge needed


@dataclass(eq=False)
class _BoundTransfer:
    plan: TransferPlan
    binding: int
    buf: torch.Tensor
    dests: list[tuple[int, executor.PutRuns, bool]]  # (instance, runs, remote)


class EngineClient:
    """The data-plane API of one instance, backed by engine processes."""

    def __init__(self, instance_id: int, pool: Pool, driver: Driver) -> None:
        self.instance_id = instance_id
        self._pool = pool
        self._driver = driver
        self._queries: dict[int, _BoundQuery] = {}
        self._transfers: dict[int, _BoundTransfer] = {}
        self._stale: dict[int, weakref.ref] = {}  # buffers handed out in earlier iterations
        self._used = {"q": [None, 0], "kv": [None, 0]}  # kind -> [epoch, rows handed out]

    @property
    def _views(self):
        return self._driver.views[self.instance_id]

    @property
    def _layout(self):
        return self._driver.layout

    def _check_plan(self, name: str, plan, kind: type) -> None:
        executor.check_plan(name, plan, kind, self.instance_id, self._pool.active_epoch)

    def _reserve(self, kind: str, rows: int, epoch: int, name: str, capacity: int) -> int:
        """First row of ``rows`` fresh rows of the shared ``kind`` buffer for this iteration."""
        used = self._used[kind]
        if used[0] != epoch:
            used[0], used[1] = epoch, 0
        if used[1] + max(rows, 1) > capacity:
            raise InvalidArgumentError(
                f"{name}: needs {rows} {kind} rows, but only {capacity - used[1]} of the "
                f"cluster's {capacity} (DataPlaneConfig.max_{kind}_rows) are free this iteration"
            )
        offset = used[1]
        used[1] += max(rows, 1)  # never two buffers with one data_ptr
        return offset

    def init_query(self, query_plan: QueryPlan) -> torch.Tensor:
        """Bind a query plan; returns ``q_buf`` ``[num_rows, H_q, D]`` (model dtype), a view of
        this instance's shared q buffer, for the compute engine to write q into per layer."""
        self._check_plan("query_plan", query_plan, QueryPlan)
        n = query_plan.num_rows
        offset = self._reserve("q", n, query_plan.epoch, "query_plan", self._layout.max_q_rows)
        d = self._driver
        binding = d.new_binding()
        tickets = []
        for part in query_plan.parts:
            tickets.append(
                d.requester.request(
                    ("query", part.instance_id),
                    lambda seq, p=part: messages.BindQuery(
                        seq,
                        self.instance_id,
                        query_plan.epoch,
                        binding,
                        offset,
                        p.rows,
                        p.q_indptr,
                        p.kv_indptr,
                        p.kv_indices,
                        p.last_len,
                    ),
                )
            )
        d.requester.wait(tickets, "init_query")
        parts = executor.prepare_query(query_plan, self._views.q.device)
        identity = len(parts) == 1 and np.array_equal(
            query_plan.parts[0].rows, np.arange(n, dtype=np.int32)
        )
        buf = self._views.q[offset : offset + n]
        self._queries = self._prune(self._queries, query_plan.epoch)
        self._queries[buf.data_ptr()] = _BoundQuery(
            query_plan, binding, offset, parts, buf, identity
        )
        return buf

    def query(self, q_buf: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix attention of ``q_buf``'s rows over the whole pool for ``layer``: scatter the
        rows to every holder, wait for the puts of ``layer`` first, merge the holders' states.

        Returns ``o`` ``[num_rows, H_q, D]`` float32 and ``lse`` ``[num_rows, H_q]`` float32
        (natural log; ``-inf`` for rows with an empty prefix).
        Raises :class:`~tokenlake.engines.dataplane_config.PeerFailedError` if a holder
        fails or does not answer within the timeout.
        """
        bound = self._bound(self._queries, "q_buf", q_buf, "init_query")
        layer = check_int("layer", layer, low=0, high=self._layout.model.num_layers)
        self._check_plan("q_buf", bound.plan, QueryPlan)
        d = self._driver
        d.wait_puts(layer, f"puts of layer {layer}")
        if d.events is not None:
            d.events.record(self.instance_id)
        views, off = self._views, bound.offset
        tickets, works = [], []
        for part, prepared in zip(bound.plan.parts, bound.parts, strict=True):
            h, m = part.instance_id, len(part.rows)
            tag = -1
            if not d.same_host(self.instance_id, h):
                tag, rank = d.new_tag(), d.rank("query", h)
                o_dst, lse_dst = views.out_o[h, off : off + m], views.out_lse[h, off : off + m]
                works.append(d.watch(process_group.recv(d.group, o_dst, rank, tag + 1), rank))
                works.append(d.watch(process_group.recv(d.group, lse_dst, rank, tag + 2), rank))
                rows = bound.buf.index_select(0, prepared.rows)
                works.append(d.watch(process_group.send(d.group, rows, rank, tag), rank, rows))
            tickets.append(
                d.requester.request(
                    ("query", h),
                    lambda seq, t=tag: messages.RunQuery(
                        seq, self.instance_id, bound.binding, layer, t
                    ),
                )
            )
        d.wait(tickets, works, f"query of layer {layer}")
        return self._merge(bound)

    def _merge(self, bound: _BoundQuery) -> tuple[torch.Tensor, torch.Tensor]:
        views, off, n = self._views, bound.offset, bound.plan.num_rows
        if bound.identity:
            h = bound.parts[0].instance_id
            return views.out_o[h, off : off + n].clone(), views.out_lse[h, off : off + n].clone()
        _, h_q, dim = bound.buf.shape
        o = torch.zeros((n, h_q, dim), dtype=torch.float32, device=bound.buf.device)
        lse = torch.full((n, h_q), -math.inf, dtype=torch.float32, device=bound.buf.device)
        for part in bound.parts:
            h, m = part.instance_id, part.rows.shape[0]
            o_p, lse_p = views.out_o[h, off : off + m], views.out_lse[h, off : off + m]
            executor.merge_rows(o, lse, part.rows, o_p, lse_p, self._driver.backend)
        return o, lse

    def init_transfer(self, transfer_plan: TransferPlan) -> torch.Tensor:
        """Bind a transfer plan and run its segment copies; returns ``kv_buf``
        ``[num_layers, num_rows, 2, H_kv, D]`` (model dtype), a view of this instance's shared
        kv buffer, for the compute engine's new K and V."""
        self._check_plan("transfer_plan", transfer_plan, TransferPlan)
        d = self._driver
        n = transfer_plan.num_rows
        d.flush("puts of the previous iteration")
        offset = self._reserve(
            "kv", n, transfer_plan.epoch, "transfer_plan", self._layout.max_kv_rows
        )
        d.run_copies(transfer_plan)
        binding = d.new_binding()
        tickets, dests = [], []
        for k, h in enumerate(transfer_plan.dst_ids.tolist()):
            runs = executor.put_runs(transfer_plan, k)
            remote = not d.same_host(self.instance_id, h)
            sent = runs.packed() if remote else runs
            tickets.append(
                d.requester.request(
                    ("transfer", h),
                    lambda seq, r=sent, off=(0 if remote else offset): messages.BindPut(
                        seq,
                        self.instance_id,
                        transfer_plan.epoch,
                        binding,
                        off,
                        r.src_row,
                        r.length,
                        r.dst_slot,
                        r.dst_offset,
                    ),
                )
            )
            dests.append((h, runs, remote))
        d.requester.wait(tickets, "init_transfer")
        buf = self._views.kv[:, offset : offset + n]
        self._transfers = self._prune(self._transfers, transfer_plan.epoch)
        self._transfers[buf.data_ptr()] = _BoundTransfer(transfer_plan, binding, buf, dests)
        return buf

    def put(self, kv_buf: torch.Tensor, layer: int) -> None:
        """Start storing ``kv_buf[layer]`` into the planned slots and return at once; the data
        lands before any later ``query`` of ``layer``. Do not rewrite ``kv_buf[layer]`` until
        then."""
        bound = self._bound(self._transfers, "kv_buf", kv_buf, "init_transfer")
        layer = check_int("layer", layer, low=0, high=self._layout.model.num_layers)
        self._check_plan("kv_buf", bound.plan, TransferPlan)
        d = self._driver
        if d.events is not None:
            d.events.record(self.instance_id)
        for h, runs, remote in bound.dests:
            tag = d.new_tag() if remote else -1
            ticket = d.requester.request(
                ("transfer", h),
                lambda seq, t=tag: messages.Put(seq, self.instance_id, bound.binding, layer, t),
            )
            if not remote:
                d.record_put(layer, ticket)
                continue
            rows = executor.gather_runs(bound.buf[layer], runs)
            rank = d.rank("transfer", h)
            d.record_put(layer, ticket, process_group.send(d.group, rows, rank, tag), rank, rows)

    def _prune(self, table: dict, epoch: int) -> dict:
        self._stale = {k: r for k, r in self._stale.items() if r() is not None}
        kept = {}
        for key, bound in table.items():
            if bound.plan.epoch == epoch:
                kept[key] = bound
            else:
                self._stale[id(bound.buf)] = weakref.ref(bound.buf)
        return kept

    def _bound(self, table: dict, name: str, buf: object, init: str):
        check_tensor(name, buf)
        ref = self._stale.get(id(buf))
        if ref is not None and ref() is buf:
            raise StalePlanError(f"{name}: a buffer of an earlier iteration")
        bound = table.get(buf.data_ptr())
        if bound is None:
            raise InvalidArgumentError(f"{name}: not a buffer returned by this engine's {init}()")
        check_tensor(
            name, buf, shape=tuple(bound.buf.shape), dtype=bound.buf.dtype, device=bound.buf.device
        )
        return bound
