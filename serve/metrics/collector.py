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


class PoolCollector(Collector):
    """A pool's counters (``source``: ``pool.get_stats`` or a function returning its dict).
    With ``config`` (the pool's :class:`~tokenlake.PoolConfig`) also the KV capacity and
    usage: slots and tokens in total, the used fraction per instance; and, when the stats
    carry ``free_capacity`` (``pool.free_capacity()``, the server's snapshot does), the
    fraction held by running requests."""

    def __init__(self, source: StatsSource, config: PoolConfig | None = None) -> None:
        self.source = source
        self.config = config

    def collect(self) -> Iterator[Metric]:
        stats = self.source()
        for key, (name, doc) in _POOL_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(PREFIX + name, doc, value=float(stats[key]))
        miss = stats.get("num_prompt_tokens", 0) - stats.get("num_hit_tokens", 0)
        yield CounterMetricFamily(
            PREFIX + "pool_miss_tokens", "Prompt tokens not found in the pool", value=miss
        )
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
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_capacity_slots",
            "Segment slots of the live instances (one segment of every layer each)",
            value=capacity,
        )
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_capacity_tokens",
            "Tokens of KV the live instances hold (slots x segment_len)",
            value=capacity * segment_len,
        )
        yield GaugeMetricFamily(
            PREFIX + "kv_cache_used_slots",
            "Segment slots holding KV on the live instances (cached or in use)",
            value=sum(n for i, n in enumerate(used) if i in live),
        )
        usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "Fraction (0 to 1) of an instance's slots holding KV, cached prefixes included: "
            "a warm pool reads near 1; see kv_cache_pinned_perc for what requests hold",
            labels=[INSTANCE_LABEL],
        )
        for i, n in enumerate(used):
            usage.add_metric([str(i)], n / num_slots)
        yield usage
        free = stats.get("free_capacity")
        if free is not None and capacity:
            yield GaugeMetricFamily(
                PREFIX + "kv_cache_pinned_perc",
                "Fraction (0 to 1) of the live slots neither free nor evictable: held by "
                "running requests and iterations in flight (vLLM's kv_cache_usage_perc)",
                value=max(0.0, 1.0 - free / capacity),
            )


def server_registry(runtime, model_name: str) -> CollectorRegistry:
    """What ``/metrics`` serves: the runtime's counters and histograms, and the snapshots of
    the pool's and the engines' that its loop takes between iterations."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RuntimeCollector(runtime, model_name))
    registry.register(
        PoolCollector(lambda: runtime.stats.pool_stats, runtime.scheduler.pool.config)
    )
    registry.register(EngineCollector(lambda: runtime.stats.engine_stats))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    return generate_latest(registry)
