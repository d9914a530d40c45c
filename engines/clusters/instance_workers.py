"""Instance workers: every instance of one host computes in a process of its own, with its own
step loop, and the server (the only process holding the ``Pool``) hands each its iterations
through shared memory.

    workers = InstanceWorkers(pool.config, dataplane, make_program)
    ticket = workers.start(plans, chunks)       # returns at once; the worker computes
    workers.wait(0.1)                           # until some worker answered (or a wake-up)
    result = workers.answer(ticket)             # None while it still runs

The server allocates every instance's buffers (pool, q/kv staging, outputs) in shared memory
and each worker maps all of them (:mod:`.instance_worker`), so a prefix part held by another
instance is read in place and no query or transfer engine process exists on this plane.
Iterations on disjoint instances run at once, each in its worker; an iteration whose batch
spans several instances (DoP > 1) runs in the worker of its first one. A worker that died or
hangs past ``DataPlaneConfig.timeout_s`` is reported (:meth:`failures`, :meth:`answer`), and
:meth:`respawn` starts a fresh one over the same buffers, which are still there: the memory is
the server's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from tokenlake import plan_wire, wire
from tokenlake.config import PoolConfig
from tokenlake.engines.clusters.base import layout_for
from tokenlake.engines.clusters.instance_worker import WorkerSpec, main
from tokenlake.engines.clusters.launcher import Started, process_context, stop_processes
from tokenlake.engines.core.shared_buffers import InstanceBuffers
from tokenlake.engines.dataplane_config import DataPlaneConfig, PeerFailedError, RemoteEngineError
from tokenlake.engines.transport import messages, step_mailbox
from tokenlake.engines.transport.peers import LauncherId
from tokenlake.engines.transport.step_mailbox import StepMailbox
from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk, Plans

ROLE = "worker"  # the one role of an instance on this plane


class InstanceWorkers:
    """One worker process per instance of ``config`` (a ``PoolConfig``), each running
    ``make_program()`` (a picklable factory; the program is called as ``program(cluster,
    plans, chunks)`` and returns plain values). ``job_bytes`` / ``result_bytes`` size each
    mailbox (an iteration's encoded plans and chunks / its packed result)."""

    def __init__(
        self,
        config: PoolConfig,
        dataplane: DataPlaneConfig,
        make_program: Callable[[], Callable],
        backend: str | None = None,
        torch_threads: int = 1,
        job_bytes: int = 16 << 20,
        result_bytes: int = 16 << 20,
    ) -> None:
        if dataplane.device != "cpu" or dataplane.separate_hosts:
            raise InvalidArgumentError(
                "dataplane: instance workers run on one host's CPU (device='cpu', "
                "separate_hosts=False)"
            )
        if getattr(config, "num_tier_blocks", 0):
            raise InvalidArgumentError("config: instance workers have no host tier")
        n = config.num_instances
        self.config, self.dataplane, self.backend = config, dataplane, backend
        self._make_program, self._torch_threads = make_program, torch_threads
        self._ctx = process_context()
        layout = layout_for(config, dataplane, n)
        self.buffers = [InstanceBuffers.allocate(layout.nbytes(), "cpu") for _ in range(n)]
        self._results = self._ctx.Semaphore(0)
        self.mailboxes = [
            StepMailbox.allocate(job_bytes, result_bytes, self._ctx, self._results)
            for _ in range(n)
        ]
        self._procs: list[Started | None] = [None] * n
        self._jobs: dict[int, tuple[int, float]] = {}  # worker -> (seq, posted at)
        self._closed = False
        try:
            for i in range(n):
                self._spawn(i)
            self._wait_ready(range(n))
        except BaseException:
            self.close()
            raise

    @property
    def num_instances(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid if p is not None else 0 for p in self._procs]

    # ---- processes -------------------------------------------------------------------------
    def _spawn(self, i: int) -> None:
        spec = WorkerSpec(
            i, self.config, self.dataplane, self.backend, tuple(self.buffers),
            self.mailboxes[i], self._make_program, LauncherId.this_process(),
            self._torch_threads,
        )  # fmt: skip
        p = self._ctx.Process(target=main, args=(spec,), name=f"tokenlake-worker-{i}")
        p.daemon = True
        p.start()
        self._procs[i] = Started(p)

    def _wait_ready(self, ids) -> None:
        deadline = time.monotonic() + self.dataplane.startup_timeout_s
        for i in ids:
            while not self.ready(i):
                if not self._procs[i].alive():
                    code = self._procs[i].process.exitcode
                    raise PeerFailedError(i, ROLE, f"exited at start-up ({code})")
                if time.monotonic() > deadline:
                    raise PeerFailedError(i, ROLE, "not ready in time")
                self._results.acquire(timeout=0.05)

    @property
    def busy(self) -> bool:
        """Whether some step is in flight (posted, not answered yet)."""
        return bool(self._jobs)

    def ready(self, i: int) -> bool:
        """Whether worker ``i`` runs and has reported ready."""
        p = self._procs[i]
        return p is not None and self.mailboxes[i].ready_pid() == p.pid and p.alive()

    def alive(self, i: int) -> bool:
        p = self._procs[i]
        return p is not None and p.alive()

    def failures(self) -> list[int]:
        """Workers that died (killed, crashed) or hang: one whose job has run longer than
        ``DataPlaneConfig.timeout_s`` is killed here, so it is reported dead from now on."""
        now = time.monotonic()
        for i, (_, posted) in self._jobs.items():
            if now - posted > self.dataplane.timeout_s:
                self._procs[i].kill()
        return [i for i in range(self.num_instances) if not self.alive(i)]

    def respawn(self, i: int) -> None:
        """A fresh worker for instance ``i`` (the old one killed if it still runs); returns
        at once: :meth:`ready` says when it serves."""
        old = self._procs[i]
        if old is not None:
            stop_processes([old], 0.0)
        self._jobs.pop(i, None)
        self.mailboxes[i].reset()
        self._spawn(i)

    # ---- steps -----------------------------------------------------------------------------
    def start(self, plans: Plans, chunks: Mapping[int | str, Chunk]) -> tuple[int, int]:
        """Post ``plans`` (with its requests' chunks) to the worker of its first origin;
        returns the ticket for :meth:`answer`."""
        origins = sorted({qp.origin for qp in plans.query_plans})
        if not origins:
            raise InvalidArgumentError("plans: no sub-batch to run")
        i = origins[0]
        if i in self._jobs:
            raise InvalidArgumentError(f"plans: worker {i} is still running an iteration")
        if not self.ready(i):
            raise PeerFailedError(i, ROLE, "not running")
        ids = [rid for qp in plans.query_plans for rid in qp.request_ids]
        job = messages.RunStep(
            0, plan_wire.encode(plans), tuple(plan_wire.encode(chunks[rid]) for rid in ids)
        )
        seq = self.mailboxes[i].post(messages.encode(job))
        self._jobs[i] = (seq, time.monotonic())
        return (i, seq)

    def answer(self, ticket: tuple[int, int]) -> object | None:
        """The result of ``ticket``'s step once its worker answered, ``None`` before. Raises
        :class:`RemoteEngineError` when the step failed there, :class:`PeerFailedError`
        when the worker died (or hung and was killed) before answering."""
        i, seq = ticket
        got = self.mailboxes[i].answer_of(seq)
        if got is None:
            if self.alive(i):
                return None
            got = self.mailboxes[i].answer_of(seq)  # it may have answered, then died
            if got is None:
                self._jobs.pop(i, None)
                raise PeerFailedError(i, ROLE, "died during a step")
        self._jobs.pop(i, None)
        status, payload = got
        if status != step_mailbox.OK:
            raise RemoteEngineError(f"worker {i}: {payload.decode('utf-8', 'replace')}")
        return wire.unpackb(payload, self.mailboxes[i].result_bytes)

    def wait(self, timeout_s: float) -> None:
        """Until a worker answers, :meth:`wake` is called, or ``timeout_s`` passed."""
        self._results.acquire(timeout=timeout_s)

    def wake(self) -> None:
        """End a :meth:`wait` in progress (or the next one) now."""
        self._results.release()

    # ---- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker (killing those that do not stop) and drop the buffers."""
        if self._closed:
            return
        self._closed = True
        started = [p for p in self._procs if p is not None]
        for i, p in enumerate(self._procs):
            if p is not None and p.alive():
                self.mailboxes[i].post_stop()
        stop_processes(started, 5.0)
        self.buffers, self.mailboxes = [], []

    def __enter__(self) -> InstanceWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
