"""Slots an engine allocates (``Pool(engine_slots=True)``): the engine's KV pages are the
pool's slots, one copy. The engine (SGLang's page allocator) picks the page of every new
segment and writes it in place; the pool records it there (:func:`assign`), and never picks,
evicts or replicates on its own. A page the engine gives up is evicted from the pool when
nothing reads it any more (:func:`evict_released`), then handed back to the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from tokenlake.cluster.slots import EngineSlots
from tokenlake.errors import InvalidArgumentError
from tokenlake.iteration.requests import PlannedChunk
from tokenlake.plans import Chunk
from tokenlake.tree.node import Node
from tokenlake.tree.prefix_tree import PrefixTree
from tokenlake.validate import check_int, check_sequence, fail


def assign(
    chunks: Sequence[PlannedChunk],
    slots: Mapping[int | str, tuple[int, Sequence[int]]],
    num_new_slots: Callable[[PlannedChunk], int],
) -> None:
    """Give each chunk that starts segments the engine's slots for them, in order:
    ``slots[request_id] = (instance, [slot, ...])``, exactly one slot per segment it starts."""
    for pc in chunks:
        rid, need = pc.state.request_id, num_new_slots(pc)
        instance_id, given = slots.get(rid, (-1, ()))
        given = [int(s) for s in given]
        if len(given) != need:
            raise InvalidArgumentError(
                f"engine_slots[{rid!r}]: expected {need} slots (one per segment the chunk "
                f"starts), got {len(given)}"
            )
        if need:
            pc.engine_slots = (int(instance_id), given)


def release(
    tree: PrefixTree, allocators: Sequence, instance_id: int, alloc: EngineSlots, slots
) -> list[int]:
    """:meth:`tokenlake.Pool.release_slots` (checked first: nothing changes on bad input)."""
    check_sequence("slots", slots)
    slots = [check_int(f"slots[{i}]", s, low=0, high=alloc.num_slots) for i, s in enumerate(slots)]
    if len(set(slots)) != len(slots):
        raise fail("slots", "distinct slot ids", slots)
    held = set(alloc.released_slots())
    for i, s in enumerate(slots):
        if s in held:
            raise fail(f"slots[{i}]", "a slot not released already", s)
    free_now = [s for s in slots if alloc.release(s)]
    evict_released(tree, allocators, instance_id)
    return free_now + alloc.drain_reclaimed()


def evict_released(tree: PrefixTree, allocators: Sequence, instance_id: int) -> None:
    """Evict from the tree the segments on ``instance_id`` whose pages its engine released,
    where nothing pins or reads them (a prefix is incomplete without them: their subtrees go
    too). Slots the pool lets go of are reclaimed by the engine's allocator (or, elsewhere,
    simply no longer referenced)."""
    alloc = allocators[instance_id]
    if not isinstance(alloc, EngineSlots):
        return
    table = tree.table
    for slot in alloc.released_slots():
        rows = np.flatnonzero(
            table.in_tree & ((table.rep_inst == instance_id) & (table.rep_slot == slot)).any(axis=1)
        )
        for row in rows.tolist():
            node = tree.node_at(row)
            if len(node.replicas) > 1:
                if not table.readers[row]:
                    tree.remove_replica(node, instance_id)
                    alloc.free(slot)
            elif _unused(node, table):
                _evict_subtree(tree, allocators, node)


def _unused(node: Node, table) -> bool:
    stack = [node]
    while stack:
        n = stack.pop()
        if n.pin_count or table.readers[n.idx]:
            return False
        stack.extend(n.children.values())
    return True


def _evict_subtree(tree: PrefixTree, allocators: Sequence, node: Node) -> None:
    order, stack = [], [node]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    for n in reversed(order):  # leaves first: a node goes once its children are gone
        for loc in list(n.replicas):
            tree.remove_replica(n, loc.instance_id)
            allocators[loc.instance_id].free(loc.slot_id)


def by_request(
    enabled: bool,
    batches: Sequence[Sequence[Chunk]],
    instances: Sequence[Sequence[int] | None] | None,
    slots: Mapping[int | str, Sequence[int]] | None,
) -> dict | None:
    """``{request_id: (instance, slots)}`` from ``gen_plans``' ``engine_slots`` (checked:
    only for an ``engine_slots`` pool, each batch on one fixed instance)."""
    if not enabled:
        if slots is not None:
            raise fail("engine_slots", "None (this pool allocates its own slots)", slots)
        return None
    if slots is None:
        slots = {}
    elif not isinstance(slots, Mapping):
        raise fail("engine_slots", "a mapping of request id to slot ids", slots)
    out = {}
    for b, batch in enumerate(batches):
        fixed = None if instances is None else instances[b]
        if fixed is None or len(fixed) != 1:
            raise fail(
                f"instances[{b}]", "one instance id (engine slots live on the batch's own "
                "instance)", fixed,
            )  # fmt: skip
        for c in batch:
            given = slots.get(c.request_id, ())
            check_sequence(f"engine_slots[{c.request_id!r}]", given)
            out[c.request_id] = (int(fixed[0]), given)
    return out
