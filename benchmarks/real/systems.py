"""The two systems of the real mini-cluster (:mod:`tokenlake.benchmarks.real.cluster`) and their
workload: TokenLake (one pool over N instances, the elastic scheduler) and a cache-aware router
in front of N instances built from the same compute engine, each with a private cache (a
1-instance pool and its own scheduler). Both are made of :class:`InstanceGroup` lanes; the
replay's event loop (:mod:`tokenlake.benchmarks.real.replay`) drives them in virtual time.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

import tokenlake as tl
from tokenlake.benchmarks.sim.systems.router import CacheAwareRouter
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.engines.model.engine import ModelEngine
from tokenlake.engines.model.llama import LlamaModel
from tokenlake.errors import PoolFullError
from tokenlake.scheduler import (
    COLOCATED,
    ELASTIC,
    Coeffs,
    ElasticScheduler,
    LatencyModel,
    SchedulerConfig,
)
from tokenlake.scheduler.planned import IterationPlan

# the router's lanes alternate prefill and decode batches (SGLang's default) or mix decodes into
# chunked prefill batches (``--enable-mixed-chunk``); its best is its goodput
SYSTEMS = ("tokenlake", "router", "router-mixed")
ROUTERS = {"router": ELASTIC, "router-mixed": COLOCATED}
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
    by instance count; both systems' schedulers get the same settings: ``defer_pending_prefix``
    (a new request waits for a prefix another request's prefill is computing) and
    ``admission_backfill`` (a request that does not fit in memory yet is passed over until its
    first-token deadline)."""

    slo: dict
    latency: dict
    defer_pending_prefix: bool = True
    admission_backfill: bool = True


@dataclass(frozen=True)
class Timing:
    """How iterations are timed and run: ``dop_speedup`` counts a DoP-k batch k times faster
    than measured; ``parallel_holders``: the prefix queries a batch sends to other instances
    run there, in parallel (each holder's share is charged to that holder, which it delays),
    otherwise the whole forward is charged to the batch's instances (with no DoP speedup
    either: the pessimistic bound); ``sync_iterations`` runs one iteration at a time over a
    pool's instances (otherwise each batch is an iteration of its own on its own instances,
    docs/architecture.md#the-floors)."""

    dop_speedup: bool = True
    parallel_holders: bool = True
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
    """Documents shared by many requests (Zipf popularity), each request a document plus a
    fresh question, Poisson arrivals at ``rate`` per second."""
    rng = np.random.default_rng(cfg.seed)
    docs = [rng.integers(0, vocab, cfg.doc_len).astype(np.int32) for _ in range(cfg.num_docs)]
    weights = 1.0 / np.arange(1, cfg.num_docs + 1) ** cfg.zipf
    picks = rng.choice(cfg.num_docs, cfg.num_requests, p=weights / weights.sum())
    gaps = rng.exponential(1.0 / rate, cfg.num_requests)
    out = []
    for i, (d, t) in enumerate(zip(picks, np.cumsum(gaps) - gaps[0], strict=True)):
        question = rng.integers(0, vocab, cfg.question_len).astype(np.int32)
        tokens = np.concatenate([docs[d], question])
        out.append(RealRequest(f"q{i}", float(t), int(d), cfg.doc_len, tokens, cfg.output_len))
    return out


class Started(NamedTuple):
    """An iteration started on a lane: ``duration`` seconds of its own instances' time (its
    scheduler step, then its slowest batch), ``instances`` the lane's instance ids it runs
    on, ``remote`` the seconds of prefix queries it puts on each other instance."""

    iteration: IterationPlan
    tokens: dict
    duration: float
    instances: tuple[int, ...]
    remote: dict[int, float]


