"""The host tier: blocks of host memory below the pool, where a segment evicted from the pool
waits for its next hit instead of being forgotten.

A sealed segment (a tree node) is in one of these states:

* **in the pool**: one replica or more, no block;
* **demoting**: its last copy was evicted by an iteration in flight that copies it into a
  block (``tier_ready`` false). It stays in the tree but no match returns it (nor its
  descendants): the block is not complete until that iteration commits;
* **in the tier**: no replica, its block complete. A match returns it as a hit, and the plan
  that admits the request loads it into a slot (a promotion) before the layers that read it;
  the block is freed once the promotion commits;
* **in the pool, block held**: promoted while another iteration in flight still loads the
  block; it is freed when the last load settles.

Eviction from the pool demotes a last copy when the tier has room (a free block, or the
least recently demoted segment in the tier that is a leaf and nothing pins or reads);
otherwise the segment is forgotten as before, with its descendants (all in the tier).
A last copy may leave the pool once none of its children is in the pool or being demoted by
another plan (a plan may demote a whole chain, leaf first), so pool residency stays closed
under ancestors: the pool holds the top of the tree, the tier hangs below it. A demoting
segment's parent is in the pool or demoted by the same plan. A demoting segment's block is
freed only by the iteration that reserved it. Only sealed segments are demoted (a tail is
forgotten as before). A segment recomputed while in the tier takes the new copy as its pool
copy (:mod:`tokenlake.iteration.sealing`). Everything is journaled like every eviction, so an
abort before execution puts it all back.

While a demotion is in flight its parent's last copy cannot leave the pool, so the pool's
evictable count (:class:`~tokenlake.tree.segment_table.SegmentTable`) may count it a moment
early: a plan that needs that very slot is refused with ``PoolFullError``, nothing changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenlake.tree.node import DEMOTED, TIER_DROP, UNDEMOTED, Evicted, Location, Node
from tokenlake.tree.tier_blocks import TIER, HostTier

__all__ = ["TIER", "HostTier"]

if TYPE_CHECKING:
    from collections.abc import Container, Iterable

    from tokenlake.tree.index import TreeIndex


# ---- eviction from the pool --------------------------------------------------------------
def children_in_tier(node: Node, mine: Container[int] = ()) -> bool:
    """None of ``node``'s children is in the pool or demoting (except by the plan now
    evicting, whose demotions' keys are ``mine``): its last copy may go (a pool leaf).
    Without a tier: ``node`` has no children."""
    return all(
        child.in_tier or (child.key in mine and child.tier_block >= 0)
        for child in node.children.values()
    )


def demoting_keys(journal: Iterable[Evicted] | None) -> set[int]:
    """Keys of the segments a plan's journal demotes."""
    return {v.node.key for v in journal or () if v.kind == DEMOTED}


def demote(
    tree: TreeIndex, node: Node, instance_id: int, stamp: int, journal: list[Evicted] | None
) -> Location | None:
    """Move ``node``'s last copy (on ``instance_id``) into a host-tier block, journaled; the
    iteration copies it there before writing the slot. ``None`` when it cannot: no journal
    (nothing would copy it), a tail (only sealed segments are demoted) or no room."""
    if journal is None or len(node.tokens) != tree.segment_len:
        return None
    block = _make_room(tree, journal)
    if block is None:
        return None
    loc = tree.remove_replica(node, instance_id, keep=True)
    tree.table.tier_block[node.idx] = block
    journal.append(Evicted(node, loc, stamp, None, 0.0, tree.table.access_scale, 0, block, DEMOTED))
    return loc


def _make_room(tree: TreeIndex, journal: list[Evicted]) -> int | None:
    """A free block, else the block of the least recently demoted segment in the tier that
    is a leaf nobody pins or reads (it leaves the tree, journaled)."""
    tier = tree.tier
    block = tier.allocate()
    if block is not None:
        return block
    table = tree.table
    for (key, _), stamp in tier.lru.items():
        node = tree.get(key)
        i = node.idx
        if node.children or table.readers[i] or table.pins[i]:
            continue
        block = int(table.tier_block[i])
        journal.append(_drop_record(tree, node, stamp))
        _leave_tier(tree, node)
        return block  # stays used: handed to the demotion
    return None


