"""Losing an instance: which segments are gone with it and which running requests depended
on them. Pure functions; :meth:`tokenlake.Pool.drop_instance` applies the result."""

from __future__ import annotations

from collections.abc import Iterable

from tokenlake.prefix_tree import PrefixTree
from tokenlake.requests import RequestState


def lost_keys(tree: PrefixTree, instance_id: int) -> set[int]:
    """Keys of segments whose every replica is on ``instance_id``, and their subtrees."""
    stack = [n for n in tree.nodes() if all(r.instance_id == instance_id for r in n.replicas)]
    lost: set[int] = set()
    while stack:
        node = stack.pop()
        lost.add(node.key)
        stack.extend(node.children.values())
    return lost


def dependent_requests(
    requests: Iterable[RequestState], instance_id: int, lost: set[int]
) -> list[RequestState]:
    """Running requests with data only on ``instance_id``: their open tail, a private
    segment, or a prefix segment among ``lost``."""
    out = []
    for state in requests:
        if (
            state.open is not None
            and state.open.location.instance_id == instance_id
            or any(n.key in lost for n in state.tree_nodes)
            or any(n.replicas[0].instance_id == instance_id for n in state.private_nodes)
        ):
            out.append(state)
    return out
