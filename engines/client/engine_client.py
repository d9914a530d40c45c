"""The engine client of one instance: the data-plane API a compute engine uses
(:class:`tokenlake.engines.protocol.Engine`), the same over every transport.

Plans are bound per ``(origin, epoch)``: binding a plan of a newer epoch at this instance
retires the older ones, and :meth:`EngineClient.retire` retires an epoch the control plane
committed or aborted; plans and buffers of a retired epoch raise ``StalePlanError``
(:mod:`.epoch_bindings`). The client never asks the control plane anything.

Where each part runs: this instance's own part of a query in this process (its memory is
here), every other holder's part in that holder's query engine. ``q_buf``/``kv_buf`` are
views of this instance's buffers, carved consecutively per epoch (capacity:
``DataPlaneConfig.max_q_rows`` / ``max_kv_rows``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenlake.engines.client import plan_checks
from tokenlake.engines.client.driver import Driver
from tokenlake.engines.core import executor, puts
from tokenlake.engines.core.epoch_bindings import EpochBindings
from tokenlake.engines.core.executor import BoundPart, MergeLayout
from tokenlake.engines.core.puts import LocalPut
from tokenlake.engines.transport import messages, process_group
from tokenlake.plans import QueryPlan, TransferPlan
from tokenlake.validate import check_int


@dataclass(eq=False)
class _BoundQuery:
    plan: QueryPlan
    binding: int
    offset: int
    buf: torch.Tensor
    parts: list[BoundPart]  # in plan order; rows index buf
    merge: MergeLayout  # the parts' one merge per layer, built at bind


@dataclass(eq=False)
class _BoundTransfer:
    plan: TransferPlan
    binding: int
    buf: torch.Tensor
    local: list[LocalPut]  # destinations in this host, written directly
    remote: list[tuple[int, list]]  # (instance, packed runs) sent to its transfer engine
    host: np.ndarray | None  # CPU: buf's bytes as numpy, converted once (not per put)
    layer_bytes: int


class EngineClient:
    """The data-plane API of one instance (see :class:`~tokenlake.engines.protocol.Engine`)."""

    def __init__(self, instance_id: int, driver: Driver) -> None:
        self.instance_id = instance_id
        self._driver = driver
        self._bindings = EpochBindings(instance_id)
        min_bytes = driver.config.put_parallel_min_bytes
        self._put_min_bytes = puts.PUT_PARALLEL_MIN_BYTES if min_bytes is None else min_bytes

    @property
    def _views(self):
        return self._driver.views[self.instance_id]

    @property
    def _layout(self):
        return self._driver.layout

    # ---- epochs --------------------------------------------------------------------------
    def retire(self, epoch: int) -> None:
        """The control plane committed or aborted ``epoch``: its plans and buffers are stale
        from now on. Waits for this instance's puts still in flight."""
        epoch = check_int("epoch", epoch, low=0)
        self._driver.flush(f"retiring iteration {epoch}")
        self._bindings.retire(epoch)

    # ---- query ---------------------------------------------------------------------------
    def init_query(self, query_plan: QueryPlan) -> torch.Tensor:
        """Bind a query plan; returns ``q_buf`` ``[num_rows, H_q, D]`` (model dtype), a view of
        this instance's q buffer, for the compute engine to write q into per layer."""
        executor.check_plan("query_plan", query_plan, QueryPlan, self.instance_id)
        plan_checks.check_query(query_plan, self._driver)  # before anything is bound
        self._bindings.admit("query_plan", query_plan, QueryPlan)
        n = query_plan.num_rows
        offset = self._bindings.reserve("q", n, "query_plan", self._layout.max_q_rows)
        d = self._driver
        binding = d.new_binding()
        tickets = []
        for part in query_plan.parts:
            if part.instance_id == self.instance_id:
                continue
            tickets.append(
                d.channel.request(
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
                )  # fmt: skip
            )
        d.channel.wait(tickets, "init_query")
        device = self._views.q.device
        own = self.instance_id
        cap, page_len = d.layout.model.logit_cap, d.layout.segment_len
        parts = [
            BoundPart.from_part(
                p,
                device,
                planner=d.planner if p.instance_id == own else None,
                logit_cap=cap,
                page_len=page_len,
            )
            for p in query_plan.parts
        ]
        buf = self._views.q[offset : offset + n]
        merge = MergeLayout.build(parts, own, offset, self._views.out_o.shape[1], n)
        self._bindings.add("q", _BoundQuery(query_plan, binding, offset, buf, parts, merge))
        return buf

    def query(self, q_buf: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix attention of ``q_buf``'s rows over the whole pool for ``layer``: this
        instance's part here, every other holder's part in its query engine (after this
        instance's puts of ``layer`` landed), merged.

        Returns ``o`` ``[num_rows, H_q, D]`` float32 and ``lse`` ``[num_rows, H_q]`` float32
        (natural log; ``-inf`` for rows with an empty prefix).
        Raises :class:`~tokenlake.engines.dataplane_config.PeerFailedError` if a holder
        fails or does not answer within the timeout.
        """
        start = time.perf_counter()
        bound = self._bindings.lookup("q", "q_buf", q_buf, "init_query")
        layer = check_int("layer", layer, low=0, high=self._layout.model.num_layers)
        d = self._driver
        d.wait_puts(layer, f"puts of layer {layer}")
        d.wait_tier(layer)
        if d.events is not None:
            d.events.record(self.instance_id)
        views, off = self._views, bound.offset
        tickets, works, rung, ops = [], [], [], []
        bells = getattr(d, "doorbells", None)  # set by launchers whose engines have them
        for part in bound.parts:
            h, m = part.instance_id, part.num_rows
            if h == self.instance_id:
                continue
            if bells is not None and bells.serves(h) and d.same_host(self.instance_id, h):
                rung.append(bells.ring(h, self.instance_id, bound.binding, layer))
                continue
            tag = -1
            if not d.same_host(self.instance_id, h):
                tag, rank = d.new_tag(), d.rank("query", h)
                o_dst, lse_dst = views.out_o[h, off : off + m], views.out_lse[h, off : off + m]
                rows = bound.buf.index_select(0, part.rows)
                ops += [
                    process_group.P2POp("send", rows, rank, tag),
                    process_group.P2POp("recv", o_dst, rank, tag + 1),
                    process_group.P2POp("recv", lse_dst, rank, tag + 2),
                ]
            tickets.append(
                d.channel.request(
                    ("query", h),
                    lambda seq, t=tag: messages.RunQuery(
                        seq, self.instance_id, bound.binding, layer, t
                    ),
                )
            )
        # every holder's rows, then its results, in the order the holders post theirs
        for work, op in process_group.post(d.group, ops) if ops else ():
            works.append(d.watch(work, op.peer, op.tensor if op.kind == "send" else None))
        # overlaps with the peers' work
        own = bound.merge.attend_own(bound.buf, views.pool.layer(layer), d.backend)
        if rung:
            bells.wait(rung, f"query of layer {layer}")
        if tickets or works:
            d.wait(tickets, works, f"query of layer {layer}")
        o, lse = bound.merge.merge(own, views.out_o, views.out_lse, bound.buf)
        q = bound.buf
        d.count_call("query", start, q.numel() * q.element_size() + (o.numel() + lse.numel()) * 4)
        return o, lse

    # ---- transfer ------------------------------------------------------------------------
    def init_transfer(self, transfer_plan: TransferPlan) -> torch.Tensor:
        """Bind a transfer plan and run its segment copies; returns ``kv_buf``
        ``[num_layers, num_rows, 2, H_kv, D]`` (model dtype), a view of this instance's kv
        buffer, for the compute engine's new K and V."""
        executor.check_plan("transfer_plan", transfer_plan, TransferPlan, self.instance_id)
        # this process may write the runs and copies itself: nothing else checks them
        plan_checks.check_transfer(transfer_plan, self._driver)
        self._bindings.admit("transfer_plan", transfer_plan, TransferPlan)
        d = self._driver
        n = transfer_plan.num_rows
        offset = self._bindings.reserve("kv", n, "transfer_plan", self._layout.max_kv_rows)
        d.run_tier_moves(transfer_plan)  # before the copies: one may read a loaded slot
        d.run_copies(transfer_plan)
        binding = d.new_binding()
        tickets, local, remote = [], [], []
        for k, h in enumerate(transfer_plan.dst_ids.tolist()):
            runs = puts.put_runs(transfer_plan, k)
            if d.same_host(self.instance_id, h):
                local.append(LocalPut.bind(d.views[h].pool, runs.as_array()))
                continue
            packed = runs.packed()
            tickets.append(
                d.channel.request(
                    ("transfer", h),
                    lambda seq, r=packed: messages.BindPut(
                        seq,
                        self.instance_id,
                        transfer_plan.epoch,
                        binding,
                        r.src_row,
                        r.length,
                        r.dst_slot,
                        r.dst_offset,
                    ),
                )  # fmt: skip
            )
            remote.append((h, runs.as_lists()))
        if tickets:
            d.channel.wait(tickets, "init_transfer")
        buf = self._views.kv[:, offset : offset + n]
        host = puts.host_rows(buf) if buf.device.type == "cpu" and local else None
        layer_bytes = buf[0].numel() * buf.element_size()
        self._bindings.add(
            "kv", _BoundTransfer(transfer_plan, binding, buf, local, remote, host, layer_bytes)
        )
        return buf

    def put(self, kv_buf: torch.Tensor, layer: int) -> None:
        """Store ``kv_buf[layer]`` into the planned slots. Inside this host the rows are
        written directly; to another host they are sent and the call returns at once (the
        data lands before any later ``query`` of ``layer`` from this instance, and before
        :meth:`synchronize` returns). Do not rewrite ``kv_buf[layer]`` until then."""
        start = time.perf_counter()
        bound = self._bindings.lookup("kv", "kv_buf", kv_buf, "init_transfer")
        layer = check_int("layer", layer, low=0, high=self._layout.model.num_layers)
        d = self._driver
        if bound.local:
            rows = bound.host[layer] if bound.host is not None else bound.buf[layer]
            for dest in bound.local:
                dest.write(rows, layer, self._put_min_bytes)
        for h, runs in bound.remote:
            tag = d.new_tag()
            ticket = d.channel.request(
                ("transfer", h),
                lambda seq, t=tag: messages.Put(seq, self.instance_id, bound.binding, layer, t),
            )
            rows = puts.gather_runs(bound.buf[layer], runs)
            rank = d.rank("transfer", h)
            d.record_put(layer, ticket, process_group.send(d.group, rows, rank, tag), rank, rows)
        d.count_call("put", start, bound.layer_bytes)

    def synchronize(self) -> None:
        """Wait until every put of this instance has landed (call it before reporting an
        iteration done, so the control plane may commit it)."""
        self._driver.flush("synchronize")
        if self._driver.events is not None:
            import torch.cuda

            torch.cuda.current_stream().synchronize()
