"""Latency histograms kept as plain integer counters, so they live in the same ``Counter`` as
an engine's other counters and cross the engines' wire unchanged (no floats, no nesting).

Histogram ``name`` is the keys ``"{name}:le:{i}"`` (observations in bucket ``i``, not
cumulative: ``BUCKETS_S[i-1] < seconds <= BUCKETS_S[i]``; index ``len(BUCKETS_S)`` is
``+Inf``), ``"{name}:count"`` and ``"{name}:sum_ns"``. :func:`histograms` reads them back
as cumulative buckets, the form Prometheus exposes.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

# 10 us .. 10 s: a kernel call on a warm cache up to a stalled peer
BUCKETS_S: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True)
class Histogram:
    """``buckets``: ``(upper bound in s, observations <= it)``, cumulative, ending at ``inf``."""

    buckets: tuple[tuple[float, int], ...]
    sum_s: float
    count: int


@functools.cache
def _keys(name: str) -> tuple[tuple[str, ...], str, str]:
    """Histogram ``name``'s counter keys, built once: an observation is on the data plane's
    per-call path (a put of a few hundred KiB takes microseconds)."""
    buckets = tuple(f"{name}:le:{i}" for i in range(len(BUCKETS_S) + 1))
    return buckets, f"{name}:count", f"{name}:sum_ns"


def observe(counters: MutableMapping[str, int], name: str, seconds: float) -> None:
    """Add one observation of ``seconds`` to histogram ``name`` in ``counters``."""
    buckets, count, sum_ns = _keys(name)
    bucket = buckets[bisect.bisect_left(BUCKETS_S, seconds)]
    counters[bucket] = counters.get(bucket, 0) + 1
    counters[count] = counters.get(count, 0) + 1
    counters[sum_ns] = counters.get(sum_ns, 0) + max(0, int(seconds * 1e9))


def is_histogram_key(key: str) -> bool:
    return ":" in key


def histograms(counters: Mapping[str, int]) -> dict[str, Histogram]:
    """Every histogram in ``counters``, by name."""
    names = {k[: -len(":count")] for k in counters if k.endswith(":count")}
    out = {}
    for name in sorted(names):
        running, buckets = 0, []
        for i, bound in enumerate((*BUCKETS_S, float("inf"))):
            running += int(counters.get(f"{name}:le:{i}", 0))
            buckets.append((bound, running))
        out[name] = Histogram(
            tuple(buckets),
            int(counters.get(f"{name}:sum_ns", 0)) / 1e9,
            int(counters[f"{name}:count"]),
        )
    return out
