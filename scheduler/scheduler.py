"""The elastic scheduler: a client of the pool that decides each iteration and books its result.

It never places cache: it reads the prefix tree (where a new request's prefill starts) and the
cache load, decides batches and DoPs (:mod:`tokenlake.scheduler.policy`), and calls
``gen_plans``; after the data plane ran the plans, :meth:`ElasticScheduler.complete` commits
them, advances every request and finishes the done ones (releasing their pins).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from tokenlake.errors import InvalidArgumentError, PoolFullError, UnknownRequestError
from tokenlake.plans import Plans
from tokenlake.pool import Pool
from tokenlake.scheduler.config import ELASTIC, XPYD, SchedulerConfig
from tokenlake.scheduler.latency_model import DECODE, PREFILL, LatencyModel
from tokenlake.scheduler.policy import SOLVERS, Decision, WorkItem, plan_batches, select_work
from tokenlake.scheduler.request import Phase, Request

VOCAB = 32000  # synthetic next tokens, when the caller supplies none


class IterationPlan(NamedTuple):
    """One planned iteration: the scheduler's decision and the pool's plans for it."""

    decision: Decision
    plans: Plans


class ElasticScheduler:
    """Goodput-optimized elastic scheduling over a :class:`~tokenlake.Pool` (paper §6).

    Usage::

        sched = ElasticScheduler(config, latency_model, pool)
        sched.add_request("r1", prompt, max_output_tokens=16)
        while sched.has_work:
            it = sched.step()                  # decide + pool.gen_plans
            ...                                # the data plane executes it.plans
            done = sched.complete(it, tokens)  # pool.commit, advance, pool.finish
    """

    def __init__(
        self, config: SchedulerConfig, latency_model: LatencyModel, pool: Pool, solver: str = "cpp"
    ) -> None:
        if not isinstance(config, SchedulerConfig):
            raise InvalidArgumentError("config: expected a SchedulerConfig")
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
        self.config = config
        self.latency_model = latency_model
        self.pool = pool
        self.solver = solver
        self._requests: dict[int | str, Request] = {}  # unfinished, in arrival order
        self._num_arrived = 0
        self._inflight: IterationPlan | None = None
        self._decode_turn = False  # one instance, elastic: alternate the phases

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request_id: int | str, prompt, max_output_tokens: int = 1) -> None:
        """Queue a request: ``prompt`` token ids, at most ``max_output_tokens`` to generate."""
        try:
            hash(request_id)
        except TypeError:
            raise InvalidArgumentError("request_id: expected an int or str") from None
        if request_id in self._requests:
            raise InvalidArgumentError(f"request_id: {request_id!r} is already queued or running")
        req = Request.create(request_id, prompt, max_output_tokens, self._num_arrived)
        self._requests[request_id] = req
        self._num_arrived += 1

    def request(self, request_id: int | str) -> Request:
        try:
            return self._requests[request_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"request_id: unknown request {request_id!r}") from None

    def cancel(self, request_id: int | str) -> None:
        """Drop a request that is not in the iteration in flight (a client went away, a stop
        token came): it leaves the queue, and the pool releases its pins (``pool.finish``,
        which keeps its partial tail) if it had reached the pool."""
        req = self.request(request_id)
        if self._inflight is not None and any(
            c.request_id == request_id for c in self._inflight.decision.chunks
        ):
            raise InvalidArgumentError(
                f"request_id: {request_id!r} is in the iteration in flight; complete it first"
            )
        if req.phase is not Phase.WAITING:
            self.pool.finish(request_id)
        del self._requests[request_id]

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        return sum(r.phase is Phase.WAITING for r in self._requests.values())

    @property
    def num_running(self) -> int:
        return len(self._requests) - self.num_waiting

    # ---- deciding ------------------------------------------------------------------------
    def decide(self, load: float | None = None, max_new_requests: int | None = None) -> Decision:
        """This iteration's batches and DoPs; reads the prefix tree and cache load only.

        ``load`` overrides the pool's ``get_cache_load`` (L = 0 when the pool has no load
        model). Runs on the pool's live instances.
        """
        tree = self.pool.get_prefix_tree()
        config = self._live_config()
        reqs = self._requests.values()
        phases = (PREFILL, DECODE)
        if config.mode == ELASTIC and config.num_instances == 1:
            has_decode = any(r.phase is Phase.DECODE for r in reqs)
            has_prefill = any(r.phase in (Phase.WAITING, Phase.PREFILL) for r in reqs)
            if has_decode and has_prefill:
                phases = (DECODE,) if self._decode_turn else (PREFILL,)
        items = select_work(
            reqs, config, lambda r: tree.match(r.token_ids).num_tokens, phases, max_new_requests
        )
        load = self._cache_load(items) if load is None else load
        return plan_batches(items, config, self.latency_model, load, self.solver)

    def _cache_load(self, items: list[WorkItem]) -> float:
        # get_cache_load needs the pool's roofline LoadModel; without one, L = 0
        if getattr(self.pool, "load_model", None) is None or not items:
            return 0.0
        reqs = [(it.start, it.num_new) for it in items]
        return float(self.pool.get_cache_load(reqs, self.pool.get_prefix_tree()))

    def _live_config(self) -> SchedulerConfig:
        """The config on the pool's live instances (an instance may have been dropped)."""
        cfg = self.config
        live = len(getattr(self.pool, "live_instances", range(cfg.num_instances)))
        if live >= cfg.num_instances:
            return cfg
        if live < 1 or (cfg.mode == XPYD and live < 2):
            raise InvalidArgumentError(f"pool: {live} live instances are too few for {cfg.mode}")
        prefill = min(cfg.num_prefill_instances, live - 1)
        return replace(cfg, num_instances=live, num_prefill_instances=prefill)

    def _fixed_roles(self, decision: Decision) -> list[list[int]] | None:
        """xPyD pins roles to instances: the first P live instances only ever run prefill
        batches, the others only decode (the dispatcher still picks within each set)."""
        if self.config.mode != XPYD:
            return None
        live = sorted(self.pool.live_instances)
        num_prefill = self._live_config().num_prefill_instances
        prefill, decode = live[:num_prefill], live[num_prefill:]
        return [prefill if phase == PREFILL else decode for phase in decision.phases]

    # ---- running -------------------------------------------------------------------------
    def step(self, load: float | None = None) -> IterationPlan | None:
        """Decide the next iteration and plan it with ``pool.gen_plans``; ``None`` when idle.

        If the pool is too full for every admitted request, fewer new requests are admitted
        (halving); ``PoolFullError`` propagates when even the running requests do not fit.
        """
        if self._inflight is not None:
            raise InvalidArgumentError("step: the previous iteration is not completed or aborted")
        limit = None
        while True:
            decision = self.decide(load, limit)
            if not decision.batches:
                return None
            try:
                plans = self.pool.gen_plans(
                    [list(b) for b in decision.batches],
                    list(decision.dops),
                    self.pool.get_prefix_tree(),
                    instances=self._fixed_roles(decision),
                )
                break
            except PoolFullError:
                new = sum(
                    self._requests[c.request_id].phase is Phase.WAITING for c in decision.chunks
                )
                if new == 0:
                    raise
                limit = new // 2
        self._decode_turn = PREFILL in decision.phases
        self._inflight = IterationPlan(decision, plans)
        return self._inflight

    def complete(
        self, iteration: IterationPlan, new_token_ids: Mapping[int | str, int] | None = None
    ) -> list[Request]:
        """Commit an executed iteration and advance its requests.

        ``new_token_ids[request_id]`` is the token sampled for a request whose chunk ended its
        prompt or was a decode step (a deterministic synthetic token when absent). Returns the
        requests that finished; the pool has released them (``pool.finish``).
        """
        self._check(iteration)
        given = new_token_ids or {}
        tokens = {}
        for chunk in iteration.decision.chunks:  # validate before anything changes
            req = self._requests[chunk.request_id]
            last = int(req.tokens[req.num_known - 1])
            token = given.get(chunk.request_id, (last * 7919 + 17) % VOCAB)
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise InvalidArgumentError(f"new_token_ids: expected int tokens, got {token!r}")
            if not 0 <= token < 2**31:
                raise InvalidArgumentError(f"new_token_ids: token {token} out of [0, 2**31)")
            tokens[chunk.request_id] = int(token)
        self._take(iteration)
        self.pool.commit(iteration.plans)
        finished = []
        for chunk in iteration.decision.chunks:
            req = self._requests[chunk.request_id]
            req.advance(chunk.end, tokens[chunk.request_id])
            if req.phase is Phase.FINISHED:
                self.pool.finish(chunk.request_id)
                del self._requests[chunk.request_id]
                finished.append(req)
        return finished

    def abort(self, iteration: IterationPlan) -> None:
        """Undo a planned iteration (``pool.abort``); its requests keep their state."""
        self._take(iteration)
        self.pool.abort(iteration.plans)

    def _check(self, iteration: IterationPlan) -> None:
        if iteration is not self._inflight or self._inflight is None:
            raise InvalidArgumentError("iteration: not the iteration returned by the last step()")

    def _take(self, iteration: IterationPlan) -> None:
        self._check(iteration)
        self._inflight = None
