"""The serving runtime's engine when compute runs in the instances' own processes (the Ray
launch): each iteration's sub-batches go to the compute process of their instance in the
plan wire format, each runs the model over its own engine clients
(:class:`ModelProgram`) and answers with next-token logits. Membership changes (a process
died, an instance rejoined) are reported to the runtime, which owns the pool."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from tokenlake.plans import Chunk, Plans
from tokenlake.serve.compute_program import logits_of

log = logging.getLogger(__name__)


class RayModelEngine:
    """What :class:`~tokenlake.serve.runtime.Runtime` drives: ``run``/``retire`` per
    iteration over the launch's compute processes, plus membership. ``model`` is the
    driver's copy of the model (its config, tokenizer-side facts)."""

    def __init__(self, model, dataplane) -> None:
        self.model = model
        self.dataplane = dataplane
        self.cluster = dataplane  # what the runtime reads engine counters from

    def run(self, plans: Plans, chunks: Mapping[int | str, Chunk]) -> dict:
        """Execute one iteration; ``{request_id: logits [vocab] float32}`` like
        :meth:`~tokenlake.engines.model.engine.ModelEngine.run`. Raises
        :class:`PeerFailedError` naming the instance when a process of it died."""
        return logits_of(self.dataplane.run_step(plans, chunks))

    def retire(self, plans: Plans) -> None:
        """The control plane committed or aborted ``plans``."""
        self.dataplane.retire(plans.epoch)

    def mark_lost(self, instance_id: int) -> None:
        self.dataplane.mark_lost(instance_id)

    def membership_changes(self) -> list[tuple[int, bool]]:
        """``(instance_id, False)`` for each instance found dead since the last call (not yet
        marked lost), ``(instance_id, True)`` for each one that rejoined."""
        dp = self.dataplane
        return [(i, False) for i in dp.failures()] + [(i, True) for i in dp.rejoined()]

    def close(self) -> None:
        self.dataplane.close()
