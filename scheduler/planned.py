"""Iterations as the scheduler plans them: :class:`Planned` (batches decided, not yet given to
the pool) and :class:`IterationPlan` (planned by the pool, in flight)."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

from tokenlake.plans import Chunk, Plans
from tokenlake.scheduler.policy import Decision


class IterationPlan(NamedTuple):
    """One planned iteration: the scheduler's decision, the pool's plans for it, and when it
    started on the scheduler's clock."""

    decision: Decision
    plans: Plans
    started_at: float = 0.0

    @property
    def predicted_end(self) -> float:
        return self.started_at + max(self.decision.latencies, default=0.0)


class Planned(NamedTuple):
    """Batches decided but not planned by the pool yet; ``instances[b]`` the instances batch
    ``b`` may run on (``None``: any free one)."""

    batches: tuple[tuple[Chunk, ...], ...]
    dops: tuple[int, ...]
    phases: tuple[str, ...]
    latencies: tuple[float, ...]
    instances: list[list[int] | None] | None
    load: float
    slo_met: bool
    cost: float

    @classmethod
    def of(cls, d: Decision, instances: list[list[int] | None] | None) -> Planned:
        return cls(d.batches, d.dops, d.phases, d.latencies, instances, d.load, d.slo_met, d.cost)

    @property
    def chunks(self) -> list[Chunk]:
        return [c for batch in self.batches for c in batch]

    def decision(self) -> Decision:
        return Decision(
            self.batches, self.dops, self.phases, self.latencies, self.load, self.slo_met, self.cost
        )

    def with_chunks(self, chunks: Mapping[int | str, Chunk]) -> Planned:
        """These batches with some requests' chunks replaced."""
        if not chunks:
            return self
        batches = tuple(tuple(chunks.get(c.request_id, c) for c in b) for b in self.batches)
        return self._replace(batches=batches)

    def without(self, request_ids: Collection[int | str]) -> Planned | None:
        """These batches without ``request_ids`` (a batch's DoP shrinks to its rows if need
        be; empty batches go); ``None`` if nothing is left."""
        if not request_ids or not any(c.request_id in request_ids for c in self.chunks):
            return self
        keep = []
        for b, batch in enumerate(self.batches):
            rest = tuple(c for c in batch if c.request_id not in request_ids)
            if rest:
                dop = min(self.dops[b], sum(c.num_new_tokens for c in rest))
                inst = None if self.instances is None else self.instances[b]
                keep.append((rest, dop, self.phases[b], self.latencies[b], inst))
        if not keep:
            return None
        batches, dops, phases, latencies, instances = zip(*keep, strict=True)
        return Planned(
            batches,
            dops,
            phases,
            latencies,
            None if self.instances is None else list(instances),
            self.load,
            self.slo_met,
            self.cost,
        )
