"""Which replica the pool evicts first when it needs a slot: plain LRU, or LRU that protects
reused prefixes (segmented LRU with a ghost history).

Plain global LRU (the paper's §4.4) thrashes when sessions come back in a cycle larger than
the pool: each session's context is evicted just before its next turn, by the contexts of the
sessions in between. ``"protect"`` splits the tree's nodes in two classes:

* probation — written but not read by any later request yet (a fresh prompt, outputs);
* protected — matched by a later request (a live session's prefix), or recomputed after
  being evicted (its key is in the ghost history of recently evicted segments).

Eviction takes the least recently used evictable replica of a probation node, and only when
there is none, of a protected one. (Dropping spare copies of probation nodes first was tried:
it loses no hit but moved reads off the replicas the balancer made, and cost SLO attainment
on the conversation trace.) A reuse promotes its nodes; when protected nodes exceed
``protected_fraction`` of the pool's slots, the least recently used ones are demoted to
probation, so stale prefixes still leave. A ghost recompute is promoted only while there is
room: it never demotes a prefix that is being reused. Under a cycle larger than the pool, the
sessions already protected keep hitting and the others' recomputed contexts replace each
other in probation, instead of every session missing.

``"session"`` also protects a finished (or preempted) request's context, as a reuse: it is
what a multi-turn session's next turn reads a think time later. Under ``"protect"`` a session's
first context waits on probation until its second turn, and when sessions come and go (new
ones arriving, old ones ending) the prefill of every new session evicts those first, while
the protected contexts of sessions that ended stay until the cap demotes them; measured on
SCBench-like sessions, that costs most later turns their hit. Under a strict cycle larger than
the pool ``"session"`` behaves as LRU (every context is protected at its finish and the cap
demotes the oldest), so ``"protect"`` stays the default.

State changes happen only at commit (promotions, ghosts), at finish (``"session"``) or move with the node (its class is
a field of :class:`~tokenlake.tree.node.Node`), so an aborted iteration that restores its
victims restores their class too. The recency order itself stays the tree's replica LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenlake.errors import InvalidArgumentError
from tokenlake.tree.node import Node

if TYPE_CHECKING:
    from tokenlake.tree.replica_lru import ReplicaLRU

POLICIES = ("lru", "protect", "session")


@dataclass(frozen=True)
class EvictionConfig:
    """Args: policy (``"lru"``: global LRU over replicas; ``"protect"`` (default): LRU that protects
    reused prefixes, see the module docstring); protected_fraction (protect: share of the
    pool's slots protected nodes may hold before the least recently used are demoted);
    ghost_fraction (protect: evicted segment keys remembered, as a share of the pool's
    slots). ``"session"``: ``"protect"``, and a finished request's context is protected as
    well (see :meth:`EvictionPolicy.finished`)."""

    policy: str = "protect"
    protected_fraction: float = 0.8
    ghost_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise InvalidArgumentError(
                f"EvictionConfig.policy: expected one of {POLICIES}, got {self.policy!r}"
            )
        for name in ("protected_fraction", "ghost_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise InvalidArgumentError(
                    f"EvictionConfig.{name}: expected a number in [0, 1], got {value!r}"
                )


class EvictionPolicy:
    """The victim order and the protected class of one tree (see the module docstring).

    ``capacity_slots`` is the pool's slot count (all instances). The tree calls
    :meth:`attached` / :meth:`detached` when a node enters or leaves it and iterates
    :meth:`candidates` to evict; the pool calls :meth:`reused` and :meth:`forgotten` when an
    iteration commits (and :meth:`forgotten` when an abort leaves victims evicted)."""

    def __init__(self, config: EvictionConfig, capacity_slots: int) -> None:
        self.config = config
        self.protects = config.policy != "lru"
        self.protects_finished = config.policy == "session"
        self.max_protected = int(config.protected_fraction * capacity_slots)
        self.max_ghosts = int(config.ghost_fraction * capacity_slots)
        self.num_protected = 0  # protected nodes in the tree
        self.ghosts: OrderedDict[int, None] = OrderedDict()  # evicted keys, oldest first
        self.num_promotions = 0
        self.num_demotions = 0
        self.num_ghost_hits = 0

    # ---- the tree's hooks ------------------------------------------------------------------
    def attached(self, node: Node) -> None:
        """``node`` entered the tree: a new segment, or an evicted one restored by an abort
        (which keeps its class)."""
        if not self.protects:
            return
        if node.protected:
            self.num_protected += 1
        elif self.ghosts.pop(node.key, False) is None:  # recomputed after its eviction
            self.num_ghost_hits += 1
            if self.num_protected < self.max_protected:
                self._promote(node)

    def detached(self, node: Node) -> None:
        """``node`` left the tree (its class stays on it, for a restore)."""
        if self.protects and node.protected:
            self.num_protected -= 1

    def candidates(
        self,
        lru: ReplicaLRU,
        nodes: Mapping[int, Node],
        items: list[tuple[tuple[int, int], int]] | None = None,
    ) -> Iterator[tuple[tuple[int, int], int]]:
        """Replica entries ``((key, instance_id), stamp)`` in the order eviction tries them:
        the tree's LRU order (``lru``; ``nodes`` maps a key to its node); ``"protect"``: probation replicas first, then protected ones.
        ``items``: a copy of the LRU's items taken earlier, walked instead of the LRU itself
        (entries that left it since are skipped), so the tree may change during the walk."""
        frozen, entries = items is not None, lru.entries()
        if not self.splits:
            yield from (item for item in items if item[0] in entries) if frozen else lru.items()
            return
        for protected in (False, True):  # probation first
            for entry, stamp in items if frozen else lru.items():
                if (not frozen or entry in entries) and nodes[entry[0]].protected == protected:
                    yield entry, stamp

    @property
    def splits(self) -> bool:
        """Whether :meth:`candidates` makes two passes (probation, then protected)."""
        return self.protects and self.num_protected > 0

    @property
    def num_class_changes(self) -> int:
        """Promotions and demotions so far (a resumed eviction scan checks it)."""
        return self.num_promotions + self.num_demotions

    # ---- the pool's hooks (at commit) --------------------------------------------------------
    def reused(self, path: list[Node], lru: ReplicaLRU, nodes: Mapping[int, Node]) -> None:
        """A new request's admitted prefix ``path`` (nodes in the tree) was read: protect it,
        demoting the least recently used protected nodes beyond the cap."""
        if not self.protects:
            return
        for node in path:
            if not node.protected and node.idx >= 0:
                self._promote(node)
        if self.num_protected > self.max_protected:
            fresh = {node.key for node in path}
            for (key, _), _ in lru.items():
                node = nodes[key]
                if node.protected and key not in fresh:
                    node.protected = False
                    self.num_protected -= 1
                    self.num_demotions += 1
                    if self.num_protected <= self.max_protected:
                        break

    def finished(self, path: list[Node], lru: ReplicaLRU, nodes: Mapping[int, Node]) -> None:
        """A request left the pool (finished or preempted) with ``path`` (its prefix nodes in
        the tree). ``"session"``: protect it as a reused prefix (demoting the least recently
        used protected nodes beyond the cap)."""
        if self.protects_finished:
            self.reused(path, lru, nodes)

    def forgotten(self, victims: Iterable[Node], nodes: Mapping[int, Node]) -> None:
        """Evictions became final: remember the keys of the nodes that left the tree (and
        that no other node has taken since)."""
        if not self.protects or not self.max_ghosts:
            return
        for node in victims:
            if node.idx < 0 and node.key not in nodes:  # its last copy went
                self.ghosts[node.key] = None
                self.ghosts.move_to_end(node.key)
        while len(self.ghosts) > self.max_ghosts:
            self.ghosts.popitem(last=False)

    def _promote(self, node: Node) -> None:
        node.protected = True
        self.num_protected += 1
        self.num_promotions += 1

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self, nodes: Iterable[Node]) -> None:
        keys = set()
        protected = 0
        for node in nodes:
            keys.add(node.key)
            protected += node.protected
        assert self.protects or not protected, "protected nodes under plain LRU"
        assert protected == self.num_protected, "protected count drifted"
        assert len(self.ghosts) <= self.max_ghosts, "ghost history over its bound"
        assert not keys.intersection(self.ghosts), "a ghost key is in the tree"
