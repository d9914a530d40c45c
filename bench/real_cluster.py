"""The goodput harness on the real CPU mini-cluster: TokenLake (one pool of N instances, the
elastic scheduler) vs a cache-aware router in front of N instances built from the same compute
engine, each with a private cache (a 1-instance pool and its own scheduler), serving the same
model (``tiny-random``) on the same requests; same SLO rule, goodput bisection and load CV as
the simulator (:mod:`tokenlake.bench.sim.metrics`), same routing rule as its router baseline
(:class:`tokenlake.bench.sim.router.CacheAwareRouter`).

    python -m tokenlake.bench.real_cluster [--quick]        # or: python -m tokenlake.bench.goodput --real

Workload: documents shared by many requests (Zipf popularity), each request a document plus a
fresh question, Poisson arrivals. Every instance has the same slots, so the router's private
caches hold duplicates of popular documents while TokenLake's pool holds each once.

Time (the modelling assumptions, stated): every iteration is a real forward of the real model
on one torch thread and one kernel thread, timed in *process CPU time* (what the work costs,
whatever else shares the machine's cores; the wall clock of a loaded 2-core machine is mostly
waiting). Instances run in virtual parallel time (2 cores cannot host N busy engines at once),
event by event: each lane (one pool and scheduler: TokenLake's N instances, or one router
instance) starts what its scheduler hands out on its free instances, and an iteration ends
its scheduler step's CPU time plus its forward's CPU time later, when it is committed.
TokenLake runs asynchronous iterations (each batch on its own instances, DESIGN §2.3;
``--sync-iterations``: one iteration over all instances at a time, as long as its slowest
batch). A DoP-k batch runs as one forward here; ``--dop-speedup ideal`` (default) counts it k
times faster than measured (ideal sequence parallelism, as the simulator assumes), ``none``
charges it its whole measured time (no speedup: TokenLake's pessimistic bound). Planning of
several batches started at one instant overlaps (generous to TokenLake, whose scheduler plans
for N instances). A lane whose running requests overflow its pool drops its newest request
(it misses the SLO). The rate sweep doubles the rate until the system misses the SLO
(``bisect_goodput``; ``slo_missed_in_sweep`` in the JSON says whether it did), so a goodput is
where the system itself fails, not a cap of the sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import tokenlake as tl
from tokenlake.bench.sim.metrics import (
    LoadTimeline,
    RequestRecord,
    bisect_goodput,
    hit_rate,
    slo_attainment,
)
from tokenlake.bench.sim.router import CacheAwareRouter
from tokenlake.engines.local_cluster import LocalCluster
from tokenlake.engines.model.engine import ModelEngine
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.errors import PoolFullError
from tokenlake.scheduler import Coeffs, ElasticScheduler, LatencyModel, SchedulerConfig
from tokenlake.scheduler.planned import IterationPlan

SYSTEMS = ("tokenlake", "router")
LATENCY = LatencyModel({1: Coeffs(1e-3, 1e-5, 0.0)}, Coeffs(1e-3, 1e-5, 0.0))


@dataclass(frozen=True)
class RealClusterConfig:
    num_instances: int = 4
    segment_len: int = 32
    num_slots: int = 48  # per instance
    chunk_len: int = 256
    num_docs: int = 12
    doc_len: int = 448
    question_len: int = 24
    output_len: int = 8
    zipf: float = 1.2
    num_requests: int = 400
    seed: int = 0


@dataclass(frozen=True)
class Env:
    """What both systems' schedulers are told: the SLO (seconds) and profiled latency models
    by instance count."""

    slo: dict
    latency: dict


@dataclass(frozen=True)
class Timing:
    """How iterations are timed and run: ``dop_speedup`` counts a DoP-k batch k times faster
    than measured; ``sync_iterations`` runs one iteration at a time over a pool's instances
    (otherwise each batch is an iteration of its own on its own instances, DESIGN §2.3)."""

    dop_speedup: bool = True
    sync_iterations: bool = False


@dataclass(frozen=True)
class RealRequest:
    rid: str
    arrival_s: float
    doc: int
    doc_len: int
    tokens: np.ndarray
    output_len: int


def workload(cfg: RealClusterConfig, rate: float, vocab: int) -> list[RealRequest]:
    rng = np.random.default_rng(cfg.seed)
    docs = [rng.integers(0, vocab, cfg.doc_len).astype(np.int32) for _ in range(cfg.num_docs)]
    weights = 1.0 / np.arange(1, cfg.num_docs + 1) ** cfg.zipf
    picks = rng.choice(cfg.num_docs, cfg.num_requests, p=weights / weights.sum())
    gaps = rng.exponential(1.0 / rate, cfg.num_requests)
    out = []
    for i, (d, t) in enumerate(zip(picks, np.cumsum(gaps) - gaps[0], strict=True)):
        question = rng.integers(0, vocab, cfg.question_len).astype(np.int32)
        out.append(
            RealRequest(
                f"q{i}",
                float(t),
                int(d),
                cfg.doc_len,
                np.concatenate([docs[d], question]),
                cfg.output_len,
            )  # fmt: skip
        )
    return out


class _Group:
    """Instances sharing one pool, scheduler and compute engine; the scheduler's clock is the
    replay's virtual time."""

    def __init__(
        self,
        model: LlamaModel,
        cfg: RealClusterConfig,
        num_instances: int,
        env: Env | None = None,
        timing: Timing = Timing(),
    ) -> None:
        config = tl.PoolConfig(model.shape, num_instances, cfg.num_slots, cfg.segment_len)
        self.pool = tl.Pool(config)
        self.engine = ModelEngine(model, LocalCluster(self.pool))
        # the scheduler knows the SLO and this machine's latencies (profiled), as in serving
        slo = {} if env is None else env.slo
        sched_cfg = SchedulerConfig(
            num_instances, cfg.segment_len, chunk_len=cfg.chunk_len,
            sync_iterations=timing.sync_iterations, **slo,
        )  # fmt: skip
        latency = LATENCY if env is None else env.latency[num_instances]
        self.now = 0.0
        self.scheduler = ElasticScheduler(sched_cfg, latency, self.pool, clock=lambda: self.now)
        self.hits: dict[str, int] = {}
        self._load = np.zeros(num_instances)
        self.timing = timing
        self.spent = {"control_s": 0.0, "compute_s": 0.0, "iterations": 0}

    def launch(self, now: float) -> list[tuple[float, IterationPlan, dict]]:
        """Start every iteration the scheduler hands out at ``now``; each one's forward runs
        here, and it ends at ``now`` + its CPU time: its scheduler step, then its slowest batch
        (a synchronous iteration's batches run on disjoint instances at once; a DoP-k batch is
        timed whole and, with ``dop_speedup``, counted k times faster). Returns ``(end,
        iteration, tokens)`` of each."""
        self.now, out = now, []
        while True:
            t0 = time.process_time()
            try:
                it = self.scheduler.step()
            except PoolFullError:  # the running requests alone overflow the pool: drop the newest
                self.scheduler.cancel(self._newest_running())
                continue
            if it is None:
                return out
            control = time.process_time() - t0
            chunks = {c.request_id: c for c in it.decision.chunks}
            for rid, c in chunks.items():
                self.hits.setdefault(rid, c.start)
            plans, logits, compute = it.plans, {}, 0.0
            for b in sorted({qp.batch_index for qp in plans.query_plans}):
                subs = [k for k, qp in enumerate(plans.query_plans) if qp.batch_index == b]
                part = dataclasses.replace(
                    plans,
                    query_plans=tuple(plans.query_plans[k] for k in subs),
                    transfer_plans=tuple(plans.transfer_plans[k] for k in subs),
                )
                t0 = time.process_time()
                logits.update(self.engine.run(part, chunks))
                spent = time.process_time() - t0
                compute = max(compute, spent / len(subs) if self.timing.dop_speedup else spent)
            tokens = {rid: int(row.argmax()) for rid, row in logits.items()}
            out.append((now + control + compute, it, tokens))
            self.spent["control_s"] += control
            self.spent["compute_s"] += compute
            self.spent["iterations"] += 1

    def finish(self, now: float, it: IterationPlan, tokens: dict) -> tuple[set, np.ndarray]:
        """Commit ``it`` at ``now``: the requests that finished and the prefix tokens each
        instance read since the last commit."""
        self.now = now
        finished = {r.request_id for r in self.scheduler.complete(it, tokens)}
        self.engine.retire(it.plans)
        load = np.asarray(self.pool.get_stats()["instance_load"], dtype=float)
        delta, self._load = load - self._load, load
        return finished, delta

    def _newest_running(self) -> str:
        running = [rid for rid in self.hits if rid in self.pool.requests]
        return running[-1]


