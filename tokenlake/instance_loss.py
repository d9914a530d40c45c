"""Losing an instance: forget what lived there and fail the requests that depended on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenlake.errors import InvalidArgumentError
from tokenlake.slots import SlotAllocator

if TYPE_CHECKING:
    from tokenlake.pool import Pool


def lost_keys(pool: Pool, instance_id: int) -> set[int]:
    """Keys of segments whose every replica is on ``instance_id``, and their subtrees."""
    stack = [n for n in pool.tree.nodes() if all(r.instance_id == instance_id for r in n.replicas)]
    lost: set[int] = set()
    while stack:
        node = stack.pop()
        lost.add(node.key)
        stack.extend(node.children.values())
    return lost


def drop_instance(pool: Pool, instance_id: int) -> list[int | str]:
    """See :meth:`tokenlake.Pool.drop_instance`."""
    if instance_id not in pool.placement.live:
        raise InvalidArgumentError(f"instance_id: {instance_id} is not a live instance")
    if len(pool.placement.live) == 1:
        raise InvalidArgumentError("instance_id: cannot drop the last live instance")
    lost = lost_keys(pool, instance_id)
    failed = []
    for rid, state in list(pool.requests.items()):
        open_loc = state.open.location if state.open is not None else None
        on_lost = open_loc is not None and open_loc.instance_id == instance_id
        on_lost |= any(n.key in lost for n in state.tree_nodes)
        on_lost |= any(n.replicas[0].instance_id == instance_id for n in state.private_nodes)
        if not on_lost:
            continue
        failed.append(rid)
        del pool.requests[rid]
        for node in state.tree_nodes:
            pool.tree.unpin(node)
        if open_loc is not None and open_loc.instance_id != instance_id:
            pool.allocators[open_loc.instance_id].free(open_loc.slot_id)
        pool._free_private(state, skip_instance=instance_id)
    for loc in pool.tree.drop_instance(instance_id):
        pool.allocators[loc.instance_id].free(loc.slot_id)
    pool.placement.remove(instance_id)
    pool.allocators[instance_id] = SlotAllocator(pool.config.num_slots)  # nothing lives there
    return failed
