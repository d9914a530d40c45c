"""Prometheus metrics (``prometheus-client``, the ``[serve]`` extra): the pool's, the engines'
and the server runtime's, as collectors read at scrape time.

The server mounts them at ``/metrics``. Any other program can export them with a registry of
its own::

    from prometheus_client import CollectorRegistry, start_http_server
    from tokenlake.serve.metrics import EngineCollector, PoolCollector

    registry = CollectorRegistry()
    registry.register(PoolCollector(pool.get_stats))           # a tokenlake.Pool
    registry.register(EngineCollector(cluster.engine_stats))   # LocalCluster or MPCluster
    start_http_server(9400, addr="127.0.0.1", registry=registry)

A collector calls its source on every scrape, from the scraping thread: in a program whose
pool or cluster is busy on another thread, pass a function returning the latest snapshot
taken on that thread instead (the server does: the runtime refreshes them between
iterations).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tokenlake.latency import histograms, is_histogram_key

PREFIX = "tokenlake:"
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


def _histogram(name: str, doc: str, labels: list[str], samples) -> HistogramMetricFamily:
    """``samples``: ``(label values, cumulative buckets [(bound, count)], sum)``."""
    family = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
    for values, buckets, total in samples:
        bounds = [("+Inf" if b == float("inf") else repr(float(b)), int(c)) for b, c in buckets]
        family.add_metric(values, bounds, total)
    return family


class PoolCollector(Collector):
    """A pool's counters (``source``: ``pool.get_stats`` or a function returning its dict)."""

    def __init__(self, source: StatsSource) -> None:
        self.source = source

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
             "Segment slots in use per instance"),
        )  # fmt: skip
        for key, kind, name, doc in per_instance:
            family = kind(PREFIX + name, doc, labels=["instance"])
            for i, value in enumerate(stats.get(key, ())):
                family.add_metric([str(i)], float(value))
            yield family
        h = stats.get("gen_plans_seconds")
        if h is not None:
            yield _histogram(
                "pool_gen_plans_seconds",
                "gen_plans latency of committed iterations",
                [],
                [([], h["buckets"], h["sum"])],
            )


# engine counters reported for every engine even before they first count (engines count
# lazily: their stats only hold what happened)
ALWAYS_REPORTED = ("errors", "peer_failures")


class EngineCollector(Collector):
    """Every engine's counters and latency histograms, labelled by ``role`` (query,
    transfer, client = this process's engine clients) and ``instance`` (``source``:
    ``cluster.engine_stats`` or a function returning its dict)."""

    def __init__(self, source: StatsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        stats = self.source()
        counters: dict[str, CounterMetricFamily] = {}
        latency = []
        for (role, instance), values in sorted(stats.items()):
            labels = [role, str(instance)]
            # failure counters exist from the first scrape (0), so rate() and alerts see them
            values = {**dict.fromkeys(ALWAYS_REPORTED, 0), **values}
            for key, value in sorted(values.items()):
                if is_histogram_key(key):
                    continue
                family = counters.get(key)
                if family is None:
                    family = CounterMetricFamily(
                        f"{PREFIX}engine_{key}",
                        f"Engine counter {key}",
                        labels=["role", "instance"],
                    )
                    counters[key] = family
                family.add_metric(labels, float(value))
            for name, h in histograms(values).items():
                latency.append(([*labels, name.removesuffix("_seconds")], h.buckets, h.sum_s))
        yield from counters.values()
        yield _histogram(
            "engine_latency_seconds",
            "Engine call latency: message handling in engines, query/put in clients",
            ["role", "instance", "op"],
            latency,
        )


class RuntimeCollector(Collector):
    """The server runtime's counters (requests, tokens, iterations, finish reasons)."""

    COUNTERS = {
        "requests": "Requests received",
        "prompt_tokens": "Prompt tokens of finished requests",
        "cached_prompt_tokens": "Prompt tokens of finished requests found in the pool",
        "generation_tokens": "Tokens generated",
        "computed_tokens": "Tokens the compute engine ran (prefill and decode)",
        "iterations": "Scheduler iterations executed",
        "finished_stop": "Requests finished by a stop token or string",
        "finished_length": "Requests finished by max_tokens",
        "finished_abort": "Requests cancelled (client gone)",
        "finished_error": "Requests failed",
    }

    def __init__(self, runtime, model_name: str) -> None:
        self.runtime = runtime
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        rt, labels = self.runtime, ["model_name"]
        counters = dict(rt.counters)
        for key, doc in self.COUNTERS.items():
            family = CounterMetricFamily(PREFIX + key, doc, labels=labels)
            family.add_metric([self.model_name], float(counters.get(key, 0)))
            yield family
        for name, kind, doc, value in (
            ("num_requests_running", GaugeMetricFamily, "Requests in the scheduler",
             rt.num_running),
            ("num_requests_waiting", GaugeMetricFamily, "Requests queued", rt.num_waiting),
            ("iteration_seconds", CounterMetricFamily, "Seconds in iterations",
             rt.iteration_seconds),
        ):  # fmt: skip
            family = kind(PREFIX + name, doc, labels=labels)
            family.add_metric([self.model_name], float(value))
            yield family


def server_registry(runtime, model_name: str) -> CollectorRegistry:
    """What ``/metrics`` serves: the runtime's counters and the snapshots of the pool's and
    the engines' that its loop takes between iterations."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RuntimeCollector(runtime, model_name))
    registry.register(PoolCollector(lambda: runtime.pool_stats))
    registry.register(EngineCollector(lambda: runtime.engine_stats))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text exposition of ``registry``."""
    return generate_latest(registry)
