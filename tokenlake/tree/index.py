"""What the tree's helpers (match, eviction, policy, checks) read and call on a prefix tree.

The helpers take a :class:`TreeIndex` rather than the concrete
:class:`~tokenlake.tree.prefix_tree.PrefixTree`, which calls them: the dependency points one
way, from the tree to its helpers, and this protocol is the contract between them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tokenlake.keys import SegmentHasher
    from tokenlake.tree.node import Location, Node, PendingInserts
    from tokenlake.tree.policy import EvictionPolicy
    from tokenlake.tree.replica_lru import ReplicaLRU
    from tokenlake.tree.segment_table import SegmentTable
    from tokenlake.tree.tier_blocks import HostTier


class TreeIndex(Protocol):
    segment_len: int
    hasher: SegmentHasher
    table: SegmentTable
    root: Node
    lru: ReplicaLRU
    pending: PendingInserts
    policy: EvictionPolicy
    tier: HostTier

    @property
    def num_nodes(self) -> int: ...

    @property
    def num_indexed(self) -> int: ...

    @property
    def node_map(self) -> Mapping[int, Node]: ...

    def get(self, key: int) -> Node | None: ...

    def node_at(self, idx: int) -> Node: ...

    def nodes(self) -> Iterator[Node]: ...

    def add_replica(
        self, node: Node, location: Location, stamp: int | None = None, position: int = -1
    ) -> None: ...

    def remove_replica(self, node: Node, instance_id: int, keep: bool = False) -> Location: ...

    def detach(self, node: Node) -> None: ...

    def reattach(self, node: Node, parent: Node, access: float) -> None: ...