def forget_subtree(tree: TreeIndex, node: Node, journal: list[Evicted] | None) -> None:
    """``node``'s last copy leaves the pool without a demotion: its descendants (in the
    tier, or being demoted by the same plan) leave first, deepest first, journaled when
    ``journal``: the blocks of those in the tier are freed, those being demoted stay the
    plan's (its settling frees them)."""
    order, stack = [], list(node.children.values())
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(n.children.values())
    for n in reversed(order):  # children after their parents in ``order``
        block = n.tier_block
        if not n.in_tier:  # being demoted by this plan
            if journal is not None:
                journal.append(_drop_record(tree, n, 0, UNDEMOTED))
            _clear(tree, n)
            tree.detach(n)
            continue
        if journal is not None:
            journal.append(_drop_record(tree, n, tree.tier.lru.stamp_of((n.key, TIER))))
        _leave_tier(tree, n)
        tree.tier.free(block)


def _drop_record(tree: TreeIndex, node: Node, stamp: int, kind: str = TIER_DROP) -> Evicted:
    t, i = tree.table, node.idx
    block = int(t.tier_block[i])
    return Evicted(
        node, Location(TIER, block), stamp, node.parent, float(t.access[i]), t.access_scale,
        0, block, kind,
    )  # fmt: skip


def _leave_tier(tree: TreeIndex, node: Node) -> None:
    """A segment in the tier only leaves it and the tree (its block: the caller's)."""
    tree.tier.lru.remove((node.key, TIER))
    _clear(tree, node)
    tree.detach(node)


def _clear(tree: TreeIndex, node: Node) -> None:
    tree.table.tier_block[node.idx] = -1
    tree.table.tier_ready[node.idx] = False


def discard(tree: TreeIndex, node: Node) -> None:
    """A node with no replica leaves the tree (its instance's subtree is lost): a complete
    block is freed; a demoting one stays with the iteration that reserved it."""
    block, ready = node.tier_block, node.in_tier
    if ready:
        tree.tier.lru.remove((node.key, TIER))
    _clear(tree, node)
    tree.detach(node)
    if ready:
        tree.tier.free(block)


# ---- undoing an eviction -------------------------------------------------------------------
def restore(tree: TreeIndex, record: Evicted, live: set[int]) -> bool:
    """Undo one :data:`DEMOTED`, :data:`TIER_DROP` or :data:`UNDEMOTED` record if its place
    is still free (see :func:`tokenlake.tree.eviction.restore`)."""
    node, loc, tier, table = record.node, record.location, tree.tier, tree.table
    if record.kind == DEMOTED:
        if (
            tree.get(node.key) is not node
            or node.tier_block != record.block
            or table.tier_ready[node.idx]
            or table.num_replicas[node.idx]
            or loc.instance_id not in live
        ):
            return False
        _clear(tree, node)
        tier.free(record.block)
        tree.add_replica(node, loc, stamp=record.stamp, position=record.position)
        return True
    parent = record.parent
    attached = parent is tree.root or tree.get(parent.key) is parent
    if not attached or tree.get(node.key) is not None or node.idx >= 0:
        return False
    ready = record.kind == TIER_DROP  # else its block is still this plan's, being demoted
    if tier.is_used(record.block) == ready:
        return False
    access = record.access
    if record.access_scale != table.access_scale:
        access *= table.access_scale / record.access_scale
    tree.reattach(node, parent, access)
    table.tier_block[node.idx] = record.block
    if ready:
        tier.take(record.block)
        table.tier_ready[node.idx] = True
        tier.lru.put((node.key, TIER), record.stamp)
    return True


