"""One iteration's moves between the pool and the host tier (:mod:`tokenlake.tree.host_tier`).

**Loads (promotions).** A new request's cached prefix may include segments in the tier: the
iteration reserves a slot for each (once, however many of its requests read it) before its
other writes, its plans read the segment there, and its transfer plans load the block into
the slot before the layers that read it. At commit the slot becomes the segment's replica;
at abort it is freed and the segment stays in the tier.

**Demotions.** An eviction the iteration makes may move a last copy into a block
(:func:`~tokenlake.tree.host_tier.demote`); its transfer plan copies the slot there before
anything writes it. At commit the block becomes the segment's; at abort the eviction is
undone (before execution) or the segment forgotten.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenlake.cluster.placement import Placement
from tokenlake.cluster.slots import SlotAllocator
from tokenlake.iteration.record import Iteration
from tokenlake.iteration.requests import PlannedChunk
from tokenlake.iteration.segment_planner import SegmentPlanner
from tokenlake.tree import host_tier
from tokenlake.tree.node import DEMOTED, Node
from tokenlake.tree.prefix_tree import PrefixTree


def _prefix(pc: PlannedChunk) -> list[Node]:
    return pc.state.tree_nodes + ([pc.source] if pc.source is not None else [])


def tier_hits(chunks: Sequence[PlannedChunk]) -> list[Node]:
    """The segments in the tier that the admitted requests ``chunks`` start from, each once,
    every prefix root first."""
    seen, out = set(), []
    for pc in chunks:
        for node in _prefix(pc):
            if node.in_tier and node.key not in seen:
                seen.add(node.key)
                out.append(node)
    return out


def hit_tokens(chunks: Sequence[PlannedChunk], segment_len: int) -> int:
    """Prompt tokens the admitted requests ``chunks`` read from segments in the tier."""
    total = 0
    for pc in chunks:
        total += segment_len * sum(node.in_tier for node in pc.state.tree_nodes)
        if pc.source is not None and pc.source.in_tier:
            total += pc.source_len
    return total


def plan_loads(
    it: Iteration, nodes: Sequence[Node], planner: SegmentPlanner, placement: Placement
) -> None:
    """Reserve a slot for each of ``nodes`` (by placement, evicting like any write)."""
    tree = planner.tree
    for node in nodes:
        loc = planner.allocate(placement.rank(node.key), it.victims)
        host_tier.start_load(tree, node)
        it.loads.append((node, loc))


def settle(
    it: Iteration, tree: PrefixTree, allocators: Sequence[SlotAllocator], committed: bool,
    restored: frozenset = frozenset(),
) -> list[Node]:  # fmt: skip
    """End ``it``'s loads and demotions (``restored``: victims' locations an abort put
    back). Committed, a loaded slot is the segment's replica (or freed if it has one there
    already); aborted, the slots are the caller's to free. Returns the segments that left
    the tree (for the eviction policy's history)."""
    for node, loc in it.loads:  # a prefix root first: a parent is in the pool before its child
        kept = host_tier.end_load(tree, node, loc, committed)
        if committed and not kept:
            allocators[loc.instance_id].free(loc.slot_id)
    demoted = [
        (v, v.block in it.demotions_copied)
        for v in it.victims
        if v.kind == DEMOTED and v.location not in restored
    ]
    return host_tier.settle_demotions(tree, demoted, committed)
