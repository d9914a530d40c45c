"""What a compute process runs when compute is out of the runtime's process (``--data-plane
compute`` on one host, the Ray launch on several): the model program over the process's own
engine clients, where it gets the model, and the logits it sends back."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenlake.plans import Plans


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


def logits_of(results) -> dict:
    """``{request_id: logits [vocab] float32}`` from the compute processes' results (each
    ``[[request_id, logits], ...]`` or ``None``)."""
    out = {}
    for result in results:
        for rid, row in result or ():
            out[rid] = torch.from_numpy(np.array(row, dtype=np.float32))
    return out