class TokenLakeSystem:
    """One lane: the pool's N instances run each iteration together."""

    def __init__(
        self, model: LlamaModel, cfg: RealClusterConfig, env: Env, dop_speedup: bool
    ) -> None:
        self.lanes = [_Group(model, cfg, cfg.num_instances, env, dop_speedup)]
        self.first_instance = [0]

    def add(self, r: RealRequest) -> int:
        self.lanes[0].scheduler.add_request(r.rid, r.tokens, r.output_len)
        return 0

    def finished(self, lane: int, rids: set) -> None:
        pass

    def hit_tokens(self, rid: str) -> int:
        return self.lanes[0].hits.get(rid, 0)


class RouterSystem:
    """N single-instance lanes (private caches) behind sgl-router's cache-aware rule."""

    def __init__(
        self, model: LlamaModel, cfg: RealClusterConfig, env: Env, dop_speedup: bool
    ) -> None:
        self.lanes = [_Group(model, cfg, 1, env) for _ in range(cfg.num_instances)]
        self.first_instance = list(range(cfg.num_instances))
        self.router = CacheAwareRouter(cfg.num_instances)
        self.where: dict[str, int] = {}
        self.block = cfg.segment_len

    def add(self, r: RealRequest) -> int:
        n = -(-len(r.tokens) // self.block)
        # blocks wholly inside the shared document repeat across requests; the rest never do
        keys = [(r.doc, b) if (b + 1) * self.block <= r.doc_len else (r.rid, b) for b in range(n)]
        lengths = [min(self.block, len(r.tokens) - b * self.block) for b in range(n)]
        worker = self.router.select(keys, lengths)
        self.where[r.rid] = worker
        self.lanes[worker].scheduler.add_request(r.rid, r.tokens, r.output_len)
        return worker

    def finished(self, lane: int, rids: set) -> None:
        for _ in rids:
            self.router.finished(lane)

    def hit_tokens(self, rid: str) -> int:
        lane = self.where.get(rid)  # None: not sent before the replay hit its time cap
        return 0 if lane is None else self.lanes[lane].hits.get(rid, 0)


@dataclass(frozen=True)
class Solo:
    """Batch-size-1 latencies on an idle instance with an empty cache (the SLO's base)."""

    prefill: tuple[float, float]  # seconds = a + b * input_len
    decode: tuple[float, float]  # seconds per step = a + b * context

    def prefill_s(self, n: int) -> float:
        return self.prefill[0] + self.prefill[1] * n


def measure_solo(model: LlamaModel, cfg: RealClusterConfig, vocab: int) -> Solo:
    rng = np.random.default_rng(cfg.seed + 1)
    pre, dec = [], []
    for n in (cfg.doc_len // 4, cfg.doc_len // 2, cfg.doc_len + cfg.question_len):
        g = _Group(model, cfg, 1)
        g.scheduler.add_request("solo", rng.integers(0, vocab, n).astype(np.int32), 4)
        times, now = [], 0.0
        while g.scheduler.has_work:
            (end, it, tokens), *_ = g.launch(now)  # one request: one iteration at a time
            times.append(end - now)
            g.finish(end, it, tokens)
            now = end
        pre.append((n, sum(times[:-3])))
        dec.append((n, float(np.median(times[-3:]))))
    fit = lambda pts: tuple(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[::-1])  # noqa: E731
    a, b = fit(pre)
    da, db = fit(dec)
    return Solo((max(a, 1e-4), max(b, 0.0)), (max(da, 1e-4), max(db, 0.0)))


def run(
    system_name: str,
    model,
    cfg,
    rate: float,
    solo: Solo,
    env: Env,
    limit_s: float,
    timing: Timing = Timing(),
):
    """Replay the workload at ``rate`` in virtual time, event by event: an arrival is sent to
    its lane (a group of instances sharing a scheduler), which starts what its scheduler
    hands out on free instances; an iteration ends its measured CPU time later, is committed
    then, and its lane starts what comes next. Lanes run in parallel. Returns the records, the
    per-instance load timeline and the CPU seconds spent (scheduler steps, forwards) and
    iterations run over all lanes."""
    kind = TokenLakeSystem if system_name == "tokenlake" else RouterSystem
    system = kind(model, cfg, env, timing)
    reqs = workload(cfg, rate, model.config.vocab_size)
    records = {
        r.rid: RequestRecord(
            i, r.arrival_s, len(r.tokens), r.output_len, solo.prefill_s(len(r.tokens)), solo.decode
        )
        for i, r in enumerate(reqs)
    }
    load = LoadTimeline(cfg.num_instances, window_s=1.0)
    in_flight: list[tuple] = []  # heap of (end, seq, lane, iteration, tokens, start)
    order = itertools.count()

    def start(lane: int, now: float) -> None:
        for end, it, tokens in system.lanes[lane].launch(now):
            heapq.heappush(in_flight, (end, next(order), lane, it, tokens, now))

    nxt, wall0 = 0, time.perf_counter()
    while time.perf_counter() - wall0 < limit_s:
        if nxt < len(reqs) and (not in_flight or reqs[nxt].arrival_s <= in_flight[0][0]):
            r = reqs[nxt]
            nxt += 1
            start(system.add(r), r.arrival_s)
            continue
        if not in_flight:  # nothing arrives or runs any more (a lane that stalls: its misses)
            break
        end, _, lane, it, tokens, begun = heapq.heappop(in_flight)
        finished, delta = system.lanes[lane].finish(end, it, tokens)
        system.finished(lane, finished)
        for rid in tokens:
            records[rid].emit(end)
        for k, x in enumerate(delta):
            load.add(begun, system.first_instance[lane] + k, float(x))
        start(lane, end)
    for r in reqs:
        records[r.rid].hit_tokens = system.hit_tokens(r.rid)
    spent = {k: sum(g.spent[k] for g in system.lanes) for k in system.lanes[0].spent}
    return list(records.values()), load, spent


def evaluate(system_name, model, cfg, solo, env, args) -> dict:
    cache: dict[float, tuple] = {}

    def at(rate: float) -> float:
        timing = Timing(args.dop_speedup == "ideal", args.sync_iterations)
        records, load, spent = run(system_name, model, cfg, rate, solo, env, args.limit_s, timing)
        cache[rate] = (records, load, spent)
        a = slo_attainment(records)
        print(
            f"  {system_name:<10} rate {rate:6.2f} req/s: SLO attainment {a:.0%}", file=sys.stderr
        )
        return a

    result = bisect_goodput(at, args.lo, args.hi, rel_tol=args.rel_tol, max_evals=args.max_evals)
    at(args.common_rate)
    records, load, spent = cache[args.common_rate]
    return {
        "system": system_name,
        "p90_goodput_req_s": round(result.goodput, 3),
        "hit_rate": round(hit_rate(records), 4),
        "load_cv": round(load.cv(), 4),
        "common_rate": args.common_rate,
        "attainment_at_common_rate": round(slo_attainment(records), 3),
        "points": [(round(r, 3), round(a, 3)) for r, a in result.points],
        "slo_missed_in_sweep": any(a < 0.9 for _, a in result.points),
        "control_cpu_s_at_common_rate": round(spent["control_s"], 3),
        "forward_cpu_s_at_common_rate": round(spent["compute_s"], 3),
        "iterations_at_common_rate": spent["iterations"],
        "clock": "process CPU time",
        "dop_speedup": args.dop_speedup,
        "iterations": "sync" if args.sync_iterations else "async",
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="fewer requests and evaluations")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--lo", type=float, default=64.0, help="first rate tried (req/s)")
    p.add_argument("--hi", type=float, default=256.0, help="second rate tried (req/s)")
    p.add_argument("--rel-tol", type=float, default=0.3)
    p.add_argument("--max-evals", type=int, default=6)
    p.add_argument(
        "--common-rate", type=float, default=128.0, help="rate of the hit-rate/CV column"
    )
    p.add_argument("--limit-s", type=float, default=300.0, help="cap on one replay's wall time")
    p.add_argument(
        "--dop-speedup", choices=("ideal", "none"), default="ideal",
        help="a DoP-k batch counts k times faster than measured (ideal) or not at all (none)",
    )  # fmt: skip
    p.add_argument(
        "--sync-iterations", action="store_true",
        help="one iteration at a time over a pool's instances (default: asynchronous batches)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return run_main(p.parse_args(argv))


def run_main(args: argparse.Namespace) -> int:
    import torch

    from tokenlake.engines.model.tiny import write_tiny_random
    from tokenlake.kernels import cpu

    torch.set_num_threads(1)
    cpu.set_num_threads(1)
    cfg = RealClusterConfig(seed=args.seed)
    if args.requests or args.quick:
        cfg = RealClusterConfig(num_requests=args.requests or 48, seed=args.seed)
    if args.quick:
        args.max_evals = 3
    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaModel.from_dir(write_tiny_random(Path(tmp) / "tiny", seed=args.seed))
    vocab = model.config.vocab_size
    solo = measure_solo(model, cfg, vocab)
    print(
        f"real CPU mini-cluster: {cfg.num_instances} instances x {cfg.num_slots} slots x "
        f"{cfg.segment_len} tokens, tiny-random; {cfg.num_requests} requests over {cfg.num_docs} "
        f"shared {cfg.doc_len}-token documents (Zipf {cfg.zipf}) + {cfg.question_len}-token "
        f"questions, {cfg.output_len} output tokens; SLO 10x batch-size-1 (prefill "
        f"{solo.prefill_s(cfg.doc_len + cfg.question_len) * 1e3:.0f} ms, decode "
        f"{(solo.decode[0] + solo.decode[1] * cfg.doc_len) * 1e3:.1f} ms); times in process "
        f"CPU time, DoP speedup {args.dop_speedup}",
        file=sys.stderr,
    )
    from tokenlake.serve.build import profile_latency_model

    env = Env(
        slo={
            "tbt_slo": 10 * (solo.decode[0] + solo.decode[1] * (cfg.doc_len + cfg.question_len)),
            "input_token_slo": 10 * solo.prefill[1] + 10 * solo.prefill[0] / cfg.doc_len,
        },
        latency={
            n: profile_latency_model(model, n, cfg.segment_len, cfg.chunk_len)
            for n in sorted({1, cfg.num_instances})
        },
    )
    rows = [evaluate(name, model, cfg, solo, env, args) for name in SYSTEMS]
    base = rows[1]["p90_goodput_req_s"]
    rows[0]["goodput_ratio_vs_router"] = (
        round(rows[0]["p90_goodput_req_s"] / base, 3) if base > 0 else math.inf
    )
    print(f"{'system':<10} {'P90 goodput':>12} {'hit rate':>9} {'load CV':>8}")
    for r in rows:
        at_least = " " if r["slo_missed_in_sweep"] else ">="  # the sweep's cap, not a failure
        print(
            f"{r['system']:<10} {at_least}{r['p90_goodput_req_s']:>8.2f}/s {r['hit_rate']:>9.1%} "
            f"{r['load_cv']:>8.1%}"
        )
    if not all(r["slo_missed_in_sweep"] for r in rows):
        print("a system met the SLO at every rate tried: its goodput is a lower bound")
    for r in rows:
        print(json.dumps({"bench": "real_cluster", **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
