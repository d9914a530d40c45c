"""What an instance worker runs per step (:mod:`tokenlake.engines.clusters.instance_worker`):
the model over the worker's engine clients, answering with next-token logits."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from tokenlake.engines.model.engine import ModelEngine
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.plans import Chunk, Plans


class StepProgram:
    """The checkpoint in ``model_dir`` (read once, in the worker) as a step program: returns
    ``{"ids": [request_id, ...], "logits": float32 [len(ids) * vocab]}`` for the chunks that
    produce a token (see :meth:`ModelEngine.run`), and :func:`logits_of` reads it back."""

    def __init__(self, model_dir: str, dtype: str = "auto") -> None:
        self.model = LlamaModel.from_dir(Path(model_dir), dtype)

    def __call__(self, cluster, plans: Plans, chunks: Mapping[int | str, Chunk]) -> dict:
        logits = ModelEngine(self.model, cluster).run(plans, chunks)
        ids = list(logits)
        rows = torch.stack([logits[rid] for rid in ids]).float() if ids else torch.zeros(0)
        return {"ids": ids, "logits": rows.reshape(-1).numpy()}


def logits_of(result: object, vocab_size: int, request_ids) -> dict[int | str, torch.Tensor]:
    """``{request_id: logits [vocab] float32}`` from a :class:`StepProgram` result that came
    from another process: its shape and ids are checked against what the step asked for
    (``request_ids``) before anything is used."""
    if not isinstance(result, dict) or set(result) != {"ids", "logits"}:
        raise ValueError("result: expected a map of 'ids' and 'logits'")
    ids, flat = result["ids"], result["logits"]
    asked = set(request_ids)
    if not isinstance(ids, list) or len(set(ids)) != len(ids) or not set(ids) <= asked:
        raise ValueError("result: ids must be distinct requests of the step")
    if not isinstance(flat, np.ndarray) or flat.dtype != np.float32:
        raise ValueError("result: logits must be float32")
    if flat.size != len(ids) * vocab_size:
        raise ValueError(f"result: {flat.size} logits for {len(ids)} rows of {vocab_size}")
    rows = torch.from_numpy(flat.copy()).view(len(ids), vocab_size)
    return {rid: rows[k] for k, rid in enumerate(ids)}
