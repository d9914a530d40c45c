"""From requests to planned iterations: the synchronous decision over the whole cluster, the
asynchronous one over the free instances (lanes, :mod:`.lanes`), with memory-aware
admission (:mod:`.admitting`). Reads the pool (prefix tree, free capacity, instances), never
changes it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from tokenlake.errors import InvalidArgumentError
from tokenlake.plans import Chunk
from tokenlake.pool import Pool
from tokenlake.scheduler.admitting import Admission, items_of
from tokenlake.scheduler.config import COLOCATED, ELASTIC, XPYD, SchedulerConfig
from tokenlake.scheduler.lanes import Running, prefill_budget, split_free_instances
from tokenlake.scheduler.latency_model import DECODE, PREFILL, LatencyModel
from tokenlake.scheduler.pending import PendingPrefixes
from tokenlake.scheduler.planned import IterationPlan, Planned
from tokenlake.scheduler.policy import (
    Decision,
    InstanceLimits,
    WorkItem,
    plan_batches,
    select_work,
)
from tokenlake.scheduler.request import Phase, Request
from tokenlake.tree.prefix_tree import PrefixMatch

TBT_MARGIN = 0.6  # share of the TBT SLO multi-step decode plans to (the rest: misprediction)
DECODE_SCALE_WEIGHT = 0.2  # EWMA weight of the latest decode iteration's measured/predicted


class Deciding:
    def __init__(
        self, config: SchedulerConfig, model: LatencyModel, pool: Pool, solver: str
    ) -> None:
        self.config, self.model, self.pool, self.solver = config, model, pool, solver
        self._decode_turn = False  # one live instance, elastic: alternate the phases
        # measured / predicted time of decode iterations (EWMA): what sharing the GPUs with
        # other iterations' work costs the decode lanes beyond the model
        self.decode_scale = 1.0
        self.admission = Admission(config, pool)

    def observe(self, it: IterationPlan, now: float) -> None:
        """An iteration ended at ``now``: calibrate the decode step time on decode ones."""
        predicted = max(it.decision.latencies, default=0.0) / self.decode_scale
        if it.decision.phases == (DECODE,) and predicted > 0 and now > it.started_at:
            ratio = min(max((now - it.started_at) / predicted, 0.25), 16.0)
            self.decode_scale += DECODE_SCALE_WEIGHT * (ratio - self.decode_scale)

    def capacity_slots(self) -> int:
        return self.admission.capacity_slots()

    # ---- synchronous ---------------------------------------------------------------------
    def decide_sync(
        self,
        requests: Iterable[Request],
        load: float | None = None,
        max_new_requests: int | None = None,
        now: float = math.inf,
    ) -> Decision:
        reqs = list(requests)
        config = self._live_config()
        free = None
        if math.isfinite(config.tbt_slo) and any(r.phase is Phase.DECODE for r in reqs):
            # decodes wait for the whole iteration: its prefill chunks fit the TBT SLO
            free = config.prefill_instances
        items = self._work(reqs, reqs, config, {}, num_free=free,
                           max_new_requests=max_new_requests, now=now,
                           decoding=free is not None)  # fmt: skip
        load = self.admission.cache_load(items) if load is None else load
        return plan_batches(items, config, self.model, load, self.solver)

    def plan_sync(
        self, requests: Iterable[Request], load: float | None, now: float = math.inf
    ) -> Planned:
        decision = self.decide_sync(requests, load, now=now)
        self._decode_turn = PREFILL in decision.phases
        return Planned.of(decision, self._fixed_roles(decision))

    def _work(
        self,
        idle: Sequence[Request],
        requests: Iterable[Request],
        config: SchedulerConfig,
        stored: Mapping[int | str, int],
        num_free: int | None = None,
        max_new_requests: int | None = None,
        inflight: Sequence[Chunk] = (),
        now: float = math.inf,
        decoding: bool = False,
    ) -> list[WorkItem]:
        """Work items of ``idle`` requests that memory admits; new requests whose next
        segment a chunk ``inflight`` or chosen before them computes wait for it. Elastic on
        one instance: one phase, alternating (the other when the turn's phase has nothing to
        run)."""
        options = [(PREFILL, DECODE)]
        if config.mode == ELASTIC and config.num_instances == 1:
            has_decode = any(r.phase is Phase.DECODE for r in idle)
            has_prefill = any(r.phase in (Phase.WAITING, Phase.PREFILL) for r in idle)
            if has_decode and has_prefill:
                options = [(DECODE,), (PREFILL,)]
                if not self._decode_turn:
                    options.reverse()
        self.admission.forget_finished(requests, len(idle))
        for phases in options:
            budget = None
            if num_free is not None:
                budget = prefill_budget(config, self.model, num_free, decoding)
                if config.mode == COLOCATED:
                    budget -= sum(r.phase is Phase.DECODE for r in idle)
            matches: dict[int | str, PrefixMatch] = {}
            cached = self.admission.cached(matches)
            args = (config, cached, phases, max_new_requests, budget, inflight)
            chosen = self._select(idle, *args)
            items = self.admission.admit(chosen, requests, stored, matches, now)
            if len(items) < len(chosen):
                # new requests memory holds back took prefill budget that running prefills
                # and the requests behind them can use (else a running prefill behind a
                # cached turn that does not fit could stall): choose again without them
                held = {it.request_id for it in chosen} - {it.request_id for it in items}
                chosen = self._select([r for r in idle if r.request_id not in held], *args)
                items = self.admission.admit(chosen, requests, stored, matches, now)
            if items:
                return items
        return []

    @staticmethod
    def _select(
        reqs: Sequence[Request],
        config: SchedulerConfig,
        cached: Callable[[Request], int],
        phases: tuple[str, ...],
        max_new_requests: int | None,
        budget: int | None,
        inflight: Sequence[Chunk],
    ) -> list[WorkItem]:
        pending = None
        if config.defer_pending_prefix:  # a fresh one per choice: select_work adds to it
            pending = PendingPrefixes(config.segment_len)
            for c in inflight:
                pending.add(c.token_ids, c.start, c.end)
        return select_work(reqs, config, cached, phases, max_new_requests, budget, pending)

    def _live_config(self) -> SchedulerConfig:
        """The config on the pool's live instances (an instance may have been dropped)."""
        cfg = self.config
        live = len(self.pool.live_instances)
        if live >= cfg.num_instances:
            return cfg
        if live < 1 or (cfg.mode == XPYD and live < 2):
            raise InvalidArgumentError(f"pool: {live} live instances are too few for {cfg.mode}")
        prefill = min(cfg.num_prefill_instances, live - 1)
        return replace(cfg, num_instances=live, num_prefill_instances=prefill)

    def _fixed_roles(self, decision: Decision) -> list[list[int] | None] | None:
        """xPyD pins roles to instances: the first P live instances only ever run prefill
        batches, the others only decode (the dispatcher still picks within each set)."""
        if self.config.mode != XPYD:
            return None
        live = sorted(self.pool.live_instances)
        num_prefill = self._live_config().num_prefill_instances
        prefill, decode = live[:num_prefill], live[num_prefill:]
        return [prefill if phase == PREFILL else decode for phase in decision.phases]

    # ---- asynchronous --------------------------------------------------------------------
    def plan_async(
        self,
        requests: Sequence[Request],
        inflight: Iterable[IterationPlan],
        now: float,
        load: float | None = None,
    ) -> list[Planned]:
        """Batches for the free instances, each an iteration of its own: decode lanes first,
        then prefill, over the ``requests`` in none of the iterations ``inflight``."""
        free = list(self.pool.free_instances)
        inflight = list(inflight)
        busy = {c.request_id for it in inflight for c in it.decision.chunks}
        idle = [r for r in requests if r.request_id not in busy]
        if not free or not idle:
            return []
        chunks = [c for it in inflight for c in it.decision.chunks]
        stored = {c.request_id: c.end for c in chunks}
        live = list(self.pool.live_instances)
        cfg = self._live_config()
        if cfg.mode == COLOCATED or (cfg.mode == ELASTIC and len(live) == 1):
            items = self._work(idle, requests, cfg, stored, len(free), inflight=chunks, now=now)
            n = len(free)
            limits = InstanceLimits(n, n, 0 if cfg.mode == COLOCATED else n)
            d = self._plan(items, limits, load, inflight)
            if d.batches:
                self._decode_turn = PREFILL in d.phases
            return [self._one(d, b, free) for b in range(len(d.batches))]
        running = [
            Running(it.decision.phases[0], it.plans.origins, _num_decodes(it), it.predicted_end)
            for it in inflight
        ]
        ready = [r for r in idle if r.phase is Phase.DECODE]
        prefills = [r for r in idle if r.phase is not Phase.DECODE]
        load_now = self.admission.cache_load(items_of(ready), inflight) if load is None else load
        split = split_free_instances(
            cfg,
            self.model,
            load_now,
            now,
            live,
            free,
            running,
            ready,
            self.decode_scale,
            prefill_waits=bool(prefills),
            homes={r.request_id: self.pool.home_instance(r.request_id) for r in ready},
        )
        out = []
        if split.decodes:
            out += self._lanes(split.decodes, split.decode_instances, load_now)
        if split.prefill_instances:
            p = len(split.prefill_instances)
            decoding = cfg.mode == ELASTIC and (bool(ready) or any(r.num_decodes for r in running))
            items = self._work(
                prefills, requests, cfg, stored, p, inflight=chunks, now=now, decoding=decoding
            )
            d = self._plan(items, InstanceLimits(p, p, 0), load, inflight)
            out += [self._one(d, b, split.prefill_instances) for b in range(len(d.batches))]
        return out

    def _lanes(self, decodes, lanes: Sequence[int], load: float) -> list[Planned]:
        """Decode batches on ``lanes``: the most even split, which is the DP's decode table
        for alike decode steps (convex cost), without building the DP."""
        k = min(len(lanes), len(decodes))
        out, start = [], 0
        for b in range(k):
            end = start + (len(decodes) - start) // (k - b)
            reqs = decodes[start:end]
            latency = self.decode_scale * self.model.predict(DECODE, [1] * len(reqs), load=load)
            steps = self._decode_steps(latency)
            chunks = tuple(
                Chunk(
                    r.request_id,
                    r.lookahead(min(steps, r.max_output_tokens - r.num_generated)),
                    r.num_known - 1,
                )
                if steps > 1
                else Chunk(r.request_id, r.token_ids, r.num_known - 1)
                for r in reqs
            )
            latency *= max(c.num_new_tokens for c in chunks)
            cost = latency * len(reqs)
            out.append(
                Planned((chunks,), (1,), (DECODE,), (latency,), [list(lanes)], load, True, cost)
            )
            start = end
        return out

    def _decode_steps(self, step: float) -> int:
        """Steps of one decode iteration: ``decode_steps`` at most, and few enough that a
        decode becoming ready just after it started, which waits for it and then takes one
        step, still gets its next token within ``TBT_MARGIN`` of the TBT SLO."""
        cfg = self.config
        if cfg.decode_steps == 1 or not math.isfinite(cfg.tbt_slo):
            return cfg.decode_steps
        return max(1, min(cfg.decode_steps, int(TBT_MARGIN * cfg.tbt_slo / step) - 1))

    def _plan(self, items, limits: InstanceLimits, load, inflight) -> Decision:
        load = self.admission.cache_load(items, inflight) if load is None else load
        return plan_batches(items, self.config, self.model, load, self.solver, limits)

    @staticmethod
    def _one(d: Decision, b: int, instances: Sequence[int]) -> Planned:
        return Planned(
            (d.batches[b],),
            (d.dops[b],),
            (d.phases[b],),
            (d.latencies[b],),
            [list(instances)],
            d.load,
            d.slo_met,
            d.cost,
        )


def _num_decodes(it: IterationPlan) -> int:
    return sum(
        len(batch)
        for batch, phase in zip(it.decision.batches, it.decision.phases, strict=True)
        if phase == DECODE
    )
