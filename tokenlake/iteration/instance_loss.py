"""Losing an instance: which segments are gone with it, which running requests depended on
them, releasing those requests, and the fail-over log the balancer re-replicates from.
:meth:`tokenlake.Pool.drop_instance` composes these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from tokenlake.cluster.slots import SlotAllocator
from tokenlake.iteration.requests import RequestState, free_private_segments
from tokenlake.tree.eviction import lost_with
from tokenlake.tree.prefix_tree import PrefixTree


@dataclass
class FailoverLog:
    """Drops/restores so far, how many a committed replication decision has seen, and the
    keys of segments that lost a replica to a drop (eligible for a copy, see balancer)."""

    num_changes: int = 0
    num_seen: int = 0
    lost_replica: set[int] = field(default_factory=set)

    @property
    def unseen(self) -> bool:
        """A drop or restore no committed replication decision has seen yet."""
        return self.num_changes > self.num_seen

    def snapshot(self) -> tuple[int, frozenset[int]]:
        """What a replication decision taken now sees (``Iteration.failover``)."""
        return self.num_changes, frozenset(self.lost_replica)

    def settle(self, seen: tuple[int, frozenset[int]]) -> None:
        """A decision that saw ``seen`` was committed."""
        self.num_seen = max(self.num_seen, seen[0])
        self.lost_replica -= seen[1]


def lost_keys(tree: PrefixTree, instance_id: int) -> set[int]:
    """Keys of segments whose every replica is on ``instance_id``, and their subtrees."""
    stack = [n for n in tree.nodes() if lost_with(n, instance_id)]
    lost: set[int] = set()
    while stack:
        node = stack.pop()
        lost.add(node.key)
        stack.extend(node.children.values())
    return lost


def surviving_copies_lost(tree: PrefixTree, instance_id: int) -> set[int]:
    """Keys of segments with several replicas, one of them on ``instance_id``."""
    t = tree.table
    rows = t.in_tree & (t.num_replicas > 1) & (t.rep_inst == instance_id).any(axis=1)
    return {tree.node_at(i).key for i in np.flatnonzero(rows).tolist()}


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


def forget_instance(
    instance_id: int,
    lost: set[int],
    requests: dict,
    tree: PrefixTree,
    allocators: list[SlotAllocator],
    failover: FailoverLog,
) -> list[int | str]:
    """Fail the running requests that depended on ``instance_id`` (unpin their prefixes,
    free their slots elsewhere), forget its replicas, and log the drop for re-replication.
    Returns the failed request ids."""
    failed = dependent_requests(requests.values(), instance_id, lost)
    for state in failed:
        del requests[state.request_id]
        for node in state.tree_nodes:
            tree.unpin(node)
        if state.open is not None and state.open.location.instance_id != instance_id:
            allocators[state.open.location.instance_id].free(state.open.location.slot_id)
        free_private_segments(state, tree, allocators, skip_instance=instance_id)
    # survivors with a copy there lose it: re-replicate the hot ones
    failover.lost_replica |= surviving_copies_lost(tree, instance_id)
    failover.num_changes += 1  # the next gen_plans decides replications at once
    for loc in tree.drop_instance(instance_id):
        allocators[loc.instance_id].free(loc.slot_id)
    return [state.request_id for state in failed]
