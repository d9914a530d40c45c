"""TokenLake in the simulator: the real pool (``tokenlake.Pool``) and the real elastic scheduler
(``tokenlake.scheduler.ElasticScheduler``) run unchanged; only time is simulated.

Each iteration the scheduler decides batches and DoPs and calls ``gen_plans``; the plans say
which instance runs each sub-batch (forward), which instances hold its prefix segments (they
run the prefix-attention queries) and where new KV goes (puts). An instance's time is its
forwards plus the queries it serves for everyone; q/o and put bytes to other instances go over
NVLink (same node) or InfiniBand; iterations are synchronous (the scheduler's model), so an
iteration lasts as long as its busiest instance. Admission control in front of the scheduler
keeps the KV that running requests may still write within the pool (the scheduler has none).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from benchmarks.sim.events import EventLoop
from benchmarks.sim.job import Job
from benchmarks.sim.metrics import LoadTimeline
from benchmarks.sim.step_timer import ClusterSpec, CostModelTimer
from benchmarks.workloads.request import prompt_tokens
from tokenlake import Pool, PoolConfig, PoolFullError
from tokenlake.load_model import LoadModel
from tokenlake.scheduler import ElasticScheduler, SchedulerConfig

GPUS_PER_NODE = 8


class TokenLakeSystem:
    def __init__(
        self,
        loop: EventLoop,
        timer: CostModelTimer,
        spec: ClusterSpec,
        on_finished: Callable[[Job, float], None],
        load: LoadTimeline,
        mode: str = "elastic",
        num_prefill: int = 0,
        chunk_len: int = 8192,
        segment_len: int = 512,
        tbt_slo: float = float("inf"),
        input_token_slo: float = float("inf"),
        admit_fraction: float = 0.9,
        max_prefill_tokens: int = 0,
    ) -> None:
        self.loop, self.timer, self.spec, self.load = loop, timer, spec, load
        self.on_finished_cb = on_finished
        n = spec.num_instances
        num_slots = max(1, spec.capacity_tokens // segment_len)
        self.pool = Pool(
            PoolConfig(spec.mp.shape, n, num_slots, segment_len, namespace="sim"),
            load_model=LoadModel(timer.hardware, spec.mp),
        )
        self.capacity_tokens = n * num_slots * segment_len
        cfg = SchedulerConfig(
            n,
            segment_len,
            mode=mode,
            chunk_len=chunk_len,
            max_prefill_tokens=max_prefill_tokens,
            num_prefill_instances=num_prefill,
            tbt_slo=tbt_slo,
            input_token_slo=input_token_slo,
        )
        dops = tuple(d for d in (1, 2, 4, 8, 16) if d <= cfg.max_prefill_dop)
        self.sched = ElasticScheduler(cfg, timer.cost.fit(dops=dops), self.pool)
        self.segment_len = segment_len
        self.jobs: dict[int, Job] = {}
        self.waiting: deque[Job] = deque()  # not yet handed to the scheduler
        self.committed_tokens = 0  # KV the admitted requests may pin
        self.pinned: dict[int, int] = {}  # cached prefix blocks counted, with admitted users
        self.admit_fraction = admit_fraction
        self.busy = False
        self.num_pool_full = 0
        self.q_row_bytes = 2 * spec.mp.num_layers * spec.mp.shape.q_bytes_per_token_layer

    # ---- arrivals and admission ----------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.waiting.append(job)
        self._kick()

    def _admit(self) -> None:
        if not self.waiting:
            return
        tree = self.pool.get_prefix_tree()
        # Extra replicas of pinned segments are not evictable: leave room for them too.
        replicas = (tree.num_replicas - tree.num_segments) * self.segment_len
        limit = self.capacity_tokens * self.admit_fraction - replicas
        while self.waiting:
            job = self.waiting[0]
            tokens = prompt_tokens(job.req, job.block_size)
            prompt = tokens[: job.input_len]
            cached = tree.match(prompt).num_tokens
            shared = list(job.req.block_ids[: cached // self.segment_len])
            fresh = sum(1 for b in shared if b not in self.pinned)
            # KV this request may still pin: prefix segments no admitted request pins yet, its
            # uncached prompt, its output, and its open (partial) segment.
            need = (
                fresh * self.segment_len
                + job.input_len
                - len(shared) * self.segment_len
                + job.req.output_len
                + self.segment_len
            )
            if self.jobs and self.committed_tokens + need > limit:
                return  # FCFS: wait for running requests to free the pool
            self.waiting.popleft()
            for b in shared:
                self.pinned[b] = self.pinned.get(b, 0) + 1
            job.extra["shared"] = shared
            job.reserved, job.rec.cached_tokens = need, cached
            self.committed_tokens += need
            self.jobs[job.rid] = job
            self.sched.add_request(job.rid, prompt, job.req.output_len)

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
            # The running requests alone overflow the pool (admission is an estimate) and the
            # scheduler cannot preempt: the run stalls and its unfinished requests miss.
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
            self.committed_tokens -= job.reserved
            for b in job.extra["shared"]:
                self.pinned[b] -= 1
                if not self.pinned[b]:
                    del self.pinned[b]
            self.on_finished_cb(job, now)
        self._iterate()

    def iteration_time(self, plans, has_prefill: bool) -> tuple[float, np.ndarray]:
        """Seconds of one synchronous iteration, and KV tokens read per instance."""
        n, seg, timer = self.spec.num_instances, self.segment_len, self.timer
        kv_bytes = self.spec.kv_bytes_per_token
        busy, reads = np.zeros(n), np.zeros(n)
        near, far = np.zeros(n), np.zeros(n)  # bytes sent over NVLink / InfiniBand
        decode_kv = np.zeros(n)  # one-row entries, batched per holder
        node = np.arange(n) * self.spec.tp // GPUS_PER_NODE
        for qp, tp in zip(plans.query_plans, plans.transfer_plans, strict=True):
            o = qp.origin
            rows = np.diff(qp.q_indptr)
            first = qp.positions - qp.prefix_lens
            busy[o] += timer.forward_time(
                list(zip(first.tolist(), (first + rows).tolist(), strict=True))
            )
            if len(qp.entry_req):
                e_rows = rows[qp.entry_req]
                e_tok = (np.diff(qp.kv_indptr) - 1) * seg + qp.last_len
                e_holder = np.repeat(qp.holder_ids, np.diff(qp.holder_indptr))
                np.add.at(reads, e_holder, e_rows * e_tok)
                one = e_rows == 1
                np.add.at(decode_kv, e_holder[one], e_tok[one])
                for h, r, t in zip(e_holder[~one], e_rows[~one], e_tok[~one], strict=True):
                    busy[h] += timer.query_time(int(r), int(t))
                remote = e_holder != o
                same = node[e_holder] == node[o]
                near[o] += e_rows[remote & same].sum() * self.q_row_bytes
                far[o] += e_rows[remote & ~same].sum() * self.q_row_bytes
            for d, dst in enumerate(tp.dst_ids):
                if dst != o:
                    lo, hi = tp.dst_indptr[d], tp.dst_indptr[d + 1]
                    put = int(tp.run_len[lo:hi].sum()) * kv_bytes
                    (near if node[dst] == node[o] else far)[o] += put
        for h in np.flatnonzero(decode_kv):
            busy[h] += timer.query_time(1, int(decode_kv[h]))
        hw = timer.hardware
        net = near / hw.intra_node_bandwidth + far / hw.inter_node_bandwidth
        cfg = timer.config
        overhead = cfg.prefill_overhead_s if has_prefill else cfg.decode_overhead_s
        return overhead + float(np.max(np.maximum(busy, net))), reads
