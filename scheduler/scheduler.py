"""The elastic scheduler: a client of the pool that decides iterations and books their results.

It never places cache: it reads the prefix tree (where a new request's prefill starts, what
its admission pins) and the cache load, decides batches and DoPs (:mod:`.policy`, the §6.2
DP), and calls ``gen_plans``; after the data plane ran the plans, :meth:`complete` commits
them, advances every request and finishes the done ones (releasing their pins).

Asynchronous iterations (``sync_iterations=False``, docs/architecture.md#the-floors): each batch is an iteration
of its own on its own instances, committed on its own; :meth:`step` hands out the next one
for the free instances (:mod:`.lanes` chooses decode lanes and prefill instances). Memory
(:mod:`.memory`): FCFS admission within what the pool can hold; when the pool still runs
short, the running request with the lowest priority is preempted and later recomputed.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping

from tokenlake.errors import InvalidArgumentError, PoolFullError, UnknownRequestError
from tokenlake.plans import Chunk
from tokenlake.pool import Pool
from tokenlake.scheduler import memory
from tokenlake.scheduler.config import SchedulerConfig
from tokenlake.scheduler.deciding import Deciding
from tokenlake.scheduler.latency_model import LatencyModel
from tokenlake.scheduler.planned import IterationPlan, Planned
from tokenlake.scheduler.policy import SOLVERS, Decision
from tokenlake.scheduler.request import Phase, Request, next_tokens


class ElasticScheduler:
    """Goodput-optimized elastic scheduling over a :class:`~tokenlake.Pool` (paper §6).

    Usage::

        sched = ElasticScheduler(config, latency_model, pool)
        sched.add_request("r1", prompt, max_output_tokens=16)
        while sched.has_work:
            it = sched.step()                  # the next iteration for free instances
            ...                                # the data plane executes it.plans
            done = sched.complete(it, tokens)  # pool.commit, advance, pool.finish

    Asynchronous callers call :meth:`step` until it returns ``None`` whenever instances free
    up or requests arrive, and :meth:`complete` each iteration when it ends, in any order.
    ``clock`` gives seconds (the time between tokens is measured on it).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        latency_model: LatencyModel,
        pool: Pool,
        solver: str = "cpp",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise InvalidArgumentError(f"config: expected a SchedulerConfig, got {config!r}")
        if not isinstance(latency_model, LatencyModel):
            raise InvalidArgumentError("latency_model: expected a LatencyModel")
        pc = pool.config
        if (pc.num_instances, pc.segment_len) != (config.num_instances, config.segment_len):
            raise InvalidArgumentError(
                f"config: num_instances/segment_len {config.num_instances}/{config.segment_len} "
                f"differ from the pool's {pc.num_instances}/{pc.segment_len}"
            )
        if solver not in SOLVERS:
            raise InvalidArgumentError(f"solver: expected one of {sorted(SOLVERS)}, got {solver!r}")
        if not callable(clock):
            raise InvalidArgumentError(f"clock: expected a callable, got {clock!r}")
        self.config = config
        self.latency_model = latency_model
        self.pool = pool
        self.solver = solver
        self.clock = clock
        self._requests: dict[int | str, Request] = {}  # unfinished, in arrival order
        self._num_arrived = 0
        self._inflight: dict[int, IterationPlan] = {}  # epoch -> iteration handed out
        self._busy: dict[int | str, int] = {}  # request id -> epoch of its iteration
        self._planned: deque[IterationPlan] = deque()  # planned, not handed out yet
        self._deciding = Deciding(config, latency_model, pool, solver)
        self._victims: set[int | str] = set()  # preempted during the current step()
        self.num_preemptions = 0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: int | str, prompt, max_output_tokens: int = 1) -> None:
        """Queue a request: ``prompt`` token ids, at most ``max_output_tokens`` to generate.
        A request that could not fit in the whole pool even alone is refused."""
        try:
            hash(request_id)
        except TypeError:
            raise InvalidArgumentError(
                f"request_id: expected an int or str, got {request_id!r}"
            ) from None
        if request_id in self._requests:
            raise InvalidArgumentError(f"request_id: {request_id!r} is already queued or running")
        req = Request.create(
            request_id,
            prompt,
            max_output_tokens,
            self._num_arrived,
            self.clock(),
            self.config.input_token_slo,
        )
        need = memory.segments(req.max_len, self.config.segment_len)
        capacity = self._deciding.capacity_slots()
        if need > capacity:
            raise InvalidArgumentError(
                f"prompt: {req.prompt_len} tokens + max_output_tokens={max_output_tokens} need "
                f"{need} segments of {self.config.segment_len} tokens; the pool holds {capacity}"
            )
        self._requests[request_id] = req
        self._num_arrived += 1

    def request(self, request_id: int | str) -> Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"request_id: unknown request {request_id!r}") from None

    def cancel(self, request_id: int | str) -> None:
        """Drop a request that is not in an iteration in flight (a client went away, a stop
        token came): it leaves the queue, and the pool releases its pins (``pool.finish``,
        which keeps its partial tail) if it had reached the pool."""
        req = self.request(request_id)
        if request_id in self._busy:
            raise InvalidArgumentError(
                f"request_id: {request_id!r} is in an iteration in flight; complete it first"
            )
        if req.phase is not Phase.WAITING:
            self.pool.finish(request_id)
        del self._requests[request_id]

    def preempt(self, request_id: int | str) -> None:
        """Send a running request back to waiting (vLLM's recompute preemption): the pool
        releases it (``pool.finish``: its segments stay cached, unpinned) and it later
        recomputes every token it knows, from its cached prefix, before generating the next.
        Also the recovery of a request whose KV was lost (``pool.drop_instance`` returned it
        and already forgot it). Not for a request in an iteration in flight; a waiting
        request is left as it is."""
        req = self.request(request_id)
        if request_id in self._busy:
            raise InvalidArgumentError(
                f"request_id: {request_id!r} is in an iteration in flight; complete or abort it first"
            )
        if req.phase is Phase.WAITING:
            return
        with contextlib.suppress(UnknownRequestError):  # lost with an instance: nothing held
            self.pool.finish(request_id)
        req.preempt()
        self.num_preemptions += 1

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return sum(r.phase is Phase.WAITING for r in self._requests.values())

    @property
    def num_running(self) -> int:
        return len(self._requests) - self.num_waiting

    @property
    def iterations_in_flight(self) -> tuple[IterationPlan, ...]:
        """Iterations handed out by :meth:`step` and not completed or aborted yet."""
        return tuple(self._inflight.values())

    # ---- deciding ------------------------------------------------------------------------
    def decide(self, load: float | None = None, max_new_requests: int | None = None) -> Decision:
        """A synchronous iteration's batches and DoPs over every request and live instance;
        reads the prefix tree and cache load only (``load`` overrides ``get_cache_load``)."""
        return self._deciding.decide_sync(self._requests.values(), load, max_new_requests)

    def step(self, load: float | None = None) -> IterationPlan | None:
        """Plan the next iteration (``pool.gen_plans``); ``None`` when there is nothing to
        start now. Synchronous mode: one iteration over the whole cluster at a time (``None``
        while it is in flight).
        Asynchronous mode: one batch on free instances per call; call again until ``None``.
        """
        if self._planned:
            return self._hand_out(self._planned.popleft())
        if self.config.sync_iterations and self._inflight:
            return None  # one cluster-wide iteration at a time
        now = self.clock()
        while True:
            if self.config.sync_iterations:
                planned = [self._deciding.plan_sync(self._requests.values(), load, now)]
                planned = [p for p in planned if p.batches]
            else:
                reqs = list(self._requests.values())
                planned = self._deciding.plan_async(reqs, self._inflight.values(), now, load)
            self._victims = set()
            for p in planned:
                it = self._launch(p, now)
                if it is not None:
                    self._planned.append(it)
            # preempting emptied what was decided: decide again over the requests left (each
            # round preempts at least one request, so this ends)
            if self._planned or not self._victims:
                break
        return self._hand_out(self._planned.popleft()) if self._planned else None

    def _hand_out(self, it: IterationPlan) -> IterationPlan:
        self._inflight[it.plans.epoch] = it
        return it

    def _launch(self, planned: Planned, now: float) -> IterationPlan | None:
        """``gen_plans`` for ``planned``; when the pool is short, leave out its lowest-priority new request
        out, else preempt the lowest-priority running request in no iteration in flight (one of the
        batch's or a younger one). ``None`` when nothing of it is left to start."""
        while True:
            planned = planned.without(self._victims)  # preempted since it was decided
            if planned is None:
                return None
            planned = planned.with_chunks(self._shrunk_starts(planned))
            instances = planned.instances
            if instances is not None:  # earlier batches of this decision took some
                free = set(self.pool.free_instances)
                instances = [None if g is None else [i for i in g if i in free] for g in instances]
                if any(
                    g is not None and len(g) < d
                    for g, d in zip(instances, planned.dops, strict=True)
                ):
                    return None
            try:
                plans = self.pool.gen_plans(
                    [list(b) for b in planned.batches],
                    list(planned.dops),
                    self.pool.get_prefix_tree(),
                    instances=instances,
                )
            except PoolFullError:
                planned = self._make_room(planned)
                if planned is None:
                    return None
                continue
            for chunk in planned.chunks:
                self._busy[chunk.request_id] = plans.epoch
            return IterationPlan(planned.decision(), plans, now)

    def _shrunk_starts(self, planned: Planned) -> dict[int | str, Chunk]:
        """New requests whose cached prefix an earlier iteration of this step evicted start
        where the cache ends now."""
        tree, out = self.pool.get_prefix_tree(), {}
        for c in planned.chunks:
            req = self._requests[c.request_id]
            if req.phase is Phase.WAITING and c.start:
                start = min(tree.match(c.token_ids).num_tokens, req.num_known - 1)
                if start < c.start:
                    out[c.request_id] = Chunk(c.request_id, c.token_ids, start, c.end)
        return out

    def _make_room(self, planned: Planned) -> Planned | None:
        reqs = [self._requests[c.request_id] for c in planned.chunks]
        new = [r for r in reqs if r.phase is Phase.WAITING]
        if new:
            last = max(new, key=lambda r: r.priority).request_id
            chunk = next(c for c in planned.chunks if c.request_id == last)
            seg = self.config.segment_len
            if chunk.start % seg:  # without copy-on-extend it needs one slot fewer
                start = chunk.start - chunk.start % seg
                return planned.with_chunks({last: Chunk(last, chunk.token_ids, start, chunk.end)})
            return planned.without({last})
        idle = (r for r in self._requests.values() if r.request_id not in self._busy)
        victim = memory.victim(idle)  # the batch's running requests are candidates: never None
        self.preempt(victim.request_id)
        self._victims.add(victim.request_id)
        return planned

    # ---- results -------------------------------------------------------------------------
    def complete(
        self, iteration: IterationPlan, new_token_ids: Mapping[int | str, int] | None = None
    ) -> list[Request]:
        """Commit an executed iteration and advance its requests.

        ``new_token_ids[request_id]`` is the token sampled for a request whose chunk reached
        the end of its known tokens (a deterministic synthetic token when absent; always
        synthetic for multi-step decode chunks, see ``SchedulerConfig.decode_steps``).
        Returns the requests that finished; the pool has released them (``pool.finish``).
        """
        self._check(iteration)
        chunks = iteration.decision.chunks
        tokens = next_tokens(chunks, self._requests, new_token_ids or {})  # validates first
        self._take(iteration)
        self.pool.commit(iteration.plans)
        now = self.clock()
        self._deciding.observe(iteration, now)
        finished = []
        for chunk in chunks:
            req = self._requests[chunk.request_id]
            req.advance(chunk.end, tokens[chunk.request_id], now)
            if req.phase is Phase.FINISHED:
                self.pool.finish(chunk.request_id)
                del self._requests[chunk.request_id]
                finished.append(req)
        return finished

    def abort(self, iteration: IterationPlan) -> None:
        """Undo an iteration (``pool.abort``); its requests keep their state."""
        self._take(iteration)
        self.pool.abort(iteration.plans)

    def _check(self, iteration: IterationPlan) -> None:
        if not isinstance(iteration, IterationPlan) or (
            self._inflight.get(iteration.plans.epoch) is not iteration
        ):
            raise InvalidArgumentError(
                "iteration: not an iteration handed out by step() and still in flight"
            )

    def _take(self, iteration: IterationPlan) -> None:
        self._check(iteration)
        del self._inflight[iteration.plans.epoch]
        for chunk in iteration.decision.chunks:
            del self._busy[chunk.request_id]
