"""``--data-plane workers``: every instance computes in a worker process of its own, with its
own step loop, and the server only plans, samples and streams.

The server process keeps the pool, the scheduler (asynchronous iterations: a batch starts as
soon as its instance is free, :class:`~tokenlake.serve.async_runtime.AsyncRuntime`) and the
HTTP API; each instance is one worker (:class:`~tokenlake.engines.clusters.instance_workers.
InstanceWorkers`) holding its own copy of the model. An iteration's plans go to its worker
through a mailbox in shared memory and its next-token logits come back the same way; a
worker reads the prefix segments another instance holds in place (all instances' KV lives in
shared memory the server allocated), so a step sends no message at all. The worker is the
instance's only process: killing it loses the instance, whose requests are recomputed on the
others while a fresh worker starts and rejoins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial

import tokenlake as tl
from tokenlake.engines.clusters.instance_workers import InstanceWorkers
from tokenlake.engines.dataplane_config import DataPlaneConfig
from tokenlake.engines.model.step_program import StepProgram, logits_of
from tokenlake.plans import Chunk, Plans

# bytes of an encoded token id in a job (int64), and the room left for the plans' arrays
TOKEN_BYTES = 8
PLAN_BYTES = 8 << 20


class WorkersEngine:
    """What :class:`~tokenlake.serve.async_runtime.AsyncRuntime` drives: :meth:`start` an
    iteration on its worker, :meth:`answer` it once done; :meth:`wait` for any answer.
    Membership: :meth:`dead` lists the instances whose worker died (the runtime drains and
    fails them over), :meth:`mark_lost` starts a fresh worker, and
    :meth:`membership_changes` reports it back once it serves."""

    def __init__(self, model, workers: InstanceWorkers) -> None:
        self.model, self.workers = model, workers
        self.cluster = None  # no engine processes to read counters from
        self._lost: set[int] = set()  # instances whose fresh worker is starting

    def start(self, plans: Plans, chunks: Mapping[int | str, Chunk]):
        return self.workers.start(plans, chunks)

    def answer(self, ticket, request_ids) -> dict | None:
        """``{request_id: logits}`` of a finished step, ``None`` while it runs (raises as
        :meth:`InstanceWorkers.answer`)."""
        result = self.workers.answer(ticket)
        if result is None:
            return None
        return logits_of(result, self.model.config.vocab_size, request_ids)

    def wait(self, timeout_s: float) -> None:
        self.workers.wait(timeout_s)

    def wake(self) -> None:
        self.workers.wake()

    def dead(self) -> list[int]:
        """Instances in use whose worker died (or hung and was killed)."""
        return [i for i in self.workers.failures() if i not in self._lost]

    def retire(self, plans: Plans) -> None:
        """Nothing to do: a worker retires its epoch when its step ends."""

    def mark_lost(self, instance_id: int) -> None:
        self._lost.add(instance_id)
        self.workers.respawn(instance_id)

    def membership_changes(self) -> list[tuple[int, bool]]:
        """``(instance_id, True)`` for each lost instance whose fresh worker now serves, and
        ``(instance_id, False)`` for each dead worker while no step is in flight (the idle
        server fails it over at once; with steps in flight the runtime drains them first)."""
        back = sorted(i for i in self._lost if self.workers.ready(i))
        self._lost -= set(back)
        dead = [] if self.workers.busy else self.dead()
        return [(i, False) for i in dead] + [(i, True) for i in back]


def make_engine(
    model_dir: str,
    dtype: str,
    model,
    pool_config: tl.PoolConfig,
    max_num_seqs: int,
    max_model_len: int,
    chunk_len: int,
    backend: str | None,
    torch_threads: int,
    closers: list,
) -> WorkersEngine:
    """Start one worker per instance of ``pool_config``, each loading ``model_dir``;
    ``closers`` stops them."""
    n = pool_config.num_instances
    rows = chunk_len * n + max_num_seqs
    dataplane = DataPlaneConfig(max_q_rows=rows, max_kv_rows=rows)
    job_bytes = PLAN_BYTES + max_num_seqs * max_model_len * TOKEN_BYTES
    result_bytes = (1 << 16) + max_num_seqs * model.config.vocab_size * 4
    workers = InstanceWorkers(
        pool_config, dataplane, partial(StepProgram, model_dir, dtype), backend,
        torch_threads, job_bytes=math.ceil(job_bytes), result_bytes=result_bytes,
    )  # fmt: skip
    closers.append(workers.close)
    return WorkersEngine(model, workers)
