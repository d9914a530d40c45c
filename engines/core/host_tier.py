"""The host tier on the data plane: ``num_blocks`` segments of host memory below the pool, in
the pool's page layout, and the copies of the transfer plans' host-tier runs
(:class:`~tokenlake.plans.TransferPlan` ``demote_*`` and ``load_*``; the control plane's side
is :mod:`tokenlake.tree.host_tier`).

On CPU the tier is its own shared-memory region (``share_memory_()``), and a demotion or a
load is the segment copy that copy-on-extend and replication use
(:func:`~tokenlake.engines.core.puts.copy_segment`), done when the plan is bound.

On CUDA the tier is pinned host memory. A demotion is a synchronous device-to-host copy (its
slot is written right after). Loads are asynchronous host-to-device copies on a side stream,
issued layer by layer with one event per layer, so that layer ``l``'s load overlaps the
compute of the layers before it: a query of layer ``l`` makes the current stream wait for
layer ``l``'s event only (:meth:`HostTierStore.wait`), and a copy-on-extend reading a loaded
slot waits for all of them. Written, not run on a GPU.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from tokenlake.config import ModelShape
from tokenlake.engines.core import puts
from tokenlake.engines.core.kv_pool import KVPool


class HostTierStore:
    """``blocks``: a :class:`KVPool` of ``num_blocks`` host-memory pages, the tier's blocks."""

    def __init__(
        self, model: ModelShape, num_blocks: int, segment_len: int, device: torch.device | str
    ) -> None:
        self.device = torch.device(device)
        pinned = self.device.type == "cuda"
        shape = (model.num_layers, num_blocks, 2, segment_len, model.num_kv_heads, model.head_dim)
        data = torch.zeros(shape, dtype=model.torch_dtype, pin_memory=pinned)
        if not pinned:
            data.share_memory_()  # mapped by every process of the host that moves segments
        self.blocks = KVPool(model, num_blocks, segment_len, data=data)
        self.segment_len = segment_len
        self._stream = None  # CUDA: the side stream of the loads
        self._events: dict[int, list] = defaultdict(list)  # CUDA: layer -> load events

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_slots

    def demote(self, pool: KVPool, slot: int, block: int) -> None:
        """Copy ``slot`` of ``pool`` (all layers) into ``block``; done when it returns."""
        puts.copy_segment(pool, slot, self.blocks, block, self.segment_len)

    def load(self, loads: Sequence[tuple[int, KVPool, int]]) -> None:
        """Copy each ``(block, pool, slot)``'s block into the slot: at once on CPU, queued
        on the side stream on CUDA (see :meth:`wait`)."""
        if not loads:
            return
        if self.device.type != "cuda":
            for block, pool, slot in loads:
                puts.copy_segment(self.blocks, block, pool, slot, self.segment_len)
            return
        self._load_async(loads)

    def _load_async(self, loads: Sequence[tuple[int, KVPool, int]]) -> None:  # not run on a GPU
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after the demotions
        with torch.cuda.stream(stream):
            for layer in range(self.blocks.num_layers):
                src = self.blocks.layer(layer)
                for block, pool, slot in loads:
                    pool.layer(layer)[slot].copy_(src[block], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
                self._events[layer].append(event)

    def wait(self, layer: int | None = None) -> None:
        """The current stream waits for the loads of ``layer`` (all layers: ``None``); a
        no-op on CPU, where loads are done when :meth:`load` returns."""
        if not self._events:
            return
        current = torch.cuda.current_stream(self.device)
        layers = list(self._events) if layer is None else [layer]
        for ev in (e for lay in layers for e in self._events.pop(lay, ())):
            current.wait_event(ev)
