"""One copy of the KV: an SGLang worker's KV cache *is* its pool instance's slot memory.

The instance stores every layer as ``[S, 2, C, H_kv, D]`` (slot ``s``: ``C`` K rows, then
``C`` V rows). Flattened per layer to ``[2·S·C, H_kv, D]``, SGLang's K buffer is the view
starting at row 0 and its V buffer the view starting at row ``C``, both ``2·S·C − C`` rows
long. SGLang's page ``2s`` (``page_size = C``) is then slot ``s``: token ``c`` of it has K at
row ``2sC + c`` and V at row ``2sC + C + c``, exactly where the slot keeps them. SGLang's
allocator hands out even pages only (:class:`SlotPageAllocator`; slot 0 is SGLang's padding
page), so no two pages overlap, and SGLang writes every new token's K/V straight into the
pool's slot: the pool records the segment there and puts nothing.

A page SGLang frees goes back to its free list only once the pool no longer reads it (a
running request on another worker may attend to it): the pool answers which pages are free
now, and returns the others later (``release_slots`` / ``reclaimed`` of
:class:`.shared_runtime.SharedPoolRuntime`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from tokenlake.errors import InvalidArgumentError


def slot_kv_views(pool_data: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """SGLang's per-layer K and V buffers over ``pool_data`` ``[L, S, 2, C, H_kv, D]``:
    ``([L] × [2SC − C, H_kv, D], [L] × [2SC − C, H_kv, D])``, views (no copy)."""
    if pool_data.dim() != 6 or pool_data.shape[2] != 2 or not pool_data.is_contiguous():
        raise InvalidArgumentError(
            f"pool_data: expected a contiguous [L, S, 2, C, H_kv, D] tensor, got "
            f"{list(pool_data.shape)}"
        )
    num_layers, num_slots, _, seg, h_kv, d = pool_data.shape
    rows = 2 * num_slots * seg
    flat = [pool_data[i].view(rows, h_kv, d) for i in range(num_layers)]
    return [f[: rows - seg] for f in flat], [f[seg:] for f in flat]


def sglang_size(num_slots: int, segment_len: int) -> int:
    """The ``size`` SGLang's KV pool and allocator are built with over ``num_slots`` slots:
    their buffers hold ``size + page_size = 2SC − C`` rows."""
    return 2 * segment_len * (num_slots - 1)


class SlotKVPool(MHATokenToKVPool):
    """SGLang's ``MHATokenToKVPool`` whose K/V buffers are views of one instance's slots
    (``pool_data`` ``[L, S, 2, C, H_kv, D]``); every other argument as SGLang's."""

    def __init__(self, pool_data: torch.Tensor, **kwargs) -> None:
        num_layers, num_slots, _, seg, h_kv, d = pool_data.shape
        self._pool_data = pool_data
        kwargs.update(size=sglang_size(num_slots, seg), page_size=seg, dtype=pool_data.dtype,
                      head_num=h_kv, head_dim=d, layer_num=num_layers)  # fmt: skip
        super().__init__(**kwargs)

    def _create_buffers_normal(self) -> None:
        if self.kv_cache_layout != "nhd" or self.v_head_dim != self.head_dim:
            raise InvalidArgumentError(
                f"SlotKVPool: needs SGLang's NHD layout with equal K/V head dims, got "
                f"{self.kv_cache_layout!r}, {self.head_dim}/{self.v_head_dim}"
            )
        self.k_buffer, self.v_buffer = slot_kv_views(self._pool_data)

    def shares_storage_with(self, pool_data: torch.Tensor) -> bool:
        """Whether every K/V buffer is a view into ``pool_data``'s bytes (one copy)."""
        lo = pool_data.data_ptr()
        hi = lo + pool_data.numel() * pool_data.element_size()
        base = pool_data.untyped_storage().data_ptr()
        return all(
            b.untyped_storage().data_ptr() == base
            and lo <= b.data_ptr()
            and b.data_ptr() + b.numel() * b.element_size() <= hi
            for b in self.k_buffer + self.v_buffer
        )


class SlotPageAllocator(PagedTokenToKVPoolAllocator):
    """SGLang's paged allocator over :class:`SlotKVPool`: page ``2s`` is slot ``s``, so it
    hands out even pages only (slot 0 stays SGLang's padding page). A freed page is handed to
    ``release`` (the pool: which of these may be reused now); pages the pool lets go of later
    come from ``reclaimed``."""

    def __init__(
        self,
        num_slots: int,
        segment_len: int,
        kvcache: SlotKVPool,
        release: Callable[[Sequence[int]], Sequence[int]],
        reclaimed: Callable[[], Sequence[int]],
        device: str = "cpu",
    ) -> None:
        self.num_slots = num_slots
        self._release, self._reclaimed = release, reclaimed
        size = sglang_size(num_slots, segment_len)
        super().__init__(size, segment_len, kvcache.dtype, device, kvcache, need_sort=True)

    def clear(self) -> None:
        super().clear()
        self.free_pages = torch.arange(2, 2 * self.num_slots, 2, dtype=torch.int64,
                                       device=self.device)  # fmt: skip
        self.staged_pages, self.num_staged_pages = [], 0

    def available_size(self) -> int:
        self._take_reclaimed()
        return super().available_size()

    def merge_and_sort_free(self) -> None:
        self._take_reclaimed()
        super().merge_and_sort_free()

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        pages = torch.cat([p.reshape(-1) for p in page_ids]).tolist()
        if any(p % 2 or not 0 < p < 2 * self.num_slots for p in pages):
            raise InvalidArgumentError(
                f"pages: expected even pages of slots 1..{self.num_slots - 1}"
            )
        free = self._release(sorted({p // 2 for p in pages}))
        self._give(free)

    def _take_reclaimed(self) -> None:
        self._give(self._reclaimed())

    def _give(self, slots: Sequence[int]) -> None:
        if len(slots):
            pages = torch.tensor([2 * int(s) for s in slots], dtype=torch.int64, device=self.device)
            super()._release_page_ids(pages)


def check_one_copy(kv_pool, runtime) -> None:
    """A worker of a one-copy pool (``engine_slots``) must run SGLang over its instance's
    slots: its KV pool a :class:`SlotKVPool` on those bytes, else it is refused by name."""
    from .model_check import UnsupportedFeatureError

    data = runtime.instance_pool_data
    if not isinstance(kv_pool, SlotKVPool) or not kv_pool.shares_storage_with(data):
        raise UnsupportedFeatureError(
            "tokenlake shared pool: the host keeps one copy of the KV (--one-copy), but this "
            f"worker's SGLang KV pool ({type(kv_pool).__name__}) is not a SlotKVPool over its "
            "instance's slots; start the host without --one-copy for such workers"
        )
