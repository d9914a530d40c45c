"""One SGLang-like instance with a local prefix cache: the baselines' engine.

Scheduling follows SGLang's scheduler (``python/sglang/srt/managers/scheduler.py``): FCFS
waiting queue; a prefill batch (chunked at ``chunked_prefill_size`` tokens, at most one request
cut per batch) runs whenever there is one that fits in memory, otherwise all running requests
decode (prefill has priority). With ``mixed_chunk`` (SGLang's ``--enable-mixed-chunk``) the
running decodes join every prefill batch (``ScheduleBatch.mix_with_running``) and the chunk
budget shrinks by one token per running request (``PrefillAdder``'s
``mixed_with_decode_tokens``), so decodes advance every iteration. A request is admitted when
its uncached prompt plus its whole output fits after evicting unlocked LRU cache entries (SGLang
admits on an estimated output and retracts on overflow; reserving the output is the
no-retraction equivalent). A request longer than the whole KV capacity is rejected (SGLang
aborts it). ``role`` makes the instance prefill-only or decode-only for PD disaggregation.

SGLang's own options, swept for tuned baselines: ``schedule_policy`` (its ``--schedule-policy``,
``sglang/srt/managers/schedule_policy.py``; ``fcfs`` its default): ``lpm`` admits the waiting
requests with the longest cached prefix first (FCFS again once more than 128 wait, as SGLang
turns it off there), ``shortest-prefill-first`` those with the fewest uncached tokens first,
FCFS among ties; SGLang's in-batch deprioritization of requests sharing an uncached prefix and
the chunk cap shortest-prefill-first puts on a running chunked prefill are not modelled.
``radix_eviction`` (``--radix-eviction-policy``, ``lru`` or ``slru``: :mod:`.systems.radix_cache`).

Two options beyond SGLang's defaults, for tuned baselines: ``tbt_slo_s`` (finite: TBT-aware
chunking, each step's chunk the largest that fits the TBT SLO beside the running decodes, see
:mod:`.tbt_chunk`) and ``cascade`` (vLLM V1's cascade attention for the decode rows of a
batch, see :mod:`.cascade`; only the decode rows' common prefix is counted).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tokenlake.benchmarks.sim.events import EventLoop
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.metrics import LoadTimeline
from tokenlake.benchmarks.sim.step_timer import StepTimer
from tokenlake.benchmarks.sim.systems.cascade import cascade_read_tokens, common_prefix_tokens
from tokenlake.benchmarks.sim.systems.radix_cache import EVICTIONS, LRU, LocalPrefixCache
from tokenlake.benchmarks.sim.tbt_chunk import CHUNK_GRANULE, tbt_aware_chunk

FCFS, LPM, SHORTEST_PREFILL_FIRST = "fcfs", "lpm", "shortest-prefill-first"
SCHEDULE_POLICIES = (FCFS, LPM, SHORTEST_PREFILL_FIRST)
LPM_MAX_QUEUE = 128  # SGLang's WAITING_QUEUE_PREFIX_MATCH_MAX: LPM is FCFS beyond it


@dataclass(frozen=True)
class EngineConfig:
    chunked_prefill_size: int = 8192
    max_running_requests: int = 1024
    role: str = "both"  # "both", "prefill" or "decode"
    mixed_chunk: bool = False
    tbt_slo_s: float = math.inf  # finite: TBT-aware chunks of at most chunked_prefill_size
    cascade: bool = False  # vLLM V1's cascade decode
    schedule_policy: str = FCFS  # SGLang's --schedule-policy
    radix_eviction: str = LRU  # SGLang's --radix-eviction-policy

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"EngineConfig.role: expected both/prefill/decode, got {self.role!r}")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"EngineConfig.schedule_policy: expected one of {SCHEDULE_POLICIES}, got "
                f"{self.schedule_policy!r}"
            )
        if self.radix_eviction not in EVICTIONS:
            raise ValueError(
                f"EngineConfig.radix_eviction: expected one of {EVICTIONS}, got "
                f"{self.radix_eviction!r}"
            )
        if self.chunked_prefill_size < 1 or self.max_running_requests < 1:
            raise ValueError(
                "EngineConfig: chunked_prefill_size, max_running_requests >= 1, got "
                f"{self.chunked_prefill_size}, {self.max_running_requests}"
            )
        if not self.tbt_slo_s > 0:
            raise ValueError(f"EngineConfig.tbt_slo_s: expected > 0, got {self.tbt_slo_s}")


class Engine:
    """Callbacks: ``on_prefilled(job, t)`` (prefill-only role: the KV is ready to send),
    ``on_finished(job, t)`` and ``on_rejected(job, t, reason)``."""

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
        on_rejected: Callable[[Job, float, str], None] | None = None,
    ) -> None:
        self.index, self.loop, self.timer, self.cache, self.config = (
            index,
            loop,
            timer,
            cache,
            config,
        )
        self.load, self.on_finished, self.on_prefilled = load, on_finished, on_prefilled
        self.on_rejected = on_rejected
        self.waiting: deque[Job] = deque()
        self.prefilling: list[Job] = []  # admitted, prompt not done (at most one is cut)
        self.running: list[Job] = []  # decoding
        self.busy = False
        self.busy_time = 0.0
        self._common: tuple[tuple[int, ...], int] = ((), 0)  # (rids, shared prefix): a memo

    # ---- entry points --------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """A new request (roles both / prefill)."""
        job.instance = self.index
        keys, _ = job.prompt_keys()
        job.extra["queued_prefix"] = min(
            self.cache.match(keys, touch=False).num_tokens, job.input_len - 1
        )
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

    def queued_prefill(self) -> tuple[list[int], list[int]]:
        """(new tokens, cached tokens) of every queued prompt: the prefill work ahead of a new
        request (a waiting request's cached prefix as estimated when it arrived)."""
        news, prefixes = [], []
        for job in self.prefilling:
            news.append(job.input_len - job.prefix_len)
            prefixes.append(job.prefix_len)
        for job in self.waiting:
            hit = job.extra["queued_prefix"]
            news.append(job.input_len - hit)
            prefixes.append(hit)
        return news, prefixes

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

    def _order_waiting(self) -> None:
        """The waiting queue in the schedule policy's order (a stable sort: FCFS on ties)."""
        policy = self.config.schedule_policy
        if policy == FCFS or len(self.waiting) < 2:
            return
        if policy == LPM and len(self.waiting) > LPM_MAX_QUEUE:
            return

        def cached(job: Job) -> int:
            hit = self.cache.match(job.prompt_keys()[0], touch=False).num_tokens
            return min(hit, job.input_len - 1)

        if policy == LPM:
            order = sorted(self.waiting, key=lambda j: -cached(j))
        else:
            order = sorted(self.waiting, key=lambda j: max(1, j.input_len - cached(j)))
        self.waiting = deque(order)

    def _prefill_batch(self, budget: int) -> list[tuple[Job, int]]:
        batch, budget = [], max(budget, 0)
        if self.waiting and budget > 0:
            self._order_waiting()
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
                if self.on_rejected is not None:
                    self.on_rejected(job, self.loop.now, "too_large")
                continue
            if not self._admit(job):
                break  # FCFS: the head waits for memory
            self.waiting.popleft()
            self.prefilling.append(job)
            job.prefill_start_s = self.loop.now
            n = min(job.input_len - job.prefix_len, budget)
            batch.append((job, n))
            budget -= n
        return [(j, n) for j, n in batch if n > 0]

    def chunk_budget(self, mixed: bool) -> int:
        """Prefill tokens of the next step: ``chunked_prefill_size`` less one per mixed-in
        decode (SGLang's budget); TBT-aware (finite ``tbt_slo_s``) while requests decode: the
        largest chunk whose step fits the SLO beside them, at least ``CHUNK_GRANULE`` prefill
        tokens (a prefill must progress)."""
        size, num_decodes = self.config.chunked_prefill_size, len(self.running)
        if not (math.isfinite(self.config.tbt_slo_s) and self.running):
            return size - (num_decodes if mixed else 0)
        # the queue's head, as far as the largest chunk reaches
        queued = [(j.input_len - j.prefix_len, j.prefix_len) for j in self.prefilling]
        total = sum(n for n, _ in queued)
        for job in self.waiting:
            if total >= size:
                break
            hit = job.extra["queued_prefix"]
            queued.append((job.input_len - hit, hit))
            total += job.input_len - hit
        if not queued:
            return size - (num_decodes if mixed else 0)
        ctxs = [j.context_len for j in self.running]
        chunk = tbt_aware_chunk(self.timer, size, self.config.tbt_slo_s, queued, ctxs, mixed)
        return max(chunk - (num_decodes if mixed else 0), CHUNK_GRANULE)

    def decode_reads(self, decoding: list[Job]) -> list[int] | None:
        """Cascade: prefix tokens each decode row reads (the batch's common prefix once, by
        its first row), or None when cascade is off or vLLM would not use it."""
        if not self.config.cascade or len(decoding) < 2:
            return None
        rids = tuple(j.rid for j in decoding)
        if self._common[0] != rids:
            common = common_prefix_tokens(
                [j.req.block_ids for j in decoding],
                [j.input_len for j in decoding],
                decoding[0].block_size,
            )
            self._common = (rids, common)
        common = self._common[1]
        ctxs = [j.context_len for j in decoding]
        if cascade_read_tokens(ctxs, common) is None:
            return None
        return [ctxs[0]] + [c - common for c in ctxs[1:]]

    def _step(self) -> None:
        now = self.loop.now
        mixed = self.config.mixed_chunk and bool(self.running)
        batch = []
        if self.config.role != "decode":
            batch = self._prefill_batch(self.chunk_budget(mixed))
        if batch:
            decoding = list(self.running) if mixed else []
            news = [n for _, n in batch] + [1] * len(decoding)
            prefixes = [j.prefix_len for j, _ in batch] + [j.context_len for j in decoding]
            reads = self.decode_reads(decoding)
            if reads is None:
                dt = self.timer.prefill_time(news, prefixes)
            else:
                dt = self.timer.prefill_time(
                    news, prefixes, [j.prefix_len for j, _ in batch] + reads
                )
            self.load.add(now, self.index, sum(n * p for n, p in zip(news, prefixes, strict=True)))
            self.loop.at(now + dt, lambda: self._prefill_done(batch, decoding, dt))
        elif self.running:
            decoding = list(self.running)
            ctxs, reads = [j.context_len for j in decoding], self.decode_reads(decoding)
            dt = self.timer.decode_time(ctxs, sum(reads)) if reads else self.timer.decode_time(ctxs)
            self.load.add(now, self.index, sum(j.context_len for j in decoding))
            self.loop.at(now + dt, lambda: self._decode_done(decoding, dt))
        else:
            self.busy = False

    def _prefill_done(self, batch: list[tuple[Job, int]], decoding: list[Job], dt: float) -> None:
        now = self.loop.now
        self.busy_time += dt
        self._advance_decodes(decoding, now)
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
        self.busy_time += dt
        self._advance_decodes(decoding, self.loop.now)
        self._step()

    def _advance_decodes(self, decoding: list[Job], now: float) -> None:
        for job in decoding:
            job.generated += 1
            job.rec.emit(now)
            if self._maybe_finish(job, now):
                self.running.remove(job)

    def _maybe_finish(self, job: Job, now: float) -> bool:
        if job.generated < job.req.output_len:
            return False
        if self.config.role == "both":
            keys, lengths = job.prompt_keys()
            okeys, olengths = job.output_keys()
            self.cache.release(job.reserved)
            self.cache.unlock(job.path)
            # SGLang caches the whole finished sequence; output KV is as reusable as any.
            self.cache.insert(keys + okeys, lengths + olengths, lock=False, counted=len(keys))
            self.cache._evict(
                self.cache.cached_tokens + self.cache.reserved_tokens - self.cache.capacity_tokens
            )
        else:
            self.cache.release(job.reserved)
        job.reserved, job.path = 0, ()
        self.on_finished(job, now)
        return True
