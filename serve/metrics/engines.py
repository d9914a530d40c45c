"""The engines' counters and latency histograms as Prometheus families, labelled by
``role`` (``query`` / ``transfer`` engine, ``client`` = this process's engine clients) and
``tl_instance`` (engines only: a process's clients serve every instance)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenlake.latency import histograms, is_histogram_key
from tokenlake.serve.metrics.families import (
    INSTANCE_LABEL,
    PREFIX,
    drop_label,
    histogram_family,
)

CLIENT_INSTANCE = -1  # the instance id engine_stats() reports the clients under
NS_SUFFIX = "_ns"  # a counter in nanoseconds, exported in seconds

# counter key (a *_ns key without its suffix) -> help
ENGINE_COUNTER_HELP = {
    "query_calls": "Prefix-attention queries: run by query engines, sent by clients",
    "query_bytes": "Bytes of query rows and results (q in, o and lse out)",
    "query_thread": "Seconds of query-engine thread CPU time in prefix attention",
    "put_calls": "KV puts: written by transfer engines, sent by clients",
    "put_bytes": "Bytes of new KV put",
    "copy_calls": "Segment copies (replication) run by transfer engines",
    "errors": "Requests answered with an error",
    "peer_failures": "Requests answered with an error because a peer died or stalled",
    "rejected_replies": "Replies dropped by a client: unauthentic or not a reply",
    "refused_handshakes": "Connections refused at the handshake (no cluster secret)",
    "unauthenticated_frames": "Frames without a valid MAC (refused handshakes included)",
    "malformed_frames": "Frames of the wrong shape",
    "rejected_frames": "Authentic frames that did not decode as a known message",
    "internal_errors": "Unexpected failures while handling a frame (the engine kept serving)",
}
# reported for every engine even before they first count (engines count lazily: their
# stats only hold what happened), so rate() and alerts see them from the first scrape
ALWAYS_REPORTED = ("errors", "peer_failures")


def counter_name(key: str) -> tuple[str, float]:
    """``(metric name after the prefix, scale)`` of engine counter ``key``."""
    if key.endswith(NS_SUFFIX):
        return f"engine_{key.removesuffix(NS_SUFFIX)}_seconds", 1e-9
    return f"engine_{key}", 1.0


class EngineCollector(Collector):
    """Every engine's counters and latency histograms (``source``: ``cluster.engine_stats``
    or a function returning its dict, ``{(role, instance id): counters}``)."""

    def __init__(self, source: Callable[[], Mapping]) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        stats = self.source()
        counters: dict[str, CounterMetricFamily] = {}
        latency = []
        labels = ["role", INSTANCE_LABEL]
        for (role, instance), values in sorted(stats.items()):
            values = {**dict.fromkeys(ALWAYS_REPORTED, 0), **values}
            series = [role, str(instance)]
            for key, value in sorted(values.items()):
                if is_histogram_key(key):
                    continue
                name, scale = counter_name(key)
                family = counters.get(name)
                if family is None:
                    short = key.removesuffix(NS_SUFFIX)
                    doc = ENGINE_COUNTER_HELP.get(short, f"Engine counter {short}")
                    family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
                    counters[name] = family
                family.add_metric(series, float(value) * scale)
            for name, h in histograms(values).items():
                latency.append(([*series, name.removesuffix("_seconds")], h.buckets, h.sum_s))
        client = str(CLIENT_INSTANCE)
        for family in counters.values():
            yield drop_label(family, INSTANCE_LABEL, client)
        yield drop_label(
            histogram_family(
                "engine_latency_seconds",
                "Engine call latency: message handling in engines (op = message type), "
                "query / put in clients",
                [*labels, "op"],
                latency,
            ),
            INSTANCE_LABEL,
            client,
        )
