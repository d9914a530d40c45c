"""Request-level histograms of the server runtime, named and bucketed as vLLM's (prefix
``tokenlake:`` instead of ``vllm:``), so a vLLM Grafana user finds what they look for: time to
first token, inter-token latency, end-to-end, queue, prefill, decode and inference time,
prompt and generation lengths, tokens per iteration; and the finish reasons.

The runtime thread observes (:class:`RequestMetrics`), the scraping thread reads a
:meth:`RequestMetrics.snapshot`; one lock keeps a snapshot whole (every histogram's count
agrees with its buckets).
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# vLLM's bucket bounds (v1 engine's Prometheus logger)
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS_S: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS: tuple[int, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's length buckets)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return tuple(out)
            out.append(value)
        scale *= 10


class Histogram:
    """Observations per bucket (not cumulative; the last one is ``+Inf``), their sum and
    count. Not thread-safe: :class:`RequestMetrics` holds the lock."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        # le semantics: a value equal to a bound falls in that bound's bucket
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)``, ending at ``inf``: the Prometheus form."""
        running, out = 0, []
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass
class RequestTimes:
    """One request's timestamps (the metrics' clock, seconds), kept on the runtime thread."""

    arrival_s: float
    scheduled_s: float | None = None  # the start of its first iteration
    first_token_s: float | None = None
    last_token_s: float | None = None


@dataclass(frozen=True)
class HistogramSnapshot:
    buckets: list[tuple[float, int]]
    sum: float
    count: int


# histogram name (after the prefix) -> help; their bounds are chosen in RequestMetrics
HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Time to first token: arrival to the first token emitted",
    "inter_token_latency_seconds": "Time between two consecutive tokens of one request",
    "time_per_output_token_seconds": "Decode time over generated tokens after the first, per "
    "request",
    "e2e_request_latency_seconds": "End-to-end latency: arrival to the request's end",
    "request_queue_time_seconds": "Arrival to the start of the request's first iteration",
    "request_prefill_time_seconds": "First iteration's start to the first token",
    "request_decode_time_seconds": "First token to the last token",
    "request_inference_time_seconds": "First iteration's start to the last token",
    "request_prompt_tokens": "Prompt length in tokens of finished requests",
    "request_generation_tokens": "Tokens generated per finished request",
    "iteration_tokens_total": "Tokens computed per iteration (prefill and decode)",
}


@dataclass(frozen=True)
class Snapshot:
    histograms: dict[str, HistogramSnapshot]
    finished: dict[str, int]  # finish reason -> requests


class RequestMetrics:
    """The runtime's request histograms; ``max_model_len`` bounds the length buckets,
    ``clock`` (seconds, monotonic) times everything."""

    def __init__(self, max_model_len: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        lengths = one_two_five_buckets(max(1, max_model_len))
        bounds = {
            "time_to_first_token_seconds": TTFT_BUCKETS_S,
            "inter_token_latency_seconds": ITL_BUCKETS_S,
            "time_per_output_token_seconds": ITL_BUCKETS_S,
            "request_prompt_tokens": lengths,
            "request_generation_tokens": lengths,
            "iteration_tokens_total": ITERATION_TOKEN_BUCKETS,
        }
        self._histograms = {
            name: Histogram(bounds.get(name, REQUEST_BUCKETS_S)) for name in HISTOGRAM_HELP
        }
        self._finished: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def arrive(self) -> RequestTimes:
        return RequestTimes(self.clock())

    def scheduled(self, times: RequestTimes, start_s: float) -> None:
        """The request's first iteration began at ``start_s`` (later ones change nothing)."""
        if times.scheduled_s is None:
            times.scheduled_s = start_s
            self._observe("request_queue_time_seconds", start_s - times.arrival_s)

    def token(self, times: RequestTimes) -> None:
        """A token of the request was emitted now."""
        now = self.clock()
        if times.first_token_s is None:
            times.first_token_s = now
            self._observe("time_to_first_token_seconds", now - times.arrival_s)
        else:
            self._observe("inter_token_latency_seconds", now - times.last_token_s)
        times.last_token_s = now

    def iteration(self, num_tokens: int) -> None:
        self._observe("iteration_tokens_total", num_tokens)

    def finished(
        self, times: RequestTimes, reason: str, num_prompt_tokens: int, num_generated: int
    ) -> None:
        """The request ended now with ``reason`` (one of :data:`FINISH_REASONS`)."""
        now = self.clock()
        observed = [
            ("e2e_request_latency_seconds", now - times.arrival_s),
            ("request_prompt_tokens", num_prompt_tokens),
            ("request_generation_tokens", num_generated),
        ]
        first, last, start = times.first_token_s, times.last_token_s, times.scheduled_s
        if first is not None and start is not None:
            observed += [
                ("request_prefill_time_seconds", first - start),
                ("request_decode_time_seconds", last - first),
                ("request_inference_time_seconds", last - start),
            ]
            if num_generated > 1:
                observed.append(
                    ("time_per_output_token_seconds", (last - first) / (num_generated - 1))
                )
        with self._lock:
            for name, value in observed:
                self._histograms[name].observe(value)
            self._finished[reason] += 1

    def snapshot(self) -> Snapshot:
        with self._lock:
            histograms = {
                name: HistogramSnapshot(h.cumulative(), h.sum, h.count)
                for name, h in self._histograms.items()
            }
            finished = {**dict.fromkeys(FINISH_REASONS, 0), **self._finished}
        return Snapshot(histograms, finished)

    def _observe(self, name: str, value: float) -> None:
        with self._lock:
            self._histograms[name].observe(value)
