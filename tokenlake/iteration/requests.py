"""Per-request pool state: which segments a running request owns or pins, and its open tail."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenlake.cluster.slots import SlotAllocator
from tokenlake.tree.prefix_tree import Location, Node, PendingInsert, PrefixTree


@dataclass(eq=False, slots=True)
class OpenSegment:
    """A request's trailing partial segment being filled: private, never shared."""

    location: Location
    parent_key: int
    tokens: np.ndarray  # int32, fewer than C tokens


@dataclass(eq=False, slots=True)  # slots: gen_plans reads every running request's fields
class RequestState:
    """A running request. ``nodes`` are its sealed prefix segments in order; tree nodes among
    them are pinned by it. After a key collision (``detached``) its later segments are private
    nodes outside the tree, freed when it finishes."""

    request_id: int | str
    num_tokens: int = 0
    nodes: list[Node] = field(default_factory=list)
    open: OpenSegment | None = None
    detached: bool = False
    num_private: int = 0  # the last ``num_private`` of ``nodes`` are outside the tree
    # SegmentTable rows of ``nodes``, in order: plan building gathers locations from these
    page_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def append_nodes(self, nodes: list[Node]) -> None:
        self.nodes.extend(nodes)
        self.page_idx = np.concatenate([self.page_idx, [n.idx for n in nodes]]).astype(np.int64)

    @property
    def tree_nodes(self) -> list[Node]:
        return self.nodes[: len(self.nodes) - self.num_private]

    @property
    def private_nodes(self) -> list[Node]:
        return self.nodes[len(self.nodes) - self.num_private :]

    def last_key(self, root_key: int) -> int:
        return self.nodes[-1].key if self.nodes else root_key

    def home_instance(self) -> int | None:
        """Where its newest KV lives: its open tail, else its last segment's first replica."""
        if self.open is not None:
            return self.open.location.instance_id
        if self.nodes and self.nodes[-1].replicas:
            return self.nodes[-1].replicas[0].instance_id
        return None


@dataclass(eq=False, slots=True)
class SegmentWrite:
    """One slot an iteration writes for one request.

    The slot holds ``num_before`` tokens before the iteration (its open tail, or a copy of a
    partial source); the chunk's new tokens ``chunk_offset : chunk_offset + num_new`` land at
    offsets ``num_before...``; afterwards it holds ``tokens``. A full segment is reserved in
    the tree (``pending``) and sealed at commit.
    """

    location: Location
    parent_key: int
    tokens: np.ndarray
    num_before: int
    chunk_offset: int
    new_slot: bool
    copy_from: Location | None = None
    pending: PendingInsert | None = None

    @property
    def num_new(self) -> int:
        return len(self.tokens) - self.num_before


@dataclass(eq=False, slots=True)
class PlannedChunk:
    """A chunk as planned: its request, its prefix pages and the slots it writes."""

    state: RequestState
    start: int
    end: int
    token_ids: np.ndarray
    is_new: bool
    source: Node | None = None  # partially used segment for copy-on-extend (pinned)
    source_len: int = 0
    writes: list[SegmentWrite] = field(default_factory=list)
    # engine-allocated slots (Pool(engine_slots=True)): (instance, the slot of each new
    # segment in order), where the engine already wrote them
    engine_slots: tuple[int, list[int]] | None = None


def free_private_segments(
    state: RequestState, tree: PrefixTree, allocators: list[SlotAllocator], skip_instance=None
) -> None:
    """Free a released request's private segments (outside the tree) and their slots, except
    slots on ``skip_instance`` (a lost instance)."""
    for node in state.private_nodes:
        loc = node.replicas[0]
        if loc.instance_id != skip_instance:
            allocators[loc.instance_id].free(loc.slot_id)
        tree.free_private(node)


def release_finished(
    state: RequestState, tree: PrefixTree, allocators: list[SlotAllocator]
) -> None:
    """Release a finished request (no longer in the pool's running set): keep its open
    partial segment as a leaf tail (its slot freed if the tree refuses or already has it),
    hand its path to the eviction policy and the LRU as just used, unpin it, and free its
    private segments."""
    if state.open is not None:
        loc = state.open.location
        kept = None
        if not state.detached:
            parent = state.nodes[-1] if state.nodes else tree.root
            res = tree.insert(parent, state.open.tokens, loc)
            kept = res.node if res.node is not None and not res.deduped else None
        if kept is None:
            allocators[loc.instance_id].free(loc.slot_id)
    tree.policy.finished(state.tree_nodes, tree.lru, tree.node_map)
    tree.touch(state.tree_nodes)  # just used: the most recent, for LRU
    for node in state.tree_nodes:
        tree.unpin(node)
    free_private_segments(state, tree, allocators)
