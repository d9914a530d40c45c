"""The transfer engine of one instance (DESIGN §2.2): the writes into the instance's slot
pool that its own host's processes cannot do directly — puts of new KV and segment copies
from another host (over the point-to-point group), and copies inside its host ordered by a
client on another host. Inside one host, clients write puts and copies directly (see
:mod:`tokenlake.engines.driver`); no two writers ever target the same slot range in one
iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenlake.engines import executor, messages, process_group
from tokenlake.engines.engine_base import EngineBase, EngineHost


@dataclass(eq=False)
class _PutBinding:
    epoch: int
    runs: list  # packed runs, as PutRuns.as_lists()
    num_rows: int


class TransferEngine(EngineBase):
    role = "transfer"

    def __init__(self, host: EngineHost, group=None) -> None:
        super().__init__(host, group)
        self.handlers[messages.BindPut] = self.bind
        self.handlers[messages.Put] = self.put
        self.handlers[messages.CopyLocal] = self.copy_local
        self.handlers[messages.CopyRemote] = self.copy_remote

    def bind(self, m: messages.BindPut) -> None:
        self.drop_older(m.origin, m.epoch)
        runs = executor.PutRuns(m.src_row, m.length, m.dst_slot, m.dst_offset)
        self.bindings[(m.origin, m.binding)] = _PutBinding(m.epoch, runs.as_lists(), runs.num_rows)

    def put(self, m: messages.Put) -> None:
        """Receive one layer of packed put rows from another host and store them."""
        b: _PutBinding = self.binding(m.origin, m.binding)
        layer = self.check_layer(m.layer)
        model = self.layout.model
        self.staging.reset()
        rows = self.staging.empty(
            (b.num_rows, 2, model.num_kv_heads, model.head_dim), model.torch_dtype
        )
        work = process_group.recv(self.group, rows, process_group.DRIVER_RANK, m.tag)
        self._wait([(work, process_group.DRIVER_RANK)], "put rows")
        executor.write_runs(self.own.pool, b.runs, rows, layer)
        if self.sync is not None:
            self.sync.finish()

    def copy_local(self, m: messages.CopyLocal) -> None:
        for src, src_slot, dst_slot, n in zip(
            m.src_instance.tolist(),
            m.src_slot.tolist(),
            m.dst_slot.tolist(),
            m.length.tolist(),
            strict=True,
        ):
            executor.copy_segment(self.peer_views(src).pool, src_slot, self.own.pool, dst_slot, n)
        if self.sync is not None:
            self.sync.finish()

    def copy_remote(self, m: messages.CopyRemote) -> None:
        pool = self.own.pool
        self.staging.reset()
        works, received, sent = [], [], []
        for peer, slot, n, tag in zip(
            m.recv_peer.tolist(),
            m.recv_slot.tolist(),
            m.recv_len.tolist(),
            m.recv_tag.tolist(),
            strict=True,
        ):
            view = executor.segment_view(pool, slot, n)
            buf = self.staging.empty(tuple(view.shape), view.dtype)
            works.append((process_group.recv(self.group, buf, peer, tag), peer))
            received.append((slot, n, buf))
        for peer, slot, n, tag in zip(
            m.send_peer.tolist(),
            m.send_slot.tolist(),
            m.send_len.tolist(),
            m.send_tag.tolist(),
            strict=True,
        ):
            view = executor.segment_view(pool, slot, n)
            buf = self.staging.empty(tuple(view.shape), view.dtype)
            buf.copy_(view)
            works.append((process_group.send(self.group, buf, peer, tag), peer))
            sent.append(buf)  # alive until the send completed
        self._wait(works, "segment copies")
        for slot, n, buf in received:
            executor.segment_view(pool, slot, n).copy_(buf)
        if self.sync is not None:
            self.sync.finish()

    def _wait(self, works: list, what: str) -> None:
        process_group.wait_works(works, self.host.num_instances, self.host.timeout_s, what)
