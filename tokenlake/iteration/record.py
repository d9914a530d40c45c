"""One iteration in flight: everything ``gen_plans`` reserved and what ``commit`` or ``abort``
must settle.

``gen_plans`` changes only what the data plane needs reserved while the plans execute:
slots (free ones, or slots of evicted replicas), tree reservations of the segments being
written, pins of new requests' cached prefixes and of replication sources, and readers on
every segment the plans read (so no concurrent iteration evicts any copy of them). Every
soft effect — access counts and their decay, LRU touches, the load window, counters — is
recorded here and applied only by ``commit``; an aborted iteration leaves no trace of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tokenlake.iteration.requests import PlannedChunk
from tokenlake.planning.builder import Traffic
from tokenlake.planning.chunk_set import ChunkSet
from tokenlake.planning.page_gather import Reads
from tokenlake.plans import Plans
from tokenlake.tree.prefix_tree import Evicted, Location, Node


@dataclass(eq=False)
class Iteration:
    epoch: int
    chunk_set: ChunkSet  # every chunk, in batch order
    chunks: list[PlannedChunk] = field(default_factory=list)  # those not in place
    new_chunks: list[PlannedChunk] = field(default_factory=list)  # requests it admitted
    victims: list[Evicted] = field(default_factory=list)  # tentative evictions, in order
    replications: list[tuple[Node, Location, Location]] = field(default_factory=list)
    loads: list[tuple[Node, Location]] = field(default_factory=list)  # host tier -> slot
    demotions_copied: frozenset[int] = frozenset()  # blocks its transfer plans write
    tier_hit_tokens: int = 0  # prompt tokens its new requests read from the host tier
    read_idx: list[np.ndarray] = field(default_factory=list)  # table rows it reads
    decided_replication: bool = False
    failover: tuple[int, frozenset[int]] | None = None  # membership changes, lost-replica keys
    plans: Plans | None = None
    traffic: Traffic | None = None
    reads: Reads | None = None
    instances: frozenset[int] = frozenset()  # every instance the plans touch
    gen_plans_s: float = 0.0  # how long gen_plans took (a histogram at commit)

    @property
    def origins(self) -> frozenset[int]:
        return frozenset(self.plans.origins) if self.plans is not None else frozenset()

    def new_slots(self) -> list[Location]:
        """Slots it obtained (free ones or victims'): new segments, replica copies and
        segments loaded from the host tier."""
        out = [w.location for pc in self.chunks for w in pc.writes if w.new_slot]
        return out + [dst for _, _, dst in self.replications] + [loc for _, loc in self.loads]

    def pinned_nodes(self) -> list[Node]:
        """Nodes pinned by the requests it admitted (kept by them at commit)."""
        out = []
        for pc in self.new_chunks:
            out.extend(pc.state.tree_nodes)
            if pc.source is not None:
                out.append(pc.source)
        return out

    def all_read_idx(self) -> np.ndarray:
        if not self.read_idx:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(self.read_idx).astype(np.int64, copy=False)
