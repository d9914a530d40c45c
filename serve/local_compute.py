"""``--data-plane compute``: every instance computes in a process of its own on this host.

With ``local`` or ``mp`` one server process runs every instance's dense layers, so the
instances share its compute (``compute_lanes=1``). Here each instance is what it is on a GPU
cluster, one process with its own model: an :class:`~tokenlake.engines.clusters.mp.MPCluster`
(query and transfer engines, shared buffers) and one compute process per instance
(:class:`~tokenlake.engines.clusters.compute_process.ComputeProcesses` running
:class:`~tokenlake.serve.compute_program.ModelProgram`, as the Ray launch does on each node). An
iteration's batches, one per instance at DoP 1, compute in parallel; the server process keeps
the pool, the scheduler and the HTTP API.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch

from tokenlake.plans import Chunk, Plans
from tokenlake.serve.compute_program import ModelProgram, ModelSource, logits_of


def _program(source: ModelSource, torch_threads: int) -> ModelProgram:
    """A compute process's model (module level: the spawn pickles this factory)."""
    if torch_threads:
        torch.set_num_threads(torch_threads)
    return ModelProgram(source)


class LocalComputeEngine:
    """What the runtime drives: ``run``/``retire`` per iteration over the compute processes.
    ``model`` is the server's copy (its config); ``cluster`` gives the engines' counters."""

    def __init__(self, model, cluster, compute) -> None:
        self.model, self.cluster, self.compute = model, cluster, compute

    def run(self, plans: Plans, chunks: Mapping[int | str, Chunk]) -> dict:
        """``{request_id: logits [vocab] float32}`` for the chunks that produce a token."""
        return logits_of(self.compute.run(plans, chunks))

    def retire(self, plans: Plans) -> None:
        self.compute.retire(plans.epoch)

    def mark_lost(self, instance_id: int) -> None:
        self.cluster.mark_lost(instance_id)

    def membership_changes(self) -> list[tuple[int, bool]]:
        """``(instance_id, False)`` for each instance still in use one of whose processes
        died: a query or transfer engine (``MPCluster.failures``) or its compute process."""
        lost = self.cluster.lost
        dead = set(self.cluster.failures()) | set(self.compute.failures())
        return [(i, False) for i in sorted(dead - lost)]

    def restart_instance(self, instance_id: int) -> None:
        """Fresh engines and a fresh compute process for a lost instance; the other compute
        processes reconnect to its new engines."""
        self.cluster.restart(instance_id)
        self.compute.restart(self.cluster, instance_id)


def make_engine(
    model_dir: str, dtype: str, torch_threads: int, model, cluster, closers: list
) -> LocalComputeEngine:
    """The engine over ``cluster``'s instances (an ``MPCluster``), one compute process each
    running the checkpoint in ``model_dir``; ``closers`` stops them before the engines."""
    from tokenlake.engines.clusters.compute_process import ComputeProcesses

    n = cluster.layout.num_instances
    factory = partial(_program, ModelSource(model_dir, dtype), torch_threads)
    compute = ComputeProcesses(cluster, [[i] for i in range(n)], factory)
    closers.append(compute.close)
    return LocalComputeEngine(model, cluster, compute)
