"""Run one workload through one simulated system and account for every request.

Open-loop requests arrive at their ``arrival_s``; a later turn of a session arrives
``delay_s`` after its previous turn finishes. The run stops when every request has finished
or was rejected, when nothing is left to happen (the system stalled), at ``horizon_s`` of
simulated time, or after ``wall_budget_s`` of real time. Every request ends in exactly one of:
finished, rejected (the system refused it, e.g. it cannot fit; later turns of its session are
never sent and count as rejected too) or stalled (submitted or due but never finished).
Rejected and stalled requests miss the SLO. With ``stop_below`` a run also stops ("slo_missed")
once so many requests have certainly missed the SLO that the attainment cannot reach it: the
bisection's verdict is the same as after the whole run, at a fraction of its cost (an
overloaded run is the slowest); its unfinished requests are then counted as cut, not stalled.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

from tokenlake.benchmarks.progress import Progress
from tokenlake.benchmarks.sim.context import SimContext
from tokenlake.benchmarks.sim.control_plane_cost import (
    MODEL,
    ControlPlaneCost,
    load_control_plane_cost,
)
from tokenlake.benchmarks.sim.engine import FCFS, EngineConfig
from tokenlake.benchmarks.sim.events import EventLoop
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.metrics import (
    LoadTimeline,
    RequestRecord,
    certain_misses,
    hit_rate,
    slo_attainment,
)
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, CostModelTimer
from tokenlake.benchmarks.sim.systems.layered import PricingConfig
from tokenlake.benchmarks.sim.systems.mooncake import ConductorConfig, MooncakeSystem
from tokenlake.benchmarks.sim.systems.mooncake_store import MooncakeStoreConfig
from tokenlake.benchmarks.sim.systems.radix_cache import LRU
from tokenlake.benchmarks.sim.systems.router import RouterConfig, RouterSystem
from tokenlake.benchmarks.sim.systems.systems import (  # noqa: F401 (re-exported)
    EXTRA_SYSTEMS,
    SYSTEMS,
    VARIANT_SYSTEMS,
    num_prefill,
    split_system,
)
from tokenlake.benchmarks.sim.systems.tokenlake_system import TokenLakeConfig, TokenLakeSystem
from tokenlake.benchmarks.sim.systems.tokenlake_tier import HostTierConfig
from tokenlake.benchmarks.workloads.request import SimRequest, Workload

SLO_MISSED = "slo_missed"
WALL_BUDGET = "wall_budget"


@dataclass(frozen=True)
class RunConfig:
    """Args: system (one of :data:`SYSTEMS` or a variant; a split in its name keeps its ratio
    at any N);
    prefill_tokens (the prefill knob: the baselines' chunked prefill size and TokenLake's
    chunk length and prefill tokens per iteration); mixed_chunk (the router's instances mix
    running decodes into prefill batches, SGLang's ``--enable-mixed-chunk``); segment_len
    (TokenLake's pool segment length); horizon_s (simulated seconds after the last open-loop
    arrival; None: 2x the arrival span + 600 s); wall_budget_s; window_s (load timeline
    windows); slo_scale (the SLO multiple, 10); seed (the router's tree order); decode_steps
    (TokenLake's decode steps per pool iteration at most, bounded by the TBT SLO: fewer
    control-plane calls per token, see ``SchedulerConfig.decode_steps``); stop_below (stop
    once the SLO attainment cannot reach this any more; 0: run to the end); page_groups
    (TokenLake's shared-page groups in the decode timing; off also by the ``-no-groups``
    variant); balance (the router's imbalance thresholds ``(abs, rel)``; None: sgl-router's
    launcher defaults); pricing (TokenLake's distributed attention, control plane CPU time
    and RPC: :class:`PricingConfig`); mooncake_store (the Mooncake rows' DRAM store:
    :class:`MooncakeStoreConfig`; GB 0 or the ``-no-store`` variant: none; the
    ``tokenlake-tier`` variant's host tier is sized and priced as it);
    control_plane_cost (the cost model TokenLake's control plane is charged by when
    ``pricing.control_plane`` is ``model``; None: the checked-in host profile,
    :data:`~.control_plane_cost.DEFAULT_PATH`); split (Mooncake's prefill and decode
    instances, P + D the cluster; None: the system name's split, ``mooncake``'s half);
    schedule_policy / radix_eviction (the baselines' SGLang ``--schedule-policy`` and
    ``--radix-eviction-policy``, see :mod:`.engine`)."""

    system: str
    prefill_tokens: int = 8192
    mixed_chunk: bool = True
    segment_len: int = 512
    horizon_s: float | None = None
    wall_budget_s: float = 600.0
    window_s: float = 1.0
    slo_scale: float = 10.0
    seed: int = 0
    decode_steps: int = 8
    stop_below: float = 0.0
    eviction: str | None = None  # TokenLake's eviction policy; None: the pool's default
    page_groups: bool = True
    balance: tuple[int, float] | None = None
    pricing: PricingConfig = PricingConfig()
    mooncake_store: MooncakeStoreConfig = MooncakeStoreConfig()
    control_plane_cost: ControlPlaneCost | None = None
    split: tuple[int, int] | None = None
    schedule_policy: str = FCFS
    radix_eviction: str = LRU

    def __post_init__(self) -> None:
        split_system(self.system)  # raises naming the allowed systems
        if self.prefill_tokens < 1 or self.segment_len < 1:
            raise ValueError("RunConfig: prefill_tokens, segment_len >= 1")


@dataclass
class RunResult:
    system: str
    records: list[RequestRecord]
    load: LoadTimeline
    sim_s: float
    wall_s: float
    # "done", "stalled" (nothing left to happen), "horizon", "wall_budget", "slo_missed"
    stop_reason: str
    extra: dict = field(default_factory=dict)

    @property
    def num_finished(self) -> int:
        return sum(r.finished for r in self.records)

    @property
    def num_rejected(self) -> int:
        return sum(bool(r.rejected) for r in self.records)

    @property
    def num_stalled(self) -> int:
        if self.stop_reason == SLO_MISSED:
            return 0
        return len(self.records) - self.num_finished - self.num_rejected

    @property
    def num_cut(self) -> int:
        """Requests left unfinished when the run stopped early on a certain SLO miss."""
        if self.stop_reason != SLO_MISSED:
            return 0
        return len(self.records) - self.num_finished - self.num_rejected

    @property
    def truncated(self) -> bool:
        return self.stop_reason in ("horizon", WALL_BUDGET)

    def summary(self, slo_scale: float = 10.0) -> dict:
        return {
            "system": self.system,
            "total": len(self.records),
            "finished": self.num_finished,
            "rejected": self.num_rejected,
            "stalled": self.num_stalled,
            "slo_attainment": round(slo_attainment(self.records, slo_scale), 4),
            "hit_rate": round(hit_rate(self.records), 4),
            "load_cv": round(self.load.cv(), 4),
            "sim_s": round(self.sim_s, 2),
            "wall_s": round(self.wall_s, 2),
            "stop": self.stop_reason,
            **({"cut": self.num_cut} if self.stop_reason == SLO_MISSED else {}),
            **self.extra,
        }


def build_system(cfg: RunConfig, ctx: SimContext, slos, control_samples: list | None = None):
    base, variants = split_system(cfg.system)
    spec = ctx.spec
    n = spec.num_instances
    p = num_prefill(base, n, cfg.split) if n > 1 else 0
    tbt_slo = slos[0] if "tbt" in variants else math.inf
    engine = EngineConfig(
        cfg.prefill_tokens,
        mixed_chunk=cfg.mixed_chunk and base == "router",
        tbt_slo_s=tbt_slo,
        cascade="cascade" in variants,
        schedule_policy=cfg.schedule_policy,
        radix_eviction=cfg.radix_eviction,
    )
    if base.startswith("tokenlake"):
        tbt, per_token = slos
        cost = None
        if cfg.pricing.control_plane == MODEL:
            cost = cfg.control_plane_cost or load_control_plane_cost()
        tl = TokenLakeConfig(
            mode="xpyd" if p else "elastic",
            num_prefill=p,
            segment_len=cfg.segment_len,
            chunk_len=max(cfg.segment_len, cfg.prefill_tokens // cfg.segment_len * cfg.segment_len),
            max_prefill_tokens=cfg.prefill_tokens,
            tbt_slo=tbt,
            input_token_slo=per_token,
            sync_iterations=base == "tokenlake-sync",
            decode_steps=cfg.decode_steps,
            eviction=cfg.eviction,
            page_groups=cfg.page_groups and "no-groups" not in variants,
            pricing=cfg.pricing,
            control_plane_cost=cost,
            host_tier=HostTierConfig.like(cfg.mooncake_store) if "tier" in variants
            else HostTierConfig(),
        )  # fmt: skip
        return TokenLakeSystem(ctx, tl, control_samples=control_samples)
    if base == "router":
        rule = "min_load" if "min-load" in variants else "smallest_tree"
        router = RouterConfig(miss_rule=rule, seed=cfg.seed)
        if cfg.balance is not None:
            router = replace(
                router, balance_abs_threshold=cfg.balance[0], balance_rel_threshold=cfg.balance[1]
            )
        return RouterSystem(ctx, engine, router)
    if n < 2:
        raise ValueError(f"{cfg.system}: xPyD needs at least 2 instances, got {n}")
    conductor = ConductorConfig(slo_scale=cfg.slo_scale)
    store = cfg.mooncake_store
    if "no-store" in variants:
        store = replace(store, gb_per_node=0.0)
    return MooncakeSystem(ctx, p, engine, conductor, store)


def make_record(req: SimRequest, arrival_s: float, timer: CostModelTimer) -> RequestRecord:
    a = timer.decode_time([0])
    b = (timer.decode_time([100_000]) - a) / 100_000
    solo = timer.prefill_time([req.input_len], [0])
    return RequestRecord(req.rid, arrival_s, req.input_len, req.output_len, solo, (a, b))


def simulate(
    workload: Workload,
    spec: ClusterSpec,
    timer: CostModelTimer,
    cfg: RunConfig,
    control_samples: list | None = None,
) -> RunResult:
    """Run ``workload`` through ``cfg.system``; ``control_samples``: TokenLake's control-plane
    calls are appended there (calibration, :mod:`.calibrate_control_plane`)."""
    loop = EventLoop()
    load = LoadTimeline(spec.num_instances, cfg.window_s)
    records: dict[int, RequestRecord] = {}
    followers: dict[int, list[SimRequest]] = defaultdict(list)
    for r in workload.requests:
        if r.after >= 0:
            followers[r.after].append(r)
    pending = {"n": len(workload.requests)}  # neither finished nor rejected

    def on_finished(job: Job, t: float) -> None:
        pending["n"] -= 1
        for nxt in followers.get(job.rid, ()):
            loop.at(t + nxt.delay_s, lambda nxt=nxt: submit(nxt))

    def on_rejected(job: Job, t: float, reason: str) -> None:
        stack = [(job.req, reason)]
        while stack:  # the rejected turn, then every later turn of its session
            req, why = stack.pop()
            rec = records.get(req.rid) or records.setdefault(
                req.rid, make_record(req, math.nan, timer)
            )
            rec.rejected = why
            pending["n"] -= 1
            stack.extend((nxt, "session") for nxt in followers.get(req.rid, ()))

    # The SLO budgets TokenLake's scheduler plans against: 10x the batch-size-1 decode step of
    # the shortest context (the strictest time between tokens any request has), and 10x the
    # batch-size-1 prefill time per token of a chunk.
    shortest = min(r.input_len for r in workload.requests)
    chunk = cfg.prefill_tokens
    slos = (
        cfg.slo_scale * timer.decode_time([shortest]),
        cfg.slo_scale * timer.prefill_time([chunk], [0]) / chunk,
    )
    ctx = SimContext(loop, timer, spec, load, on_finished, on_rejected)
    system = build_system(cfg, ctx, slos, control_samples)

    def submit(req: SimRequest) -> None:
        rec = records[req.rid] = make_record(req, loop.now, timer)
        system.submit(Job(req, rec, workload.block_size))

    opens = [r for r in workload.requests if r.after < 0]
    for r in opens:
        loop.at(r.arrival_s, lambda r=r: submit(r))
    last = max(r.arrival_s for r in opens)
    horizon = cfg.horizon_s if cfg.horizon_s is not None else 2 * last + 600.0
    start = time.perf_counter()
    end = last + horizon
    step = max(1.0, horizon / 200)
    t, stop = 0.0, "done"
    total = len(workload.requests)
    progress = Progress(total, f"{cfg.system} (seed {cfg.seed}) requests done")
    while pending["n"] > 0:
        progress.update(total - pending["n"], f"simulated {t:.0f} s")
        if loop.empty:
            stop = "stalled"
            break
        if t >= end:
            stop = "horizon"
            break
        if time.perf_counter() - start > cfg.wall_budget_s:
            stop = WALL_BUDGET
            break
        t = min(t + step, end)
        loop.run(until=t)
        if cfg.stop_below > 0:
            done = list(records.values())
            if total - certain_misses(done, loop.now, cfg.slo_scale) < cfg.stop_below * total:
                stop = SLO_MISSED
                break
    progress.update(total - pending["n"])
    progress.close(stop)
    for r in workload.requests:  # turns never sent (their session stalled) still count
        if r.rid not in records:
            records[r.rid] = make_record(r, math.nan, timer)
    return RunResult(
        cfg.system,
        [records[r.rid] for r in workload.requests],
        load,
        loop.now,
        time.perf_counter() - start,
        stop,
        system.stats(),
    )
