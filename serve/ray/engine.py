"""The serving runtime's engine when compute runs in the instances' own processes (the Ray
launch): each iteration's sub-batches go to the compute process of their instance in the
plan wire format, each runs the model over its own engine clients
(:class:`ModelProgram`) and answers with next-token logits. Membership changes (a process
died, an instance rejoined) are reported to the runtime, which owns the pool."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenlake.plans import Chunk, Plans

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """Where a compute process gets the model: a checkpoint directory present on its node,
    or ``"tiny-random"`` (made locally from ``seed``, identical everywhere)."""

    model: str
    dtype: str = "auto"
    seed: int = 0


class ModelProgram:
    """A compute process's program (see :mod:`tokenlake.engines.clusters.compute_process`): the model
    engine over the process's own clients. Returns ``[[request_id, logits], ...]`` (float32
    ``[vocab]``) for the chunks that produce a token."""

    def __init__(self, source: ModelSource) -> None:
        from tokenlake.engines.model.llama import LlamaModel
        from tokenlake.engines.model.tiny import TINY_RANDOM, write_tiny_random

        path = Path(source.model)
        if source.model == TINY_RANDOM:
            self._tmp = tempfile.TemporaryDirectory(prefix="tokenlake-tiny-random-")
            path = write_tiny_random(Path(self._tmp.name), seed=source.seed)
        self.model = LlamaModel.from_dir(path, source.dtype)

    def __call__(self, clients, plans: Plans, chunks: Mapping) -> list:
        from tokenlake.engines.model.engine import ModelEngine

        logits = ModelEngine(self.model, clients).run(plans, chunks)
        return [[rid, row.float().numpy()] for rid, row in logits.items()]


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


def logits_of(results) -> dict:
    """``{request_id: logits [vocab] float32}`` from the compute processes' results (each
    ``[[request_id, logits], ...]`` or ``None``)."""
    out = {}
    for result in results:
        for rid, row in result or ():
            out[rid] = torch.from_numpy(np.array(row, dtype=np.float32))
    return out
