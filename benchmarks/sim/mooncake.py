"""Mooncake-style cache-centric PD disaggregation (xPyD) baseline.

P prefill instances keep local prefix caches (LRU); D decode instances hold only their running
requests. A request goes to the prefill instance with the lowest estimated TTFT (queued prefill
work plus its own uncached prefill, the conductor's cache-aware rule), then to the decode
instance with the most free KV memory. After its prefill the whole prompt KV (cached part
included) is sent P -> D over the modelled RDMA bandwidth; the transfer waits until the D
instance can reserve the request's context and output, and each side's NIC sends one transfer
at a time. The first token is out when the KV has arrived.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from benchmarks.sim.engine import Engine, EngineConfig
from benchmarks.sim.events import EventLoop
from benchmarks.sim.job import Job
from benchmarks.sim.metrics import LoadTimeline
from benchmarks.sim.radix_cache import LocalPrefixCache
from benchmarks.sim.step_timer import ClusterSpec, StepTimer


class MooncakeSystem:
    def __init__(
        self,
        loop: EventLoop,
        timer: StepTimer,
        spec: ClusterSpec,
        on_finished: Callable[[Job, float], None],
        load: LoadTimeline,
        num_prefill: int,
        chunked_prefill_size: int = 8192,
    ) -> None:
        if not 0 < num_prefill < spec.num_instances:
            raise ValueError(
                f"num_prefill: expected 1..{spec.num_instances - 1}, got {num_prefill}"
            )
        self.loop, self.timer, self.spec, self.on_finished_cb = loop, timer, spec, on_finished

        def make(i: int, role: str) -> Engine:
            cfg = EngineConfig(chunked_prefill_size=chunked_prefill_size, role=role)
            cache = LocalPrefixCache(spec.capacity_tokens)
            return Engine(i, loop, timer, cache, cfg, load, self._finished, self._prefilled)

        n = spec.num_instances
        self.prefill = [make(i, "prefill") for i in range(num_prefill)]
        self.decode = [make(i, "decode") for i in range(num_prefill, n)]
        self.nic_free_at = [0.0] * n
        self.pending: deque[Job] = deque()  # prefilled, waiting for decode memory

    def submit(self, job: Job) -> None:
        keys, _ = job.prompt_keys()

        def ttft(e: Engine) -> float:
            hit = min(e.cache.match(keys, touch=False).num_tokens, job.input_len - 1)
            queued = e.num_queued_tokens
            return (
                self.timer.prefill_time([queued + job.input_len - hit], [0])
                if queued
                else (self.timer.prefill_time([job.input_len - hit], [hit]))
            )

        min(self.prefill, key=ttft).submit(job)

    def _prefilled(self, job: Job, t: float) -> None:
        self.pending.append(job)
        self._start_transfers()

    def _start_transfers(self) -> None:
        while self.pending:
            job = self.pending[0]
            dst = max(self.decode, key=lambda e: e.cache.available_tokens)
            if dst.too_large_to_decode(job):  # no decode instance can ever hold it: rejected
                self.pending.popleft()
                self.prefill[job.instance].release_prefilled(job)
                dst.num_rejected += 1
                continue
            if not dst.can_accept_decode(job):
                return  # FCFS: wait for a decode instance to free memory
            self.pending.popleft()
            src = job.instance
            start = max(self.loop.now, self.nic_free_at[src], self.nic_free_at[dst.index])
            end = start + self.timer.transfer_time(job.input_len * self.spec.kv_bytes_per_token)
            self.nic_free_at[src] = self.nic_free_at[dst.index] = end
            self.loop.at(end, lambda job=job, dst=dst, src=src: self._arrived(job, dst, src))

    def _arrived(self, job: Job, dst: Engine, src: int) -> None:
        self.prefill[src].release_prefilled(job)
        job.generated = 1
        job.rec.emit(self.loop.now)
        if job.req.output_len == 1:
            dst.cache.release(job.input_len + job.req.output_len)
            self.on_finished_cb(job, self.loop.now)
            self._start_transfers()
            return
        dst.add_decode(job)

    def _finished(self, job: Job, t: float) -> None:
        self.on_finished_cb(job, t)
        self._start_transfers()
