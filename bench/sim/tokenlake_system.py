"""TokenLake in the simulator: the real pool (``tokenlake.Pool``) and the real elastic scheduler
(``tokenlake.scheduler.ElasticScheduler``) run unchanged; only time is simulated.

Each iteration the scheduler decides batches and DoPs and calls ``gen_plans``; the plans say
which instance runs each sub-batch (forward), which instances hold its prefix segments (they
run the prefix-attention queries) and where new KV goes (puts). An instance's time is its
forwards plus the queries it serves for everyone; q/o and put bytes to other instances go over
NVLink (same node) or InfiniBand; iterations are synchronous (the scheduler's model), so an
iteration lasts as long as its busiest instance.

The scheduler has no memory-aware admission or preemption yet, so the simulator admits
requests in front of it (FCFS) only while the segments they may still pin fit the pool: each
request's own segments (prompt past its cached prefix plus output, whole segments) and every
cached prefix segment some admitted request relies on, counted once however many share it.
That bound holds whatever the scheduler does, so running requests never overflow the pool; a
request that could not fit even alone is rejected. If ``gen_plans`` still raises
``PoolFullError`` the run stalls and says so (``pool_full_stalls``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tokenlake import Pool, PoolConfig, PoolFullError
from tokenlake.bench.sim.events import EventLoop
from tokenlake.bench.sim.job import Job
from tokenlake.bench.sim.metrics import LoadTimeline
from tokenlake.bench.sim.step_timer import ClusterSpec, CostModelTimer
from tokenlake.bench.workloads.request import prompt_tokens
from tokenlake.load_model import LoadModel
from tokenlake.scheduler import ElasticScheduler, SchedulerConfig


@dataclass(frozen=True)
class TokenLakeConfig:
    """Args: mode / num_prefill (the scheduler's ``elastic`` or ``xpyd`` with P prefill
    instances); segment_len (the pool's); chunk_len / max_prefill_tokens / tbt_slo /
    input_token_slo (the scheduler's); admit_fraction (share of the pool's slots admitted
    requests may pin: the rest absorbs replicas being copied and transient duplicates)."""

    mode: str = "elastic"
    num_prefill: int = 0
    segment_len: int = 512
    chunk_len: int = 8192
    max_prefill_tokens: int = 0
    tbt_slo: float = math.inf
    input_token_slo: float = math.inf
    admit_fraction: float = 0.9


class TokenLakeSystem:
    def __init__(
        self,
        loop: EventLoop,
        timer: CostModelTimer,
        spec: ClusterSpec,
        on_finished: Callable[[Job, float], None],
        load: LoadTimeline,
        config: TokenLakeConfig | None = None,
        on_rejected: Callable[[Job, float, str], None] | None = None,
    ) -> None:
        config = config or TokenLakeConfig()
        self.loop, self.timer, self.spec, self.load = loop, timer, spec, load
        self.on_finished_cb, self.on_rejected_cb = on_finished, on_rejected
        n, seg = spec.num_instances, config.segment_len
        num_slots = max(1, spec.capacity_tokens // seg)
        self.pool = Pool(
            PoolConfig(spec.mp.shape, n, num_slots, seg, namespace="sim"),
            load_model=LoadModel(timer.hardware, spec.mp),
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
        )
        dops = tuple(d for d in (1, 2, 4, 8, 16) if d <= cfg.max_prefill_dop)
        self.sched = ElasticScheduler(cfg, timer.cost.fit(dops=dops), self.pool)
        self.segment_len = seg
        self.jobs: dict[int, Job] = {}
        self.waiting: deque[Job] = deque()  # not yet handed to the scheduler
        self.limit_segments = int(n * num_slots * config.admit_fraction)
        self.committed_segments = 0  # what the admitted requests may pin
        self.shared_refs: dict[int, int] = {}  # cached segment key -> admitted requests on it
        self.busy = False
        self.num_pool_full = 0
        self.q_row_bytes = 2 * spec.mp.num_layers * spec.mp.shape.q_bytes_per_token_layer
        self.node = np.array([spec.node_of(i) for i in range(n)])

    def stats(self) -> dict:
        stats = self.pool.get_stats()
        return {
            "pool_hit_rate": round(stats["hit_rate"], 4),
            "pool_full_stalls": self.num_pool_full,
        }

    # ---- arrivals and admission ----------------------------------------------------------
    def submit(self, job: Job) -> None:
        own = -(-(job.input_len + job.req.output_len) // self.segment_len)
        if own > self.limit_segments:  # more than the pool can ever hold
            if self.on_rejected_cb is not None:
                self.on_rejected_cb(job, self.loop.now, "too_large")
            return
        self.waiting.append(job)
        self._kick()

    def _admit(self) -> None:
        if not self.waiting:
            return
        tree = self.pool.get_prefix_tree()
        seg = self.segment_len
        while self.waiting:
            job = self.waiting[0]
            prompt = job.extra.get("prompt")
            if prompt is None:
                prompt = job.extra["prompt"] = prompt_tokens(job.req, job.block_size)[
                    : job.input_len
                ]
            match = tree.match(prompt)
            shared = [node.key for node in match.nodes]
            own = -(-(job.input_len + job.req.output_len) // seg) - len(shared)
            need = own + sum(1 for k in shared if k not in self.shared_refs)
            if self.committed_segments + need > self.limit_segments:
                return  # FCFS: wait for running requests to free the pool
            self.waiting.popleft()
            for k in shared:
                self.shared_refs[k] = self.shared_refs.get(k, 0) + 1
            job.extra["shared"], job.reserved = shared, own
            job.rec.cached_tokens = match.num_tokens
            self.committed_segments += need
            self.jobs[job.rid] = job
            self.sched.add_request(job.rid, prompt, job.req.output_len)

    def _release(self, job: Job) -> None:
        self.committed_segments -= job.reserved
        for k in job.extra["shared"]:
            self.shared_refs[k] -= 1
            if not self.shared_refs[k]:
                del self.shared_refs[k]
                self.committed_segments -= 1

    # ---- iterations ----------------------------------------------------------------------
    def _kick(self) -> None:
        if not self.busy:
            self.busy = True
            self.loop.at(self.loop.now, self._iterate)

    def _iterate(self) -> None:
        self._admit()
        try:
            it = self.sched.step()
        except PoolFullError:
            # The admission bound was wrong or the scheduler cannot proceed; it cannot preempt,
            # so the run stalls and its unfinished requests count as stalled.
            self.num_pool_full += 1
            self.busy = False
            return
        if it is None:
            self.busy = False
            return
        now = self.loop.now
        for chunk in it.decision.chunks:
            job = self.jobs[chunk.request_id]
            if job.prefix_len == 0 and job.generated == 0 and "started" not in job.extra:
                job.extra["started"] = True
                job.rec.hit_tokens = chunk.start
        dt, reads = self.iteration_time(it.plans, any(p == "prefill" for p in it.decision.phases))
        for i in np.flatnonzero(reads):
            self.load.add(now, int(i), float(reads[i]))
        self.loop.at(now + dt, lambda: self._complete(it))

    def _complete(self, it) -> None:
        now = self.loop.now
        finished = self.sched.complete(it)
        for chunk in it.decision.chunks:
            job = self.jobs[chunk.request_id]
            job.prefix_len = min(chunk.end, job.input_len)
            if chunk.end >= job.input_len:  # the last prompt chunk or a decode step
                job.generated += 1
                job.rec.emit(now)
        for req in finished:
            job = self.jobs.pop(req.request_id)
            self._release(job)
            self.on_finished_cb(job, now)
        self._iterate()

    def iteration_time(self, plans, has_prefill: bool) -> tuple[float, np.ndarray]:
        """Seconds of one synchronous iteration, and KV tokens read per instance."""
        n, seg, timer = self.spec.num_instances, self.segment_len, self.timer
        busy = np.zeros(n)
        entries, puts = [], []  # per sub-batch: (rows, tokens, holders, origin) / (dst, tokens, o)
        for qp, tp in zip(plans.query_plans, plans.transfer_plans, strict=True):
            o = qp.origin
            rows = np.diff(qp.q_indptr)
            first = qp.positions - qp.prefix_lens
            busy[o] += timer.forward_time(
                list(zip(first.tolist(), (first + rows).tolist(), strict=True))
            )
            if len(qp.entry_req):
                holders = np.repeat(qp.holder_ids, np.diff(qp.holder_indptr))
                tokens = (np.diff(qp.kv_indptr) - 1) * seg + qp.last_len
                entries.append((rows[qp.entry_req], tokens, holders, np.full(len(holders), o)))
            if len(tp.dst_ids):
                cum = np.concatenate([[0], np.cumsum(tp.run_len)])
                sent = cum[tp.dst_indptr[1:]] - cum[tp.dst_indptr[:-1]]
                puts.append((np.asarray(tp.dst_ids), sent, np.full(len(sent), o)))
        near, far = np.zeros(n), np.zeros(n)  # bytes each origin sends over NVLink / InfiniBand
        reads = np.zeros(n)
        if entries:
            rows, tokens, holders, origins = (np.concatenate(x) for x in zip(*entries, strict=True))
            reads = np.bincount(holders, weights=rows * tokens, minlength=n)
            one = rows == 1  # decode rows: one batched query per holder
            decode_kv = np.bincount(holders[one], weights=tokens[one], minlength=n)
            for h in np.flatnonzero(decode_kv):
                busy[h] += timer.query_time(1, int(decode_kv[h]))
            for h, r, t in zip(holders[~one], rows[~one], tokens[~one], strict=True):
                busy[h] += timer.query_time(int(r), int(t))
            self._add_traffic(near, far, origins, holders, rows * self.q_row_bytes)
        if puts:
            dsts, sent, origins = (np.concatenate(x) for x in zip(*puts, strict=True))
            self._add_traffic(near, far, origins, dsts, sent * self.spec.kv_bytes_per_token)
        hw = timer.hardware
        net = near / hw.intra_node_bandwidth + far / hw.inter_node_bandwidth
        cfg = timer.config
        overhead = cfg.prefill_overhead_s if has_prefill else cfg.decode_overhead_s
        return overhead + float(np.max(np.maximum(busy, net))), reads

    def _add_traffic(self, near, far, src, dst, num_bytes) -> None:
        """Add ``num_bytes[i]`` sent by ``src[i]`` to ``dst[i]`` (nothing when they are equal)."""
        n, remote = len(near), src != dst
        same = self.node[src] == self.node[dst]
        near += np.bincount(src[remote & same], weights=num_bytes[remote & same], minlength=n)
        far += np.bincount(src[remote & ~same], weights=num_bytes[remote & ~same], minlength=n)
