"""One SGLang-like instance with a local prefix cache: the baselines' engine.

Scheduling follows SGLang's defaults: FCFS waiting queue; a prefill batch (chunked at
``chunked_prefill_size`` tokens, at most one request cut per batch) runs whenever there is one
that fits in memory, otherwise all running requests decode (prefill has priority, no mixed
batches); a request is admitted when its uncached prompt plus its whole output fits after
evicting unlocked LRU cache entries. ``role`` makes the instance prefill-only or decode-only
for PD disaggregation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.sim.events import EventLoop
from benchmarks.sim.job import Job
from benchmarks.sim.metrics import LoadTimeline
from benchmarks.sim.radix_cache import LocalPrefixCache
from benchmarks.sim.step_timer import StepTimer


@dataclass(frozen=True)
class EngineConfig:
    chunked_prefill_size: int = 8192
    max_running_requests: int = 1024
    role: str = "both"  # "both", "prefill" or "decode"

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"EngineConfig.role: expected both/prefill/decode, got {self.role!r}")
        if self.chunked_prefill_size < 1 or self.max_running_requests < 1:
            raise ValueError("EngineConfig: chunked_prefill_size, max_running_requests >= 1")


class Engine:
    """Callbacks: ``on_prefilled(job, t)`` (prefill-only role: the KV is ready to send) and
    ``on_finished(job, t)``."""

    def __init__(
        self,
        index: int,
        loop: EventLoop,
        timer: StepTimer,
        cache: LocalPrefixCache,
        config: EngineConfig,
        load: LoadTimeline,
        on_finished: Callable[[Job, float], None],
        on_prefilled: Callable[[Job, float], None] | None = None,
    ) -> None:
        self.index, self.loop, self.timer, self.cache, self.config = (
            index,
            loop,
            timer,
            cache,
            config,
        )
        self.load, self.on_finished, self.on_prefilled = load, on_finished, on_prefilled
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []  # admitted, prompt not done (at most one is cut)
        self.running: list[Job] = []  # decoding
        self.busy = False
        self.busy_time = 0.0
        self.num_rejected = 0

    # ---- entry points --------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """A new request (roles both / prefill)."""
        job.instance = self.index
        self.waiting.append(job)
        self._kick()

    def too_large_to_decode(self, job: Job) -> bool:
        return job.input_len + job.req.output_len > self.cache.capacity_tokens

    def can_accept_decode(self, job: Job) -> bool:
        return len(self.running) < self.config.max_running_requests and self.cache.reserve(
            job.input_len + job.req.output_len
        )

    def add_decode(self, job: Job) -> None:
        """A prefilled request whose KV has arrived (decode role); reserve it first with
        :meth:`can_accept_decode`."""
        job.instance = self.index
        job.reserved = job.input_len + job.req.output_len
        self.running.append(job)
        self._kick()

    @property
    def num_queued_tokens(self) -> int:
        return sum(j.input_len - j.prefix_len for j in list(self.waiting) + self.prefilling)

    # ---- scheduling ----------------------------------------------------------------------
    def _kick(self) -> None:
        if not self.busy:
            self.busy = True
            self.loop.at(self.loop.now, self._step)

    def _too_large(self, job: Job) -> bool:
        out = job.req.output_len if self.config.role != "prefill" else 0
        return job.input_len + out > self.cache.capacity_tokens

    def _admit(self, job: Job) -> bool:
        keys, _ = job.prompt_keys()
        m = self.cache.match(keys)
        hit = min(m.num_tokens, job.input_len - 1)
        need = job.input_len - hit + (job.req.output_len if self.config.role == "both" else 0)
        if not self.cache.reserve(need):
            return False
        self.cache.lock(m.path)
        job.path, job.reserved, job.prefix_len = m.path, need, hit
        job.rec.cached_tokens, job.rec.hit_tokens = m.num_tokens, hit
        return True

    def _prefill_batch(self) -> list[tuple[Job, int]]:
        budget, batch = self.config.chunked_prefill_size, []
        for job in self.prefilling:
            n = min(job.input_len - job.prefix_len, budget)
            batch.append((job, n))
            budget -= n
        while self.waiting and budget > 0:
            if len(self.running) + len(self.prefilling) >= self.config.max_running_requests:
                break
            job = self.waiting[0]
            if self._too_large(job):
                # Longer than this instance's whole KV capacity: SGLang rejects such a request
                # (it never finishes, so it misses the SLO) instead of blocking the queue.
                self.waiting.popleft()
                self.num_rejected += 1
                continue
            if not self._admit(job):
                break  # FCFS: the head waits for memory
            self.waiting.popleft()
            self.prefilling.append(job)
            n = min(job.input_len - job.prefix_len, budget)
            batch.append((job, n))
            budget -= n
        return [(j, n) for j, n in batch if n > 0]

    def _step(self) -> None:
        now = self.loop.now
        batch = self._prefill_batch() if self.config.role != "decode" else []
        if batch:
            dt = self.timer.prefill_time([n for _, n in batch], [j.prefix_len for j, _ in batch])
            self.load.add(now, self.index, sum(n * j.prefix_len for j, n in batch))
            self.loop.at(now + dt, lambda: self._prefill_done(batch, dt))
        elif self.running:
            decoding = list(self.running)
            dt = self.timer.decode_time([j.context_len for j in decoding])
            self.load.add(now, self.index, sum(j.context_len for j in decoding))
            self.loop.at(now + dt, lambda: self._decode_done(decoding, dt))
        else:
            self.busy = False

    def _prefill_done(self, batch: list[tuple[Job, int]], dt: float) -> None:
        now = self.loop.now
        self.busy_time += dt
        for job, n in batch:
            job.prefix_len += n
            if not job.prefill_done:
                continue
            self.prefilling.remove(job)
            keys, lengths = job.prompt_keys()
            self.cache.unlock(job.path)
            job.path, _ = self.cache.insert(keys, lengths, lock=True)
            new_prompt = job.input_len - job.rec.hit_tokens
            self.cache.release(new_prompt)  # now in the tree (or deduplicated)
            job.reserved -= new_prompt
            self.cache.trim()
            if self.config.role == "prefill":
                self.on_prefilled(job, now)  # the sender unlocks after the transfer
                continue
            job.generated = 1
            job.rec.emit(now)
            if not self._maybe_finish(job, now):
                self.running.append(job)
        self._step()

    def release_prefilled(self, job: Job) -> None:
        """Prefill role: the KV has been sent; keep the prompt cached, unlocked."""
        self.cache.unlock(job.path)
        job.path = ()
        if self.waiting:
            self._kick()  # admission may have been waiting for this memory

    def _decode_done(self, decoding: list[Job], dt: float) -> None:
        now = self.loop.now
        self.busy_time += dt
        for job in decoding:
            job.generated += 1
            job.rec.emit(now)
            if self._maybe_finish(job, now):
                self.running.remove(job)
        self._step()

    def _maybe_finish(self, job: Job, now: float) -> bool:
        if job.generated < job.req.output_len:
            return False
        if self.config.role == "both":
            keys, lengths = job.prompt_keys()
            okeys, olengths = job.output_keys()
            self.cache.release(job.reserved)
            self.cache.unlock(job.path)
            # SGLang caches the whole finished sequence; output KV is as reusable as any.
            self.cache.insert(keys + okeys, lengths + olengths, lock=False)
            self.cache._evict(
                self.cache.cached_tokens + self.cache.reserved_tokens - self.cache.capacity_tokens
            )
        else:
            self.cache.release(job.reserved)
        job.reserved, job.path = 0, ()
        self.on_finished(job, now)
        return True
