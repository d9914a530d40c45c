"""What the Prometheus collectors of ``/metrics`` share: the name prefix, the per-instance
label and histogram families built from cumulative buckets."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import HistogramMetricFamily, Metric

PREFIX = "tokenlake:"
# not "instance": Prometheus sets that label to the scrape target, renaming ours to
# "exported_instance"
INSTANCE_LABEL = "tl_instance"

# (label values, cumulative buckets [(upper bound, count <= it)] ending at inf, sum)
HistogramSample = tuple[Sequence[str], Iterable[tuple[float, int]], float]


def histogram_family(
    name: str, doc: str, labels: list[str], samples: Iterable[HistogramSample]
) -> HistogramMetricFamily:
    """Histogram ``PREFIX + name`` with one labelled series per sample."""
    family = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
    for values, buckets, total in samples:
        bounds = [("+Inf" if b == float("inf") else repr(float(b)), int(c)) for b, c in buckets]
        family.add_metric(list(values), bounds, total)
    return family


def drop_label(family: Metric, label: str, value: str) -> Metric:
    """``family`` with ``label`` removed from the samples where it equals ``value`` (a
    series that has no such dimension, e.g. the engine clients' instance)."""
    family.samples = [
        s._replace(labels={k: v for k, v in s.labels.items() if k != label})
        if s.labels.get(label) == value
        else s
        for s in family.samples
    ]
    return family
