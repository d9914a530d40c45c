"""TokenLake in the simulator: the real pool (``tokenlake.Pool``) and the real elastic scheduler
(``tokenlake.scheduler.ElasticScheduler``) run unchanged; only time is simulated.

Iterations are asynchronous (docs/architecture.md#the-floors): whenever instances free up or requests arrive the
scheduler is asked for the next iterations (``step()`` until ``None``), each one batch on its
own instances; each ends on its own and is committed at once. The scheduler does the
admission (FCFS, within what the pool can hold) and preempts when the pool runs short, so
the simulator only hands requests over. A request larger than the whole pool is rejected.
Times come from :mod:`tokenlake.benchmarks.sim.systems.tokenlake_timing` (compute, queries and puts sharing
each GPU; distributed attention layer by layer, see :mod:`.layered`). The control plane costs
simulated time: each ``step()`` (which runs ``gen_plans``) and ``complete()`` costs what
the calibrated cost model says for what it handled (:mod:`..control_plane_cost`; or, live, its
measured thread CPU time), scaled by ``PricingConfig.control_plane_scale``; the control plane
runs one call at a time, and every iteration waits for its planning plus one dispatch RPC
(``PricingConfig.rpc_s``) before its work. ``sync_iterations=True`` is the old model for comparison: one cluster-wide
iteration at a time, lasting as long as its busiest instance.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenlake import EvictionConfig, InvalidArgumentError, Pool, PoolConfig, PoolFullError
from tokenlake.benchmarks.sim.context import SimContext
from tokenlake.benchmarks.sim.control_plane_cost import ControlPlaneCost, ControlPlaneMeter
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.systems import tokenlake_tier as tier
from tokenlake.benchmarks.sim.systems.layered import (
    NVLINK_PER_DIRECTION,
    LayeredPricing,
    PricingConfig,
)
from tokenlake.benchmarks.sim.systems.tokenlake_tier import HostTierConfig
from tokenlake.benchmarks.sim.systems.tokenlake_timing import Flight, SharedHost, TokenLakeTiming
from tokenlake.benchmarks.workloads.request import prompt_tokens
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.cluster.load_model import LoadModel
from tokenlake.scheduler import ElasticScheduler, SchedulerConfig


@dataclass(frozen=True)
class TokenLakeConfig:
    """Args: mode / num_prefill (the scheduler's ``elastic`` or ``xpyd`` with P prefill
    instances); segment_len (the pool's); chunk_len / max_prefill_tokens / tbt_slo /
    input_token_slo / output_reserve / decode_steps (the scheduler's); sync_iterations (one cluster-wide
    iteration at a time, the pre-asynchronous model); eviction (the pool's policy, None: its
    default); page_groups (the decode timing's shared-page groups; off: every row reads
    its own pages, as the baselines without cascade); pricing (distributed attention, the
    control plane's CPU time and RPC, see :class:`PricingConfig`); latency (the scheduler's
    latency model, as a server profiles its own; None: fitted to the roofline's forwards)."""

    mode: str = "elastic"
    num_prefill: int = 0
    segment_len: int = 512
    chunk_len: int = 8192
    max_prefill_tokens: int = 0
    tbt_slo: float = math.inf
    input_token_slo: float = math.inf
    output_reserve: float = 1.0
    decode_steps: int = 1
    sync_iterations: bool = False
    eviction: str | None = None
    page_groups: bool = True  # decode reads of rows sharing a page grouped (the data plane's)
    pricing: PricingConfig = PricingConfig()
    latency: object = None  # the scheduler's LatencyModel; None: fitted to the roofline
    token_overhead_s: float = 0.0  # serving CPU per streamed token (a CPU host's thread)
    iteration_overhead_s: float = 0.0  # ... and per iteration of its serving loop
    compute_lanes: int = 0  # the scheduler's batches computed in parallel (0: one per instance)
    # the control plane's cost model (None: each call's measured CPU time, live)
    control_plane_cost: ControlPlaneCost | None = None
    host_tier: HostTierConfig = HostTierConfig()  # the pool's host tier (0 GiB: none)


class TokenLakeSystem:
    def __init__(
        self,
        ctx: SimContext,
        config: TokenLakeConfig | None = None,
        cpu_clock: Callable[[], float] = time.thread_time,
        host: SharedHost | None = None,
        load_offset: int = 0,
        control_samples: list | None = None,
    ) -> None:
        """``cpu_clock``: the clock the control plane's calls are measured with when no
        cost model prices them (this thread's CPU time by default: a loaded machine does
        not inflate it as much as wall time). ``host``: the instances run in one thread on
        this CPU host (see :class:`TokenLakeTiming`). ``load_offset``: this system's first
        instance in ``load`` (a router's workers share one timeline). ``control_samples``:
        every control-plane call is appended there, (kind, features, measured seconds), to
        calibrate the cost model."""
        config = config or TokenLakeConfig()
        loop, timer, spec, load = ctx.loop, ctx.timer, ctx.spec, ctx.load
        self.loop, self.timer, self.spec, self.load = loop, timer, spec, load
        self.on_finished_cb, self.on_rejected_cb = ctx.on_finished, ctx.on_rejected
        n, seg = spec.num_instances, config.segment_len
        num_slots = max(1, spec.capacity_tokens // seg)
        # the hop priced (PricingConfig.price_hops): in the dispatcher's and placement's
        # bytes at the origin's NVLink rate, in the latency model's seconds
        hop_s = 0.0
        if config.pricing.price_hops:
            hop_s = LayeredPricing(spec, timer.hardware, config.pricing).hop_seconds()
        near = NVLINK_PER_DIRECTION.get(spec.hardware, timer.hardware.intra_node_bandwidth)
        self.pool = Pool(
            PoolConfig(
                spec.mp.shape,
                n,
                num_slots,
                seg,
                namespace="sim",
                num_tier_blocks=tier.num_blocks(spec, seg, config.host_tier),
            ),  # fmt: skip
            load_model=LoadModel(timer.hardware, spec.mp),
            eviction=EvictionConfig(config.eviction) if config.eviction else None,
            balancer=BalancerConfig(hop_bytes=hop_s * near * spec.tp) if hop_s else None,
        )
        cfg = SchedulerConfig(
            n,
            seg,
            mode=config.mode,
            chunk_len=config.chunk_len,
            max_prefill_tokens=config.max_prefill_tokens,
            num_prefill_instances=config.num_prefill,
            tbt_slo=config.tbt_slo,
            input_token_slo=config.input_token_slo,
            sync_iterations=config.sync_iterations,
            output_reserve=config.output_reserve,
            decode_steps=config.decode_steps,
            compute_lanes=config.compute_lanes,
        )
        dops = tuple(d for d in (1, 2, 4, 8, 16) if d <= cfg.max_prefill_dop)
        model = config.latency or timer.cost.fit(dops=dops)
        if hop_s:
            model = model.with_hop(hop_s)
        self.sched = ElasticScheduler(cfg, model, self.pool, clock=lambda: loop.now)
        self.timing = TokenLakeTiming(timer, spec, seg, config.page_groups, config.pricing, host)
        self.load_offset = load_offset
        self.token_overhead_s = config.token_overhead_s
        self.iteration_overhead_s = config.iteration_overhead_s
        self.pricing, self.cpu_clock = config.pricing, cpu_clock
        self.host_tier, self.segment_len = config.host_tier, seg
        self.meter = ControlPlaneMeter(config.control_plane_cost, control_samples)
        self.control_free_at = 0.0  # when the control plane's last charged call ends
        # overlap scheduling: the dispatch of the iteration that just ended, from which the
        # calls its end makes may run (None: they start now)
        self._overlap_from: float | None = None
        self.control_cpu_s = 0.0  # measured CPU seconds of its calls (unscaled)
        self.control_charged_s = 0.0  # simulated seconds charged for them (scaled)
        self.jobs: dict[int, Job] = {}
        self.num_pool_full = 0
        self.num_iterations = 0
        self._kicked = False

    def stats(self) -> dict:
        stats = self.pool.get_stats()
        return {
            "pool_hit_rate": round(stats["hit_rate"], 4),
            "preemptions": self.sched.num_preemptions,
            "iterations": self.num_iterations,
            "pool_full_stalls": self.num_pool_full,
            "eviction": self.pool.tree.policy.config.policy,
            # charged, not measured: 0 when not charged, so such runs print the same lines
            "control_plane_s": round(self.control_charged_s, 3),
            **(
                {k: stats[k] for k in ("tier_hit_tokens", "tier_promotions", "tier_demotions")}
                if self.host_tier.gb_per_node
                else {}
            ),
        }

    # ---- arrivals ------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        prompt = prompt_tokens(job.req, job.block_size)[: job.input_len]
        try:
            self.sched.add_request(job.rid, prompt, job.req.output_len)
        except InvalidArgumentError:  # more than the whole pool can hold
            if self.on_rejected_cb is not None:
                self.on_rejected_cb(job, self.loop.now, "too_large")
            return
        self.jobs[job.rid] = job
        self._kick()

    # ---- iterations ----------------------------------------------------------------------
    def _kick(self) -> None:
        if not self._kicked:  # one launch per instant, after every event of it
            self._kicked = True
            self.loop.at(self.loop.now, self._launch)

    def _launch(self) -> None:
        self._kicked = False
        now = self.loop.now
        while True:
            num_requests, t0 = len(self.jobs), self.cpu_clock()
            try:
                it = self.sched.step()
            except PoolFullError:  # not expected: the scheduler preempts; report it as a stall
                self.num_pool_full += 1
                self._charge(self.meter.price(num_requests, None, False, self.cpu_clock() - t0))
                return
            self._charge(self.meter.price(num_requests, it, False, self.cpu_clock() - t0))
            if it is None:
                self._overlap_from = None
                return
            self.num_iterations += 1
            for chunk in it.decision.chunks:
                job = self.jobs[chunk.request_id]
                if "started" not in job.extra:
                    job.extra["started"] = True
                    job.rec.hit_tokens = job.rec.cached_tokens = chunk.start
            has_prefill = any(p != "decode" for p in it.decision.phases)
            delay = max(0.0, self.control_free_at - now) + self.pricing.rpc_s
            if self.host_tier.gb_per_node:  # loads and demotions come first
                delay += tier.move_seconds(it.plans, self.spec, self.segment_len, self.host_tier)
            streamed = sum(
                c.num_new_tokens if not has_prefill else c.end == len(c.token_ids)
                for c in it.decision.chunks
            )
            flight, moved = self.timing.start(
                it.plans, has_prefill, now, it, delay,
                streamed * self.token_overhead_s + self.iteration_overhead_s,
            )  # fmt: skip
            flight.owner = self
            for i in flight.reads.nonzero()[0]:
                self.load.add(now, self.load_offset + int(i), float(flight.reads[i]))
            for f in [flight, *moved]:
                f.owner._schedule_end(f)

    def _charge(self, cpu_s: float) -> None:
        """The control plane spent ``cpu_s`` (priced or measured) on a call at ``loop.now``:
        it runs one call at a time, so the call ends that much (scaled) after the previous
        one or now."""
        self.control_cpu_s += cpu_s
        now = self.loop.now
        ref = now if self._overlap_from is None else min(now, self._overlap_from)
        start = max(self.control_free_at, ref)
        charged = cpu_s * self.pricing.control_plane_scale
        self.control_charged_s += charged
        self.control_free_at = start + charged

    def _schedule_end(self, flight: Flight) -> None:
        version = flight.version
        self.loop.at(flight.end, lambda: self._end(flight, version))

    def _end(self, flight: Flight, version: int) -> None:
        if version != flight.version:  # its end moved; a newer event completes it
            return
        for f in self.timing.finish(flight):
            f.owner._schedule_end(f)
        now, it = self.loop.now, flight.payload
        if self.pricing.overlap_scheduling:  # its successor was planned while it ran
            dispatched = flight.start + flight.delay
            prev = self._overlap_from
            self._overlap_from = dispatched if prev is None else min(prev, dispatched)
        decode = it.decision.phases[0] == "decode" and len(it.decision.phases) == 1
        steps = max(c.num_new_tokens for c in it.decision.chunks) if decode else 1
        num_requests, t0 = len(self.jobs), self.cpu_clock()
        finished = self.sched.complete(it)
        self._charge(self.meter.price(num_requests, it, True, self.cpu_clock() - t0))
        for chunk in it.decision.chunks:
            if chunk.end == len(chunk.token_ids):  # a prompt's last chunk or decode steps
                job = self.jobs[chunk.request_id]
                num = chunk.num_new_tokens if decode else 1
                for i in range(num):  # multi-step decode: a token at the end of each step
                    job.generated += 1
                    job.rec.emit(flight.start + (now - flight.start) * (i + 1) / steps)
        for req in finished:
            self.on_finished_cb(self.jobs.pop(req.request_id), now)
        self._kick()
