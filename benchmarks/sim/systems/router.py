"""SGLang-Router baseline: N colocated SGLang-like instances behind the cache-aware router.

The routing rule is sgl-router's ``CacheAwarePolicy::select_worker`` (sgl-project/sglang,
``sgl-router/src/policies/cache_aware.rs`` at commits 026f853b and b6f20641, the
sglang-router 0.2-0.3 line the paper's SGLang-Router used):

1. load = requests routed to a worker and not yet answered (the router's own counters);
2. imbalanced when ``max - min > balance_abs_threshold`` AND ``max > min *
   balance_rel_threshold``: route to the least-loaded worker (the first one on ties, Rust's
   ``min_by_key``) and insert the request into that worker's branch of the approximate tree;
3. otherwise match the request against the approximate tree (:mod:`.approx_tree`): if the
   matched share of the request is strictly above ``cache_threshold``, route to the matched
   tenant; else to the tenant with the smallest tree ("most available cache capacity"); then
   insert the request for the chosen worker.

Every ``eviction_interval_s`` the tree is trimmed to ``max_tree_tokens`` per tenant, as the
router's background eviction thread does. Defaults are sgl-router's launcher defaults
(``cache_threshold`` 0.3, ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5,
``eviction_interval`` 120 s, ``max_tree_size`` 2**26 characters, here 2**24 tokens at about 4
characters per token); the paper names the first three.

``miss_rule="min_load"`` is the successor gateway's variant (lightseekorg/smg 1.9.0,
``model_gateway/src/policies/cache_aware.rs``, commit 73da68c): below the threshold it routes
to the least-loaded worker, ties broken by fewer processed requests, then index.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tokenlake.benchmarks.sim.context import SimContext
from tokenlake.benchmarks.sim.engine import Engine, EngineConfig
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.systems.approx_tree import ApproxTree
from tokenlake.benchmarks.sim.systems.radix_cache import LocalPrefixCache

MISS_RULES = ("smallest_tree", "min_load")


@dataclass(frozen=True)
class RouterConfig:
    """sgl-router's launcher defaults (see the module docstring)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_tokens: int = 2**24
    miss_rule: str = "smallest_tree"
    seed: int = 0  # the approximate tree's per-node tenant order

    def __post_init__(self) -> None:
        if self.miss_rule not in MISS_RULES:
            raise ValueError(f"RouterConfig.miss_rule: expected one of {MISS_RULES}")


class CacheAwareRouter:
    """The routing decision alone, so tests can check it on constructed cases."""

    def __init__(self, num_workers: int, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self.loads = [0] * num_workers
        self.processed = [0] * num_workers
        self.tree = ApproxTree(num_workers, self.config.seed)
        self.last_branch = ""  # "imbalanced", "cache_hit" or "cache_miss" (for tests)

    def select(self, keys: Sequence[Hashable], lengths: Sequence[int], now: float = 0.0) -> int:
        """Pick a worker for a request with these block keys; updates the tree and loads."""
        cfg, loads = self.config, self.loads
        lo, hi = min(loads), max(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            chosen, self.last_branch = loads.index(lo), "imbalanced"
        else:
            total = sum(lengths)
            matched, tenant = self.tree.prefix_match(keys, now)
            if total and matched / total > cfg.cache_threshold:
                chosen, self.last_branch = tenant, "cache_hit"
            else:
                self.last_branch = "cache_miss"
                if cfg.miss_rule == "smallest_tree":
                    chosen = self.tree.smallest_tenant()
                else:
                    chosen = min(range(len(loads)), key=lambda w: (loads[w], self.processed[w], w))
        self.tree.insert(keys, lengths, chosen, now)
        loads[chosen] += 1
        self.processed[chosen] += 1
        return chosen

    def finished(self, worker: int) -> None:
        self.loads[worker] -= 1

    def evict(self) -> None:
        self.tree.evict_by_size(self.config.max_tree_tokens)


class RouterSystem:
    """``num_instances`` colocated engines behind :class:`CacheAwareRouter`."""

    def __init__(
        self,
        ctx: SimContext,
        engine_config: EngineConfig | None = None,
        router_config: RouterConfig | None = None,
    ) -> None:
        loop, timer, spec, load = ctx.loop, ctx.timer, ctx.spec, ctx.load
        on_finished, on_rejected = ctx.on_finished, ctx.on_rejected
        engine_config = engine_config or EngineConfig()
        router_config = router_config or RouterConfig()
        self.loop, self.on_finished_cb, self.on_rejected_cb = loop, on_finished, on_rejected
        self.router = CacheAwareRouter(spec.num_instances, router_config)
        self.engines = [
            Engine(
                i,
                loop,
                timer,
                LocalPrefixCache(spec.capacity_tokens, engine_config.radix_eviction),
                engine_config,
                load,
                self._finished,
                on_rejected=self._rejected,
            )
            for i in range(spec.num_instances)
        ]
        self._next_eviction = router_config.eviction_interval_s

    def submit(self, job: Job) -> None:
        while self.loop.now >= self._next_eviction:
            self.router.evict()
            self._next_eviction += self.router.config.eviction_interval_s
        keys, lengths = job.prompt_keys()
        self.engines[self.router.select(keys, lengths, self.loop.now)].submit(job)

    def _finished(self, job: Job, t: float) -> None:
        self.router.finished(job.instance)
        self.on_finished_cb(job, t)

    def _rejected(self, job: Job, t: float, reason: str) -> None:
        self.router.finished(job.instance)  # the worker answers with an error
        if self.on_rejected_cb is not None:
            self.on_rejected_cb(job, t, reason)

    def stats(self) -> dict:
        return {"evicted_tokens": sum(e.cache.num_evicted_tokens for e in self.engines)}
