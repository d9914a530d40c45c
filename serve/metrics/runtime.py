"""The server runtime's Prometheus families (label ``model_name``): requests and tokens,
finish reasons, preemptions, queue gauges, and the request histograms vLLM exports
(:mod:`tokenlake.serve.metrics.requests`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenlake.serve.metrics.families import PREFIX, histogram_family
from tokenlake.serve.metrics.requests import HISTOGRAM_HELP

# runtime counter key -> help (Prometheus adds the _total suffix)
RUNTIME_COUNTERS = {
    "requests": "Requests received",
    "prompt_tokens": "Prompt tokens of finished requests",
    "cached_prompt_tokens": "Prompt tokens of finished requests found in the pool",
    "generation_tokens": "Tokens generated",
    "computed_tokens": "Tokens the compute engine ran (prefill and decode)",
    "iterations": "Scheduler iterations executed",
}
FINISHED = "request_success"  # vLLM's name; finished_reason also says abort and error


class RuntimeCollector(Collector):
    """``runtime``: a :class:`~tokenlake.serve.runtime.Runtime` (read from the scraping
    thread: its counters, gauges and the snapshot of its request histograms)."""

    def __init__(self, runtime, model_name: str) -> None:
        self.runtime = runtime
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        rt, labels, model = self.runtime, ["model_name"], [self.model_name]
        counters = dict(rt.counters)
        snapshot = rt.request_metrics.snapshot()
        for key, doc in RUNTIME_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + key, doc, labels=labels)
            family.add_metric(model, float(counters.get(key, 0)))
            yield family
        finished = CounterMetricFamily(
            PREFIX + FINISHED,
            "Requests finished, by finished_reason: stop (stop token or string), length "
            "(max_tokens), abort (client gone or server stopping), error",
            labels=[*labels, "finished_reason"],
        )
        for reason, n in snapshot.finished.items():
            finished.add_metric([*model, reason], float(n))
        yield finished
        for name, kind, doc, value in (
            ("num_preemptions", CounterMetricFamily,
             "Requests sent back to waiting to be recomputed (pool short of slots, instance "
             "lost)", rt.stats.num_preemptions),
            ("num_requests_running", GaugeMetricFamily, "Requests in the scheduler",
             rt.num_running),
            ("num_requests_waiting", GaugeMetricFamily, "Requests queued", rt.num_waiting),
            ("iteration_seconds", CounterMetricFamily,
             "Wall-clock seconds in iterations (planning, compute, sampling)",
             rt.iteration_seconds),
        ):  # fmt: skip
            family = kind(PREFIX + name, doc, labels=labels)
            family.add_metric(model, float(value))
            yield family
        for name, h in snapshot.histograms.items():
            yield histogram_family(name, HISTOGRAM_HELP[name], labels, [(model, h.buckets, h.sum)])
