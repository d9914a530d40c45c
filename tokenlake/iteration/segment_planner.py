"""Decides which slots a chunk writes: reuse the open tail, copy-on-extend a partial source,
place new segments by rendezvous hashing, and evict by global LRU when the pool is full.

Evictions are journaled into the iteration being planned (``journal``): they are tentative
until it commits, and undone if it is aborted before anything was written (see
:meth:`tokenlake.Pool.abort`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from tokenlake.cluster.placement import Placement
from tokenlake.cluster.slots import SlotAllocator
from tokenlake.errors import InvalidArgumentError, PoolFullError
from tokenlake.iteration.requests import PlannedChunk, SegmentWrite
from tokenlake.tree.prefix_tree import Evicted, Location, Node, PrefixTree


def source_location(source: Node, loaded: Mapping[int, Location]) -> Location:
    """Where a copy-on-extend reads its source: its first replica, or the slot the
    iteration loads it into from the host tier."""
    replicas = source.replicas
    return replicas[0] if replicas else loaded[source.key]


class SegmentPlanner:
    def __init__(
        self,
        tree: PrefixTree,
        placement: Placement,
        allocators: Sequence[SlotAllocator],
        beside: Callable[[int], bool] | None = None,
    ) -> None:
        self.tree = tree
        self.placement = placement
        self.allocators = allocators
        self.segment_len = tree.segment_len
        # hop-priced placement: whether a request's next segment may go on the instance of
        # its previous one (None: always by hash; see Placement.rank_beside)
        self.beside = beside

    def num_new_slots(self, pc: PlannedChunk) -> int:
        seg = self.segment_len
        touched = (pc.end - 1) // seg - pc.start // seg + 1
        return touched - (1 if pc.state.open is not None else 0)

    def free_capacity(self) -> int:
        """Slots obtainable without touching pinned data: free ones on live instances plus
        evictable replicas."""
        free = sum(self.allocators[i].num_free for i in self.placement.live)
        return free + self.tree.num_evictable

    def allocate(self, preferred: Sequence[int], journal: list[Evicted]) -> Location:
        """A slot on the first preferred live instance with room; otherwise the slot of the
        globally least recently used evictable replica (the pool is one cache)."""
        for instance_id in preferred:
            slot = self.allocators[instance_id].allocate()
            if slot is not None:
                return Location(instance_id, slot)
        evicted = self.tree.evict_lru(journal=journal)
        if evicted is None:
            raise PoolFullError("batches: no free or evictable slot left in the pool")
        return evicted[1]

    def plan_writes(
        self, pc: PlannedChunk, journal: list[Evicted], loaded: Mapping[int, Location]
    ) -> None:
        """Fill ``pc.writes`` for tokens ``pc.start:pc.end``, allocating slots as needed;
        ``loaded``: the slots this iteration loads segments of the host tier into, by key
        (a copy-on-extend source may be one)."""
        seg, tree, state = self.segment_len, self.tree, pc.state
        tokens = pc.token_ids
        pos = pc.start
        parent_key = state.last_key(tree.root.key)
        parent_ref = state.nodes[-1] if state.nodes else tree.root  # for tree reservations
        prev = state.home_instance() if self.beside is not None else None
        while pos < pc.end:
            offset = pos % seg
            seg_start = pos - offset
            seg_end = min(seg_start + seg, pc.end)
            content = tokens[seg_start:seg_end]
            copy_from = None
            if offset and state.open is not None and pos == pc.start:
                location, new_slot = state.open.location, False
                parent_key = state.open.parent_key
            elif pc.engine_slots is not None:
                location, new_slot = self._engine_slot(pc, offset), True
            else:
                key = tree.hasher.key(parent_key, content)
                beside = self.beside
                near = prev if prev is not None and beside is not None and beside(prev) else None
                preferred = self.placement.rank_beside(key, near)
                if offset:  # copy-on-extend: the first `offset` tokens come from the source
                    copy_from = source_location(pc.source, loaded)
                    preferred = [copy_from.instance_id] + [
                        i for i in preferred if i != copy_from.instance_id
                    ]
                location, new_slot = self.allocate(preferred, journal), True
            write = SegmentWrite(
                location=location,
                parent_key=parent_key,
                tokens=content,
                num_before=offset,
                chunk_offset=pos - pc.start,
                new_slot=new_slot,
                copy_from=copy_from,
            )
            if len(content) == seg:
                if not state.detached:
                    write.pending = parent_ref = tree.reserve(parent_ref, content, location)
                parent_key = tree.hasher.key(parent_key, content)
            pc.writes.append(write)
            prev = location.instance_id
            pos = seg_end

    def _engine_slot(self, pc: PlannedChunk, offset: int) -> Location:
        """The next slot the engine wrote for ``pc``: its pages are the pool's slots, so a
        segment starts at a page boundary (no copy-on-extend, nothing to put)."""
        instance_id, slots = pc.engine_slots
        if offset:
            raise InvalidArgumentError(
                f"chunks: request {pc.state.request_id!r} starts at token {pc.start}, inside a "
                "segment; with engine-allocated slots a chunk starts at a segment boundary or "
                "continues its own open tail"
            )
        done = sum(w.new_slot for w in pc.writes)
        self.allocators[instance_id].take(slots[done])
        return Location(instance_id, slots[done])

    def reserve_replica(self, destination: int, journal: list[Evicted]) -> Location | None:
        """A slot for a replication order on ``destination``: a free one, or the slot of its
        least recently used evictable replica; ``None`` if it has neither."""
        slot = self.allocators[destination].allocate()
        if slot is not None:
            return Location(destination, slot)
        evicted = self.tree.evict_lru(instance_id=destination, journal=journal)
        return None if evicted is None else evicted[1]