class InstanceGroup:
    """Instances sharing one pool, scheduler and compute engine; the scheduler's clock is the
    replay's virtual time."""

    def __init__(
        self,
        model: LlamaModel,
        cfg: RealClusterConfig,
        num_instances: int,
        env: Env | None = None,
        timing: Timing = Timing(),
        mode: str = ELASTIC,
    ) -> None:
        config = tl.PoolConfig(model.shape, num_instances, cfg.num_slots, cfg.segment_len)
        self.pool = tl.Pool(config)
        self.cluster = LocalCluster(self.pool)
        self.engine = ModelEngine(model, self.cluster)
        # the scheduler knows the SLO and this machine's latencies (profiled), as in serving
        env = env or Env(slo={}, latency={num_instances: LATENCY})
        sched_cfg = SchedulerConfig(
            num_instances, cfg.segment_len, mode=mode, chunk_len=cfg.chunk_len,
            sync_iterations=timing.sync_iterations,
            defer_pending_prefix=env.defer_pending_prefix,
            admission_backfill=env.admission_backfill, **env.slo,
        )  # fmt: skip
        self.now = 0.0
        clock = lambda: self.now  # noqa: E731
        self.scheduler = ElasticScheduler(
            sched_cfg, env.latency[num_instances], self.pool, clock=clock
        )
        self.hits: dict[str, int] = {}
        self._load = np.zeros(num_instances)
        self.timing = timing
        self.spent = {"control_s": 0.0, "compute_s": 0.0, "iterations": 0}

    def _query_seconds(self) -> np.ndarray:
        stats = self.cluster.engine_stats()
        n = self.pool.config.num_instances
        return np.array([stats[("query", i)].get("query_thread_ns", 0) for i in range(n)]) * 1e-9

    def launch(self, now: float) -> list[Started]:
        """Start every iteration the scheduler hands out at ``now``; each one's forward runs
        here, batch by batch. A batch on ``k`` instances costs, with ``parallel_holders``,
        its work outside prefix queries and its own instances' queries divided by ``k`` (or
        not, without ``dop_speedup``) plus the slowest other holder's queries (they run in
        parallel), and each other holder is charged its share; otherwise the whole forward.
        A synchronous iteration's batches run at once: it lasts as long as the slowest."""
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
            logits, compute, remote = {}, 0.0, {}
            for part, own in self._batches(it.plans):
                q0, t0 = self._query_seconds(), time.process_time()
                logits.update(self.engine.run(part, chunks))
                spent, queries = time.process_time() - t0, self._query_seconds() - q0
                compute = max(compute, self._charge(spent, queries, own, remote))
            tokens = {rid: int(row.argmax()) for rid, row in logits.items()}
            out.append(Started(it, tokens, control + compute, it.plans.origins, remote))
            self.spent["control_s"] += control
            self.spent["compute_s"] += compute
            self.spent["iterations"] += 1

    @staticmethod
    def _batches(plans):
        """Each batch of ``plans`` as plans of its own, with the instances it runs on."""
        for b in sorted({qp.batch_index for qp in plans.query_plans}):
            subs = [k for k, qp in enumerate(plans.query_plans) if qp.batch_index == b]
            part = dataclasses.replace(
                plans,
                query_plans=tuple(plans.query_plans[k] for k in subs),
                transfer_plans=tuple(plans.transfer_plans[k] for k in subs),
            )
            yield part, sorted({plans.query_plans[k].origin for k in subs})

    def _charge(self, spent: float, queries: np.ndarray, own: list[int], remote: dict) -> float:
        """Seconds a batch takes on its ``own`` instances; adds other holders' shares to
        ``remote``."""
        if not self.timing.parallel_holders:
            return spent / len(own) if self.timing.dop_speedup else spent
        k = len(own) if self.timing.dop_speedup else 1
        others = [j for j in range(len(queries)) if j not in own]
        for j in others:
            if queries[j] > 0:
                remote[j] = remote.get(j, 0.0) + float(queries[j])
        local = spent - float(queries[others].sum())
        slowest_other = float(queries[others].max()) if others else 0.0
        own_queries = float(queries[own].sum())
        return (local - own_queries) / k + max(own_queries / k, slowest_other)

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
    """One lane: the pool's N instances, one elastic scheduler."""

    def __init__(self, model: LlamaModel, cfg: RealClusterConfig, env: Env, timing: Timing):
        self.lanes = [InstanceGroup(model, cfg, cfg.num_instances, env, timing)]
        self.first_instance = [0]

    def add(self, r: RealRequest) -> int:
        self.lanes[0].scheduler.add_request(r.rid, r.tokens, r.output_len)
        return 0

    def finished(self, lane: int, rids: set) -> None:
        pass

    def hit_tokens(self, rid: str) -> int:
        return self.lanes[0].hits.get(rid, 0)


class RouterSystem:
    """N single-instance lanes (private caches) behind sgl-router's cache-aware rule; each
    lane's scheduler in ``mode`` (elastic on one instance: alternating prefill and decode
    batches; colocated: decodes mixed into chunked prefill batches)."""

    def __init__(
        self,
        model: LlamaModel,
        cfg: RealClusterConfig,
        env: Env,
        timing: Timing,
        mode: str = ELASTIC,
    ) -> None:
        self.lanes = [
            InstanceGroup(model, cfg, 1, env, timing, mode) for _ in range(cfg.num_instances)
        ]
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
