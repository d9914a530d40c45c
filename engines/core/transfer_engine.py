"""The transfer engine of one instance (docs/architecture.md#the-floors): the writes into the instance's slot
pool that its own host's processes cannot do directly — puts of new KV and segment copies
from another host (over the point-to-point group), and copies inside its host ordered by a
client on another host. Inside one host, clients write puts and copies directly (see
:mod:`tokenlake.engines.client.driver`); no two writers ever target the same slot range in one
iteration. Every run, slot, length, peer and tag is checked before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tokenlake.engines.core import puts
from tokenlake.engines.core.engine_base import TAG_SPACE, EngineBase, EngineHost
from tokenlake.engines.transport import messages, process_group
from tokenlake.errors import InvalidArgumentError
from tokenlake.plan_wire import check_array, check_runs, check_values


@dataclass(eq=False)
class _PutBinding:
    epoch: int
    runs: np.ndarray  # packed runs, as PutRuns.as_array()
    num_rows: int


class TransferEngine(EngineBase):
    role = "transfer"

    def __init__(self, host: EngineHost, group=None, membership=None) -> None:
        super().__init__(host, group, membership)
        self.handlers[messages.BindPut] = self.bind
        self.handlers[messages.Put] = self.put
        self.handlers[messages.CopyLocal] = self.copy_local
        self.handlers[messages.CopyRemote] = self.copy_remote

    def bind(self, m: messages.BindPut) -> None:
        runs = puts.PutRuns(m.src_row, m.length, m.dst_slot, m.dst_offset)
        num_rows = int(np.asarray(check_array("length", m.length), dtype=np.int64).sum())
        if num_rows > self.layout.max_kv_rows:
            raise InvalidArgumentError(
                f"length: {num_rows} rows, at most {self.layout.max_kv_rows}"
            )
        check_runs("put", m.src_row, m.length, m.dst_slot, m.dst_offset, num_rows, self.limits)
        self.add_binding(
            m.origin, m.epoch, m.binding, _PutBinding(m.epoch, runs.as_array(), num_rows)
        )

    def put(self, m: messages.Put) -> None:
        """Receive one layer of packed put rows from another host and store them."""
        b: _PutBinding = self.binding(m.origin, m.binding)
        layer = self.check_layer(m.layer)
        self.check_tag(m.tag, remote=True)
        model = self.layout.model
        self.staging.reset()
        rows = self.staging.empty(
            (b.num_rows, 2, model.num_kv_heads, model.head_dim), model.torch_dtype
        )
        client = self.client_rank(m.origin)
        work = process_group.recv(self.group, rows, client, m.tag)
        self._wait([(work, client)], "put rows")
        puts.write_runs(self.own.pool, b.runs, rows, layer)
        if self.sync is not None:
            self.sync.finish()
        self.stats["put_calls"] += 1
        self.stats["put_bytes"] += rows.numel() * rows.element_size()

    def _check_copies(self, prefix: str, slots, lengths, n: int) -> None:
        lim = self.limits
        check_values(f"{prefix}slot", check_array(f"{prefix}slot", slots, n), 0, lim.num_slots)
        check_values(
            f"{prefix}len", check_array(f"{prefix}len", lengths, n), 0, lim.segment_len + 1
        )

    def copy_local(self, m: messages.CopyLocal) -> None:
        n = len(check_array("src_instance", m.src_instance))
        views = [self.peer_views(i) for i in m.src_instance.tolist()]
        self._check_copies("src_", m.src_slot, m.length, n)
        self._check_copies("dst_", m.dst_slot, m.length, n)
        for view, src_slot, dst_slot, length in zip(
            views, m.src_slot.tolist(), m.dst_slot.tolist(), m.length.tolist(), strict=True
        ):
            puts.copy_segment(view.pool, src_slot, self.own.pool, dst_slot, length)
        if self.sync is not None:
            self.sync.finish()
        self.stats["copy_calls"] += 1

    def copy_remote(self, m: messages.CopyRemote) -> None:
        if self.group is None:
            raise InvalidArgumentError("copy: this engine has no point-to-point group")
        sides = []
        for side in ("recv", "send"):
            peers = getattr(m, f"{side}_peer")
            n = len(check_array(f"{side}_peer", peers))
            self.check_rank(f"{side}_peer", peers)
            self._check_copies(f"{side}_", getattr(m, f"{side}_slot"), getattr(m, f"{side}_len"), n)
            tags = check_array(f"{side}_tag", getattr(m, f"{side}_tag"), n)
            check_values(f"{side}_tag", tags, 0, TAG_SPACE)
            sides.append(
                zip(peers.tolist(), getattr(m, f"{side}_slot").tolist(),
                    getattr(m, f"{side}_len").tolist(), tags.tolist(), strict=True)
            )  # fmt: skip
        pool = self.own.pool
        self.staging.reset()
        ops, received = [], []
        for k, rows in enumerate(sides):
            for peer, slot, length, tag in rows:
                view = puts.segment_view(pool, slot, length)
                buf = self.staging.empty(tuple(view.shape), view.dtype)
                if k == 0:
                    received.append((view, buf))
                else:
                    buf.copy_(view)  # held by its op until the send completed
                ops.append(process_group.P2POp(("recv", "send")[k], buf, peer, tag))
        # in the order the peers post theirs (by tag): a two-way exchange cannot deadlock
        posted = process_group.post(self.group, ops)
        self._wait([(work, op.peer) for work, op in posted], "segment copies")
        for view, buf in received:
            view.copy_(buf)
        if self.sync is not None:
            self.sync.finish()
        self.stats["copy_calls"] += 1

    def _wait(self, works: list, what: str) -> None:
        process_group.wait_works(works, self.host.num_instances, self.host.timeout_s, what)
