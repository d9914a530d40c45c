"""Prometheus metrics (``prometheus-client``, the ``[serve]`` extra): the pool's, the engines'
and the server runtime's, as collectors read at scrape time.

The server mounts them at ``/metrics``. Any other program can export them with a registry of
its own::

    from prometheus_client import CollectorRegistry, start_http_server
    from tokenlake.serve.metrics.collector import EngineCollector, PoolCollector

    registry = CollectorRegistry()
    registry.register(PoolCollector(pool.get_stats, pool.config))  # a tokenlake.Pool
    registry.register(EngineCollector(cluster.engine_stats))       # LocalCluster or MPCluster
    start_http_server(9400, addr="127.0.0.1", registry=registry)

A collector calls its source on every scrape, from the scraping thread: in a program whose
pool or cluster is busy on another thread, pass a function returning the latest snapshot
taken on that thread instead (the server does: the runtime refreshes them between
iterations).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenlake.config import PoolConfig
from tokenlake.serve.metrics.engines import EngineCollector
from tokenlake.serve.metrics.families import INSTANCE_LABEL, PREFIX, histogram_family
from tokenlake.serve.metrics.runtime import RuntimeCollector

__all__ = ["EngineCollector", "PoolCollector", "RuntimeCollector", "render", "server_registry"]
CONTENT_TYPE = CONTENT_TYPE_LATEST
StatsSource = Callable[[], Mapping]

# get_stats key -> (metric, help); counters grow over the pool's life, gauges are its state
_POOL_COUNTERS = {
    "num_hit_tokens": ("pool_hit_tokens", "Prompt tokens served from the pool"),
    "num_prompt_tokens": ("pool_prompt_tokens", "Prompt tokens admitted"),
    "num_requests": ("pool_requests", "Requests admitted"),
    "num_iterations": ("pool_iterations", "Iterations committed"),
    "num_evictions": ("pool_evictions", "Segment replicas evicted"),
    "num_replications": ("pool_replications", "Segment replicas created by the balancer"),
    "num_dedup_segments": ("pool_dedup_segments", "Segments found already stored"),
    "bytes_saved_by_dedup": ("pool_dedup_bytes", "Bytes not stored thanks to deduplication"),
    "query_bytes": ("pool_query_bytes", "Query bytes planned between instances"),
    "put_bytes": ("pool_put_bytes", "New KV bytes planned to remote homes"),
    "replication_bytes": ("pool_replication_bytes", "Segment copy bytes planned"),
    "num_put_tokens": ("pool_put_tokens", "Tokens of new KV written"),
}
_POOL_GAUGES = {
    "hit_rate": ("pool_hit_rate", "Share of prompt tokens served from the pool"),
    "load_cv": ("pool_load_cv", "Coefficient of variation of per-instance load, in total"),
    "window_load_cv": ("pool_window_load_cv", "Load CV over the balancer's sliding window"),
    "mean_load_cv": ("pool_mean_load_cv", "Mean load CV over consecutive windows"),
    "num_segments": ("pool_segments", "Sealed segments stored"),
    "num_replicas": ("pool_replicas", "Extra replicas of segments"),
    "num_replicated_segments": ("pool_replicated_segments", "Segments with more than one copy"),
    "num_running_requests": ("pool_running_requests", "Requests holding pins in the pool"),
    "num_iterations_in_flight": ("pool_iterations_in_flight", "Iterations planned, not done"),
    "bytes_stored": ("pool_bytes_stored", "Bytes of KV in used slots"),
}


# get_stats key -> (metric, help) of the host tier below the pool
_TIER_COUNTERS = {
    "tier_promotions": ("tier_promotions", "Segments loaded from the host tier into the pool"),
    "tier_promotion_bytes": ("tier_promotion_bytes", "Bytes loaded from the host tier"),
    "tier_demotions": ("tier_demotions", "Segments evicted from the pool into the host tier"),
    "tier_demotion_bytes": ("tier_demotion_bytes", "Bytes copied into the host tier"),
    "tier_evictions": ("tier_evictions", "Segments the full host tier evicted"),
}
_TIER_GAUGES = {
    "tier_blocks": ("tier_blocks", "Segment blocks of the host tier"),
    "tier_blocks_used": ("tier_blocks_used", "Host-tier blocks holding a segment"),
    "tier_segments": ("tier_segments", "Segments in the host tier only"),
    "tier_bytes_stored": ("tier_bytes_stored", "Bytes of KV in the host tier"),
}


def _tiers(stats: Mapping) -> Iterator[Metric]:
    """The hits by tier (``tier``: ``pool`` or ``host``) and the host tier's counters."""
    hits = CounterMetricFamily(
        PREFIX + "tier_hit_tokens", "Prompt tokens served from the cache, by the tier they "
        "were in (pool: accelerator memory; host: the host tier, loaded first)", labels=["tier"],
    )  # fmt: skip
    hits.add_metric(["pool"], float(stats.get("pool_hit_tokens", 0)))
    hits.add_metric(["host"], float(stats.get("tier_hit_tokens", 0)))
    yield hits
    for table, kind in ((_TIER_COUNTERS, CounterMetricFamily), (_TIER_GAUGES, GaugeMetricFamily)):
        for key, (name, doc) in table.items():
            yield kind(PREFIX + name, doc, value=float(stats.get(key, 0)))


