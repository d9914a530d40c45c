"""An instance worker itself (the spawn target of
:class:`~tokenlake.engines.clusters.instance_workers.InstanceWorkers`): one instance's step
loop in a process of its own.

It maps every instance's buffers of the host (shared memory allocated by the server) and
serves them through the same engine clients and query engines as the in-process data plane
(:class:`~tokenlake.engines.clusters.local.LocalCluster` over the shared buffers): a prefix
part held by another instance is computed here, reading that instance's segments in place,
and a put writes straight into its home's slots. No other process is asked anything during a
step. Per step it takes the iteration's plans from its mailbox
(:mod:`tokenlake.engines.transport.step_mailbox`), decodes and range-checks them
(:mod:`tokenlake.plan_wire`), runs its program, retires the epoch (every put has landed: the
writes are synchronous) and answers with the program's result.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenlake import plan_wire, wire
from tokenlake.config import PoolConfig
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.engines.core.shared_buffers import InstanceBuffers
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.transport import messages, step_mailbox
from tokenlake.engines.transport.peers import LauncherId
from tokenlake.engines.transport.step_mailbox import StepMailbox
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk, Plans

# how often an idle worker checks that the server still runs
IDLE_CHECK_S = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned worker needs (pickled once, at spawn)."""

    instance_id: int
    pool: PoolConfig
    dataplane: DataPlaneConfig
    backend: str | None
    buffers: tuple[InstanceBuffers, ...]
    mailbox: StepMailbox
    make_program: Callable[[], Callable]
    launcher: LauncherId
    torch_threads: int


def run_job(cluster, program, limits: plan_wire.PlanLimits, job: bytes) -> bytes:
    """One step: decode ``job`` (a ``RunStep``), run ``program(cluster, plans, chunks)``,
    retire the epoch; returns the program's result packed (:func:`tokenlake.wire.packb`)."""
    msg = messages.decode(job)
    if not isinstance(msg, messages.RunStep):
        raise InvalidArgumentError(f"job: expected a RunStep, got {type(msg).__name__}")
    plans = plan_wire.decode(msg.plans, limits, Plans)
    chunks = [plan_wire.decode(c, limits, Chunk) for c in msg.chunks]
    try:
        result = program(cluster, plans, {c.request_id: c for c in chunks})
    finally:
        cluster.retire(plans.epoch)
    return wire.packb(result)


def main(spec: WorkerSpec) -> None:
    """Entry point of a worker (``multiprocessing`` spawn target)."""
    torch.set_num_threads(max(1, spec.torch_threads))
    box = spec.mailbox
    try:
        cluster = LocalCluster(
            spec.pool, backend=spec.backend, dataplane=spec.dataplane,
            buffers=dict(enumerate(spec.buffers)),
        )  # fmt: skip
        pc = spec.pool
        limits = plan_wire.PlanLimits(pc.num_instances, pc.num_slots, pc.segment_len)
        program = spec.make_program()
        box.report_ready(os.getpid())
        while True:
            try:
                job = box.take(IDLE_CHECK_S)
                if job is None:
                    if not spec.launcher.alive():
                        break
                    continue
                box.answer(step_mailbox.OK, run_job(cluster, program, limits, job))
            except StopIteration:
                break
            except Exception as e:  # answered: the server fails the iteration
                box.answer(step_mailbox.FAILED, f"{type(e).__name__}: {e}".encode()[:4096])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