# ---- settling an iteration -----------------------------------------------------------------
def settle_demotions(
    tree: TreeIndex, victims: Iterable[tuple[Evicted, bool]], committed: bool
) -> list[Node]:
    """An iteration ended: each of its :data:`DEMOTED` victims (with whether its copy was
    planned) becomes a segment in the tier if ``committed`` and copied; otherwise the
    block goes back and the segment, unless a recomputed copy put it in the pool again, is
    forgotten with its descendants. Victims restored by an abort must not be passed.
    Returns the nodes that left the tree."""
    tier, table, gone = tree.tier, tree.table, []
    for record, copied in victims:
        if record.kind != DEMOTED:
            continue
        node = record.node
        mine = tree.get(node.key) is node and node.tier_block == record.block
        if not mine:  # forgotten meanwhile: the block was this iteration's to free
            tier.free(record.block)
            continue
        if committed and copied and not table.num_replicas[node.idx]:
            table.tier_ready[node.idx] = True
            tier.lru.stamp((node.key, TIER))
            continue
        _clear(tree, node)
        tier.free(record.block)
        if not table.num_replicas[node.idx]:
            forget_subtree(tree, node, None)
            tree.detach(node)
            gone.append(node)
    return gone


def start_load(tree: TreeIndex, node: Node) -> None:
    """A plan loads ``node`` (in the tier) into a slot."""
    tree.tier.loading[node.key] += 1


def end_load(tree: TreeIndex, node: Node, location: Location, committed: bool) -> bool:
    """A load of ``node`` into ``location`` settled. Committed: ``location`` becomes its
    replica (unless it has one on that instance already). Returns whether the slot was
    kept; its block is freed once no load in flight reads it."""
    tier = tree.tier
    tier.loading[node.key] -= 1
    if tier.loading[node.key] <= 0:
        del tier.loading[node.key]
    kept = False
    if committed and tree.get(node.key) is node:
        taken = any(r.instance_id == location.instance_id for r in node.replicas)
        if not taken and node.num_replicas < tree.table.max_replicas:
            into_pool(tree, node, location)
            kept = True
    release_block(tree, node)
    return kept


def into_pool(tree: TreeIndex, node: Node, location: Location) -> None:
    """``node`` (in the tree) gets a replica at ``location``; it leaves the tier's LRU."""
    if node.in_tier:
        tree.tier.lru.remove((node.key, TIER))
    tree.add_replica(node, location)


def release_block(tree: TreeIndex, node: Node) -> None:
    """Free the complete block of a node that is in the pool again, once no load in
    flight reads it."""
    i, table = node.idx, tree.table
    if i < 0 or not table.num_replicas[i] or not table.tier_ready[i]:
        return
    if tree.tier.loading.get(node.key, 0):
        return
    block = int(table.tier_block[i])
    _clear(tree, node)
    tree.tier.free(block)


# ---- checks ----------------------------------------------------------------------------
def check_node(tree: TreeIndex, node: Node, parent: Node) -> None:
    """One tree node's tier state, for :func:`tokenlake.tree.checks.check_tree_invariants`."""
    t, i = tree.table, node.idx
    block, ready, copies = int(t.tier_block[i]), bool(t.tier_ready[i]), int(t.num_replicas[i])
    assert copies or block >= 0, "node neither in the pool nor in the tier"
    assert block < 0 or tree.tier.is_used(block), "node's block is free"
    in_lru = (node.key, TIER) in tree.tier.lru
    assert in_lru == (ready and not copies), "tier LRU out of step with the tier"
    assert not ready or len(node.tokens) == tree.segment_len, "a tail in the tier"
    if copies:
        assert parent is tree.root or parent.num_replicas, "pool not closed under ancestors"
    if block >= 0 and not ready and not copies:  # demoting (not recomputed since)
        assert parent is tree.root or parent.num_replicas or parent.tier_block >= 0, (
            "a demoting node's parent left"
        )
        assert all(not c.num_replicas for c in node.children.values()), "demoting above the pool"
