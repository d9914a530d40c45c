"""Committing one planned chunk: its open tail moves on, its full segments are sealed into
the tree (deduplicated against an identical committed one, or kept private after a key
collision; an identical one only in the host tier takes the new copy as its pool copy), and
the request's state advances."""

from __future__ import annotations

from collections.abc import Sequence

from tokenlake.cluster.slots import SlotAllocator
from tokenlake.iteration.requests import OpenSegment, PlannedChunk
from tokenlake.stats import PoolStats
from tokenlake.tree import host_tier
from tokenlake.tree.prefix_tree import Node, PrefixTree


def seal_chunk(
    pc: PlannedChunk, tree: PrefixTree, allocators: Sequence[SlotAllocator], stats: PoolStats
) -> None:
    state, seg = pc.state, tree.segment_len
    state.open = None
    sealed: list[Node] = []
    for w in pc.writes:
        if len(w.tokens) < seg:
            state.open = OpenSegment(w.location, w.parent_key, w.tokens)
            continue
        res = tree.commit(w.pending) if w.pending is not None else None
        if res is None or res.node is None:
            sealed.append(
                tree.new_private(tree.hasher.key(w.parent_key, w.tokens), w.tokens, w.location)
            )
            state.num_private += 1
            state.detached = True
            continue
        if res.deduped and not res.node.num_replicas:
            # recomputed while in the host tier (or being demoted): the new copy is its
            # pool copy now; a complete block goes once no load reads it
            host_tier.into_pool(tree, res.node, w.location)
            host_tier.release_block(tree, res.node)
        elif res.deduped:
            allocators[w.location.instance_id].free(w.location.slot_id)
            stats.num_dedup_segments += 1
        tree.pin(res.node)
        sealed.append(res.node)
    state.append_nodes(sealed)
    if pc.source is not None:
        tree.unpin(pc.source)
    state.num_tokens = pc.end
