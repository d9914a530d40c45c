"""The real mini-cluster's event loop: a workload replayed in virtual time through the systems of
:mod:`tokenlake.benchmarks.real.systems`, every iteration a real forward timed in process
CPU time, instances running in virtual parallel time.

Each instance runs one thing at a time: its lane's iterations, and the prefix queries other
instances' batches send to it (the holder's share of their attention). A share that arrives
while the instance runs an iteration delays that iteration's end by as much; one that
arrives while it is idle keeps it busy for as long, so an iteration started on it then
starts later (work-conserving: no CPU time is lost or counted twice).
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass

import numpy as np

from tokenlake.benchmarks.real.systems import (
    ROUTERS,
    Env,
    InstanceGroup,
    RealClusterConfig,
    RouterSystem,
    Timing,
    TokenLakeSystem,
    workload,
)
from tokenlake.benchmarks.sim.metrics import LoadTimeline, RequestRecord
from tokenlake.engines.model.llama import LlamaModel


@dataclass(frozen=True)
class Solo:
    """Batch-size-1 latencies on an idle instance with an empty cache (the SLO's base)."""

    prefill: tuple[float, float]  # seconds = a + b * input_len
    decode: tuple[float, float]  # seconds per step = a + b * context

    def prefill_s(self, n: int) -> float:
        return self.prefill[0] + self.prefill[1] * n

    def decode_s(self, context: int) -> float:
        return self.decode[0] + self.decode[1] * context


def measure_solo(model: LlamaModel, cfg: RealClusterConfig, vocab: int) -> Solo:
    """Fit :class:`Solo` on one instance: three prompt lengths up to a whole request's, each
    alone, then three decode steps."""
    rng = np.random.default_rng(cfg.seed + 1)
    pre, dec = [], []
    for n in (cfg.doc_len // 4, cfg.doc_len // 2, cfg.doc_len + cfg.question_len):
        g = InstanceGroup(model, cfg, 1)
        g.scheduler.add_request("solo", rng.integers(0, vocab, n).astype(np.int32), 4)
        times, now = [], 0.0
        while g.scheduler.has_work:
            started, *_ = g.launch(now)  # one request: one iteration at a time
            times.append(started.duration)
            now += started.duration
            g.finish(now, started.iteration, started.tokens)
        pre.append((n, sum(times[:-3])))
        dec.append((n, float(np.median(times[-3:]))))
    fit = lambda pts: tuple(np.polyfit([p[0] for p in pts], [p[1] for p in pts], 1)[::-1])  # noqa: E731
    a, b = fit(pre)
    da, db = fit(dec)
    return Solo((max(a, 1e-4), max(b, 0.0)), (max(da, 1e-4), max(db, 0.0)))


class _Instances:
    """Each instance's iteration in flight (heap sequence number) and, when idle, until when
    other instances' queries keep it busy; ``delay[seq]``: how much later an iteration in
    flight ends than when it was pushed."""

    def __init__(self, num_instances: int) -> None:
        self.running: list[int | None] = [None] * num_instances
        self.busy_until = [0.0] * num_instances
        self.delay: dict[int, float] = {}

    def start_time(self, instances, now: float) -> float:
        return max([now] + [self.busy_until[i] for i in instances])

    def occupy(self, instances, seq: int) -> None:
        for i in instances:
            self.running[i] = seq

    def release(self, instances, seq: int) -> None:
        for i in instances:
            if self.running[i] == seq:
                self.running[i] = None

    def charge(self, instance: int, seconds: float, now: float) -> None:
        seq = self.running[instance]
        if seq is None:
            self.busy_until[instance] = max(self.busy_until[instance], now) + seconds
        else:
            self.delay[seq] = self.delay.get(seq, 0.0) + seconds


def run(
    system_name: str,
    model: LlamaModel,
    cfg: RealClusterConfig,
    rate: float,
    solo: Solo,
    env: Env,
    limit_s: float,
    timing: Timing | None = None,
):
    """Replay the workload at ``rate`` in virtual time, event by event: an arrival is sent to
    its lane (a group of instances sharing a scheduler), which starts what its scheduler
    hands out on free instances; an iteration ends its measured CPU time later (plus what
    other lanes' queries cost its instances meanwhile), is committed then, and its lane
    starts what comes next. Lanes run in parallel. Returns the records, the per-instance load
    timeline and the CPU seconds spent (scheduler steps, forwards) and iterations run over
    all lanes."""
    timing = timing or Timing()
    if system_name == "tokenlake":
        system = TokenLakeSystem(model, cfg, env, timing)
    else:
        system = RouterSystem(model, cfg, env, timing, ROUTERS[system_name])
    reqs = workload(cfg, rate, model.config.vocab_size)
    records = {
        r.rid: RequestRecord(
            i, r.arrival_s, len(r.tokens), r.output_len, solo.prefill_s(len(r.tokens)), solo.decode
        )
        for i, r in enumerate(reqs)
    }
    load = LoadTimeline(cfg.num_instances, window_s=1.0)
    instances = _Instances(cfg.num_instances)
    in_flight: list[tuple] = []  # heap of (end, seq, lane, started, global instances, begun)
    order = itertools.count()

    def start(lane: int, now: float) -> None:
        first = system.first_instance[lane]
        for s in system.lanes[lane].launch(now):
            seq, own = next(order), [first + i for i in s.instances]
            end = instances.start_time(own, now) + s.duration
            instances.occupy(own, seq)
            for j, seconds in s.remote.items():
                if first + j not in own:  # a synchronous iteration's own: in its duration
                    instances.charge(first + j, seconds, now)
            heapq.heappush(in_flight, (end, seq, lane, s, own, now))

    nxt, wall0 = 0, time.perf_counter()
    while time.perf_counter() - wall0 < limit_s:
        if nxt < len(reqs) and (not in_flight or reqs[nxt].arrival_s <= in_flight[0][0]):
            r = reqs[nxt]
            nxt += 1
            start(system.add(r), r.arrival_s)
            continue
        if not in_flight:  # nothing arrives or runs any more (a lane that stalls: its misses)
            break
        end, seq, lane, s, own, begun = heapq.heappop(in_flight)
        late = instances.delay.pop(seq, 0.0)
        if late > 0:  # other lanes' queries ran on its instances meanwhile
            heapq.heappush(in_flight, (end + late, seq, lane, s, own, begun))
            continue
        instances.release(own, seq)
        finished, delta = system.lanes[lane].finish(end, s.iteration, s.tokens)
        system.finished(lane, finished)
        for rid in s.tokens:
            records[rid].emit(end)
        for k, x in enumerate(delta):
            load.add(begun, system.first_instance[lane] + k, float(x))
        start(lane, end)
    for r in reqs:
        records[r.rid].hit_tokens = system.hit_tokens(r.rid)
    spent = {k: sum(g.spent[k] for g in system.lanes) for k in system.lanes[0].spent}
    return list(records.values()), load, spent