class PoolCollector(Collector):
    """A pool's counters (``source``: ``pool.get_stats`` or a function returning its dict).
    With ``config`` (the pool's :class:`~tokenlake.PoolConfig`) also the KV capacity and
    usage: slots and tokens in total, the used fraction per instance; and, when the stats
    carry ``free_capacity`` (``pool.free_capacity()``, the server's snapshot does), vLLM's
    ``kv_cache_usage_perc`` (the fraction held by running requests) beside TokenLake's
    cached-but-idle share. ``model_name``: the label vLLM puts on its KV and prefix-cache
    families (the server passes its model's name)."""

    def __init__(
        self, source: StatsSource, config: PoolConfig | None = None, model_name: str | None = None
    ) -> None:
        self.source = source
        self.config = config
        self.model_name = model_name

    def _vllm_family(self, kind, name: str, doc: str, value: float) -> Metric:
        """A family vLLM labels with ``model_name`` (unlabelled without a model name)."""
        if self.model_name is None:
            return kind(PREFIX + name, doc, value=value)
        family = kind(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.source()
        for key, (name, doc) in _POOL_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(PREFIX + name, doc, value=float(stats[key]))
        miss = stats.get("num_prompt_tokens", 0) - stats.get("num_hit_tokens", 0)
        yield CounterMetricFamily(
            PREFIX + "pool_miss_tokens", "Prompt tokens not found in the pool", value=miss
        )
        if "num_prompt_tokens" in stats:  # vLLM's prefix-cache counters, in tokens
            yield self._vllm_family(
                CounterMetricFamily, "prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (the pool)",
                float(stats["num_prompt_tokens"]),
            )  # fmt: skip
            yield self._vllm_family(
                CounterMetricFamily, "prefix_cache_hits",
                "Prompt tokens found in the prefix cache (the pool)",
                float(stats.get("num_hit_tokens", 0)),
            )  # fmt: skip
        for key, (name, doc) in _POOL_GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats[key]))
        live = set(stats.get("live_instances", ()))
        yield GaugeMetricFamily(PREFIX + "pool_live_instances", "Live instances", len(live))
        per_instance = (
            ("instance_load", CounterMetricFamily, "pool_instance_load_tokens",
             "Prefix tokens read per instance (query rows x tokens)"),
            ("window_load", GaugeMetricFamily, "pool_instance_window_load_tokens",
             "Prefix tokens read per instance in the balancer's window"),
            ("slots_used", GaugeMetricFamily, "pool_instance_slots_used",
             "Segment slots holding KV per instance (cached or in use)"),
        )  # fmt: skip
        for key, kind, name, doc in per_instance:
            family = kind(PREFIX + name, doc, labels=[INSTANCE_LABEL])
            for i, value in enumerate(stats.get(key, ())):
                family.add_metric([str(i)], float(value))
            yield family
        if "tier_blocks" in stats:
            yield from _tiers(stats)
        if self.config is not None:
            yield from self._capacity(stats, live)
        h = stats.get("gen_plans_seconds")
        if h is not None:
            yield histogram_family(
                "pool_gen_plans_seconds",
                "gen_plans latency of committed iterations",
                [],
                [([], h["buckets"], h["sum"])],
            )

    def _capacity(self, stats: Mapping, live: set) -> Iterator[Metric]:
        num_slots, segment_len = self.config.num_slots, self.config.segment_len
        capacity = num_slots * len(live)
        used = [int(n) for n in stats.get("slots_used", ())]
        num_used = sum(n for i, n in enumerate(used) if i in live)
        yield self._vllm_family(
            GaugeMetricFamily, "kv_cache_capacity_slots",
            "Segment slots of the live instances (one segment of every layer each)", capacity,
        )  # fmt: skip
        yield self._vllm_family(
            GaugeMetricFamily, "kv_cache_capacity_tokens",
            "Tokens of KV the live instances hold (slots x segment_len)", capacity * segment_len,
        )  # fmt: skip
        yield self._vllm_family(
            GaugeMetricFamily, "kv_cache_used_slots",
            "Segment slots holding KV on the live instances (cached or in use)", num_used,
        )  # fmt: skip
        per_instance = GaugeMetricFamily(
            PREFIX + "kv_cache_instance_used_perc",
            "Fraction (0 to 1) of an instance's slots holding KV, cached prefixes included",
            labels=[INSTANCE_LABEL],
        )
        for i, n in enumerate(used):
            per_instance.add_metric([str(i)], n / num_slots)
        yield per_instance
        free = stats.get("free_capacity")
        if free is not None and capacity:
            pinned = max(0, capacity - int(free))  # neither free nor evictable
            yield self._vllm_family(
                GaugeMetricFamily, "kv_cache_usage_perc",
                "Fraction (0 to 1) of the live slots held by running requests and iterations "
                "in flight (vLLM's meaning: an idle pool reads 0)", pinned / capacity,
            )  # fmt: skip
            yield self._vllm_family(
                GaugeMetricFamily, "kv_cache_cached_perc",
                "Fraction (0 to 1) of the live slots holding cached prefixes no running "
                "request holds (evictable; reused by later requests)",
                max(0, num_used - pinned) / capacity,
            )  # fmt: skip


def server_registry(runtime, model_name: str) -> CollectorRegistry:
    """What ``/metrics`` serves: the runtime's counters and histograms, and the snapshots of
    the pool's and the engines' that its loop takes between iterations."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RuntimeCollector(runtime, model_name))
    registry.register(
        PoolCollector(lambda: runtime.stats.pool_stats, runtime.scheduler.pool.config, model_name)
    )
    registry.register(EngineCollector(lambda: runtime.stats.engine_stats))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    return generate_latest(registry)
