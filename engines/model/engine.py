"""The compute engine of a served model: one planned iteration in, next-token logits out."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tokenlake.engines.client.forward import run_forward
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk, Plans


class ModelEngine:
    """Runs a :class:`LlamaModel` over a cluster's engines (``LocalCluster`` or ``MPCluster``)."""

    def __init__(self, model: LlamaModel, cluster) -> None:
        self.model = model
        self.cluster = cluster

    def run(self, plans: Plans, chunks: Mapping[int | str, Chunk]) -> dict[int | str, torch.Tensor]:
        """Execute one iteration. Returns ``{request_id: logits [vocab] float32}`` for every
        chunk that reaches the end of its known tokens (a prompt's last chunk, a decode step):
        the distribution of the request's next token."""
        batch, state = run_forward(self.cluster, plans, chunks, self.model)
        wanted = [b for b, c in enumerate(batch.chunks) if c.end == len(c.token_ids)]
        if not wanted:
            return {}
        rows = torch.from_numpy(batch.last_rows[wanted])
        logits = self.model.logits(state, rows)
        return {batch.request_ids[b]: logits[i] for i, b in enumerate(wanted)}

    def mark_lost(self, instance_id: int) -> None:
        """An instance died: the data plane stops using it (a local cluster has no failures)."""
        mark = getattr(self.cluster, "mark_lost", None)
        if mark is not None:
            mark(instance_id)

    def restart_instance(self, instance_id: int) -> None:
        """Fresh processes for a lost instance (``MPCluster.restart``), serving again with
        empty slots. Raises ``InvalidArgumentError`` where the cluster cannot restart one."""
        restart = getattr(self.cluster, "restart", None)
        if restart is None:
            raise InvalidArgumentError("instance_id: this cluster cannot restart an instance")
        restart(instance_id)

    def membership_changes(self) -> list[tuple[int, bool]]:
        """The cluster's news of dead (``False``) and rejoined (``True``) instances, polled
        by the serving loop also while idle (a local cluster has none)."""
        changes = getattr(self.cluster, "membership_changes", None)
        return list(changes()) if changes is not None else []

    def retire(self, plans: Plans) -> None:
        """The control plane committed or aborted ``plans``: the data plane may drop them."""
        retire = getattr(self.cluster, "retire", None)
        if retire is not None:
            retire(plans.epoch)
