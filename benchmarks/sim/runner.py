"""Run one workload through one simulated system and collect per-request records.

Open-loop requests arrive at their ``arrival_s``; a later turn of a session arrives
``delay_s`` after its previous turn finishes. The run stops when every request has finished,
at ``horizon_s`` of simulated time, or after ``wall_budget_s`` of real time; requests that have
not finished then miss the SLO.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

from benchmarks.sim.events import EventLoop
from benchmarks.sim.job import Job
from benchmarks.sim.metrics import LoadTimeline, RequestRecord, hit_rate, slo_attainment
from benchmarks.sim.mooncake import MooncakeSystem
from benchmarks.sim.router import RouterSystem
from benchmarks.sim.step_timer import ClusterSpec, CostModelTimer
from benchmarks.sim.tokenlake_system import TokenLakeSystem
from benchmarks.workloads.request import SimRequest, Workload

SYSTEMS = (
    "tokenlake",
    "tokenlake-1p3d",
    "tokenlake-3p1d",
    "router",
    "mooncake-1p3d",
    "mooncake-3p1d",
)


@dataclass(frozen=True)
class RunConfig:
    """Args: system (one of :data:`SYSTEMS`; xPyD keeps the 1:3 / 3:1 ratio at any N);
    chunk_len (chunked prefill size, the same for every system); horizon_s (simulated seconds
    after the last open-loop arrival; None: 2x the arrival span + 600 s); wall_budget_s;
    window_s (load timeline windows); slo_scale (the SLO multiple, 10)."""

    system: str
    chunk_len: int = 8192
    horizon_s: float | None = None
    wall_budget_s: float = 600.0
    max_prefill_tokens: int = 0  # TokenLake: prefill tokens per iteration (0: chunk_len x N)
    window_s: float = 1.0
    slo_scale: float = 10.0

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"RunConfig.system: expected one of {SYSTEMS}, got {self.system!r}")


@dataclass
class RunResult:
    system: str
    records: list[RequestRecord]
    load: LoadTimeline
    sim_s: float
    wall_s: float
    truncated: bool
    extra: dict = field(default_factory=dict)

    def summary(self, slo_scale: float = 10.0) -> dict:
        done = [r for r in self.records if r.finished]
        return {
            "system": self.system,
            "requests": len(self.records),
            "finished": len(done),
            "slo_attainment": round(slo_attainment(self.records, slo_scale), 4),
            "hit_rate": round(hit_rate(self.records), 4),
            "load_cv": round(self.load.cv(), 4),
            "sim_s": round(self.sim_s, 2),
            "wall_s": round(self.wall_s, 2),
            "truncated": self.truncated,
            **self.extra,
        }


def _num_prefill(system: str, n: int) -> int:
    if system.endswith("1p3d"):
        return max(1, n // 4)
    if system.endswith("3p1d"):
        return min(n - 1, 3 * n // 4)
    return 0


def build_system(cfg: RunConfig, loop, timer, spec, on_finished, load, slos=(float("inf"),) * 2):
    n, p = spec.num_instances, _num_prefill(cfg.system, spec.num_instances)
    if cfg.system.startswith("tokenlake"):
        mode = "xpyd" if p else "elastic"
        tbt, per_token = slos
        return TokenLakeSystem(
            loop,
            timer,
            spec,
            on_finished,
            load,
            mode,
            p,
            cfg.chunk_len,
            tbt_slo=tbt,
            input_token_slo=per_token,
            max_prefill_tokens=cfg.max_prefill_tokens,
        )
    if cfg.system == "router":
        from benchmarks.sim.engine import EngineConfig

        return RouterSystem(loop, timer, spec, on_finished, load, EngineConfig(cfg.chunk_len))
    assert n > 1, "xPyD needs at least 2 instances"
    return MooncakeSystem(loop, timer, spec, on_finished, load, p, cfg.chunk_len)


def make_record(req: SimRequest, arrival_s: float, timer: CostModelTimer) -> RequestRecord:
    a = timer.decode_time([0])
    b = (timer.decode_time([100_000]) - a) / 100_000
    solo = timer.prefill_time([req.input_len], [0])
    return RequestRecord(req.rid, arrival_s, req.input_len, req.output_len, solo, (a, b))


def simulate(
    workload: Workload, spec: ClusterSpec, timer: CostModelTimer, cfg: RunConfig
) -> RunResult:
    loop = EventLoop()
    load = LoadTimeline(spec.num_instances, cfg.window_s)
    records: dict[int, RequestRecord] = {}
    followers: dict[int, list[SimRequest]] = defaultdict(list)
    for r in workload.requests:
        if r.after >= 0:
            followers[r.after].append(r)
    pending = {"n": len(workload.requests)}

    def on_finished(job: Job, t: float) -> None:
        pending["n"] -= 1
        for nxt in followers.get(job.rid, ()):
            loop.at(t + nxt.delay_s, lambda nxt=nxt: submit(nxt))

    # The SLO budgets the scheduler plans against: 10x a batch-size-1 decode step at a typical
    # context, and 10x the batch-size-1 prefill time per token of a chunk.
    typical = sorted(r.input_len for r in workload.requests)[len(workload.requests) // 2]
    slos = (
        cfg.slo_scale * timer.decode_time([typical]),
        cfg.slo_scale * timer.prefill_time([cfg.chunk_len], [0]) / cfg.chunk_len,
    )
    system = build_system(cfg, loop, timer, spec, on_finished, load, slos)

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
    t = 0.0
    while pending["n"] > 0 and not loop.empty and t < end:
        t = min(t + step, end)
        loop.run(until=t)
        if time.perf_counter() - start > cfg.wall_budget_s:
            break
    truncated = pending["n"] > 0 and not loop.empty  # stopped at the horizon or wall budget
    for r in workload.requests:  # turns never submitted (their session stalled) still count
        if r.rid not in records:
            records[r.rid] = make_record(r, float("nan"), timer)
    extra = {}
    if isinstance(system, TokenLakeSystem):
        stats = system.pool.get_stats()
        extra = {
            "pool_hit_rate": round(stats["hit_rate"], 4),
            "pool_full_stalls": system.num_pool_full,
        }
    elif isinstance(system, RouterSystem | MooncakeSystem):
        engines = (
            system.engines if isinstance(system, RouterSystem) else system.prefill + system.decode
        )
        extra = {
            "evicted_tokens": sum(e.cache.num_evicted_tokens for e in engines),
            "rejected": sum(e.num_rejected for e in engines),
        }
    return RunResult(
        cfg.system,
        [records[r.rid] for r in workload.requests],
        load,
        loop.now,
        time.perf_counter() - start,
        truncated,
        extra,
    )
