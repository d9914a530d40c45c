"""SGLang-Router baseline: N colocated SGLang-like instances behind the cache-aware router.

The policy follows sgl-router's documented cache-aware rule (its source comments and docs):
- load = requests the router has sent to a worker and not seen finish;
- imbalanced when (max - min) > balance_abs_threshold AND max > balance_rel_threshold * min:
  send to the least-loaded worker;
- otherwise find the worker whose approximate tree shares the longest prefix with the request;
  if matched / request length > cache_threshold send it there, else to the least-loaded worker;
- the chosen worker's tree is updated with the request either way.
The approximate tree is the router's own view (it never learns what a worker evicted); it is
kept per worker over block keys and trimmed by LRU to ``max_tree_tokens`` every
``eviction_interval_s``, like the router's periodic eviction.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from benchmarks.sim.engine import Engine, EngineConfig
from benchmarks.sim.events import EventLoop
from benchmarks.sim.job import Job
from benchmarks.sim.metrics import LoadTimeline
from benchmarks.sim.radix_cache import LocalPrefixCache
from benchmarks.sim.step_timer import ClusterSpec, StepTimer


@dataclass(frozen=True)
class RouterConfig:
    """The deployment defaults the paper names (sgl-router's launcher defaults)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 60.0
    max_tree_tokens: int = 2**24


class CacheAwareRouter:
    """The routing decision alone, so tests can check it on constructed cases."""

    def __init__(self, num_workers: int, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.loads = [0] * num_workers
        # Each worker's approximate tree; capacity is never binding here (trimmed by size).
        self.trees = [LocalPrefixCache(2**62) for _ in range(num_workers)]

    def select(self, keys: Sequence[Hashable], lengths: Sequence[int]) -> int:
        """Pick a worker for a request with these block keys; updates the trees and loads."""
        cfg, loads = self.config, self.loads
        lo, hi = min(loads), max(loads)
        least = loads.index(lo)
        total = sum(lengths)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            chosen = least
        else:
            best, best_rate = -1, 0.0
            for w, tree in enumerate(self.trees):
                rate = tree.match(keys, touch=False).num_tokens / total if total else 0.0
                if rate > best_rate:  # ties keep the lowest worker index
                    best, best_rate = w, rate
            chosen = best if best >= 0 and best_rate > cfg.cache_threshold else least
        self.trees[chosen].insert(keys, lengths, lock=False)
        loads[chosen] += 1
        return chosen

    def finished(self, worker: int) -> None:
        self.loads[worker] -= 1

    def evict(self) -> None:
        for tree in self.trees:
            tree.capacity_tokens = self.config.max_tree_tokens
            tree.trim()
            tree.capacity_tokens = 2**62


class RouterSystem:
    """``num_instances`` colocated engines behind :class:`CacheAwareRouter`."""

    def __init__(
        self,
        loop: EventLoop,
        timer: StepTimer,
        spec: ClusterSpec,
        on_finished: Callable[[Job, float], None],
        load: LoadTimeline,
        engine_config: EngineConfig | None = None,
        router_config: RouterConfig | None = None,
    ) -> None:
        engine_config = engine_config or EngineConfig()
        router_config = router_config or RouterConfig()
        self.loop, self.on_finished_cb = loop, on_finished
        self.router = CacheAwareRouter(spec.num_instances, router_config)
        self.engines = [
            Engine(
                i,
                loop,
                timer,
                LocalPrefixCache(spec.capacity_tokens),
                engine_config,
                load,
                self._finished,
            )
            for i in range(spec.num_instances)
        ]
        self._next_eviction = router_config.eviction_interval_s

    def submit(self, job: Job) -> None:
        while self.loop.now >= self._next_eviction:
            self.router.evict()
            self._next_eviction += self.router.config.eviction_interval_s
        keys, lengths = job.prompt_keys()
        self.engines[self.router.select(keys, lengths)].submit(job)

    def _finished(self, job: Job, t: float) -> None:
        self.router.finished(job.instance)
        self.on_finished_cb(job, t)
