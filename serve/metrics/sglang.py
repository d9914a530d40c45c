"""``/metrics`` of a pool shared by SGLang workers: the pool's own collector (hit rate,
capacity, per-instance load) and the control service's counters, above all the prefix tokens
of a worker's prompts found on another worker's instance (``sglang_cross_worker_hit_tokens``).

SGLang serves its own ``/metrics`` per worker; these come from the process hosting the pool::

    from prometheus_client import start_http_server
    start_http_server(9400, addr="127.0.0.1", registry=shared_pool_registry(service))
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenlake.serve.metrics.collector import PoolCollector
from tokenlake.serve.metrics.families import PREFIX

_COUNTERS = {
    "cross_worker_hit_tokens": "Prompt tokens found in the pool on another worker's instance",
    "local_hit_tokens": "Prompt tokens found in the pool on the worker's own instance",
    "cross_worker_prefix_tokens": "Prefix tokens attended on another worker's instance",
    "local_prefix_tokens": "Prefix tokens attended on the worker's own instance",
    "rejected_requests": "Control requests answered with an error",
    "unauthenticated_frames": "Control frames dropped unauthenticated",
    "instances_dropped": "Instances dropped because their worker died",
}


class ControlCollector(Collector):
    """The service's counters, read at scrape time from its snapshot."""

    def __init__(self, service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        stats = self.service.snapshot()["service"]
        for key, doc in _COUNTERS.items():
            yield CounterMetricFamily(f"{PREFIX}sglang_{key}", doc, value=float(stats.get(key, 0)))
        yield GaugeMetricFamily(
            f"{PREFIX}sglang_workers", "SGLang workers attached", value=float(stats["workers"])
        )


def shared_pool_registry(service) -> CollectorRegistry:
    """A registry of the shared pool's and its control service's metrics."""
    registry = CollectorRegistry()
    registry.register(PoolCollector(lambda: service.snapshot()["pool"], service.pool.config))
    registry.register(ControlCollector(service))
    return registry
