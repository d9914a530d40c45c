"""Per-request latency records, the paper's SLO, goodput bisection and load CV.

Input-token latency = TTFT / input length; output-token latency = time between tokens. The SLO
(§7): every input and output token latency <= ``slo_scale`` (10) times its batch-size-1 latency,
i.e. the same request alone on an idle instance with an empty cache. A request that never
finishes misses the SLO.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tokenlake.cluster.balancer import coefficient_of_variation


@dataclass(eq=False)
class RequestRecord:
    """Timeline of one request. ``solo_prefill_s`` is its batch-size-1 prefill time;
    ``solo_decode`` (a, b) gives its batch-size-1 decode step as ``a + b * context``."""

    rid: int
    arrival_s: float
    input_len: int
    output_len: int
    solo_prefill_s: float
    solo_decode: tuple[float, float]
    first_token_s: float = math.nan
    last_token_s: float = math.nan
    finish_s: float = math.nan
    num_tokens: int = 0
    max_tbt_ratio: float = 0.0  # max over tokens of gap / batch-size-1 decode step
    max_tbt_s: float = 0.0
    cached_tokens: int = 0  # prefix matched in the cache at admission (uncapped)
    hit_tokens: int = 0  # prompt tokens not recomputed
    rejected: str = ""  # why the system refused it ("too_large", "slo", "session"), or ""

    def emit(self, now: float) -> None:
        """One output token at ``now`` (the first one ends the prefill)."""
        if self.num_tokens == 0:
            self.first_token_s = now
        else:
            gap = now - self.last_token_s
            ctx = self.input_len + self.num_tokens
            solo = self.solo_decode[0] + self.solo_decode[1] * ctx
            self.max_tbt_s = max(self.max_tbt_s, gap)
            self.max_tbt_ratio = max(self.max_tbt_ratio, gap / solo)
        self.last_token_s = now
        self.num_tokens += 1
        if self.num_tokens == self.output_len:
            self.finish_s = now

    @property
    def finished(self) -> bool:
        return not math.isnan(self.finish_s)

    @property
    def input_token_latency(self) -> float:
        return (self.first_token_s - self.arrival_s) / self.input_len

    @property
    def input_ratio(self) -> float:
        """TTFT over the batch-size-1 prefill time (both per input token)."""
        return (self.first_token_s - self.arrival_s) / self.solo_prefill_s

    def meets_slo(self, slo_scale: float = 10.0) -> bool:
        return self.finished and self.input_ratio <= slo_scale and self.max_tbt_ratio <= slo_scale


def certain_misses(records: Sequence[RequestRecord], now: float, slo_scale: float = 10.0) -> int:
    """Requests that miss the SLO whatever happens after ``now``: rejected, a first token or
    a next token already later than the SLO allows, or a finished request that missed."""
    n = 0
    for r in records:
        if r.rejected:
            n += 1
        elif r.num_tokens == 0:
            n += (now - r.arrival_s) / r.solo_prefill_s > slo_scale
        elif r.input_ratio > slo_scale or r.max_tbt_ratio > slo_scale:
            n += 1
        elif not r.finished:
            solo = r.solo_decode[0] + r.solo_decode[1] * (r.input_len + r.num_tokens)
            n += (now - r.last_token_s) / solo > slo_scale
    return n


def slo_attainment(records: Sequence[RequestRecord], slo_scale: float = 10.0) -> float:
    return sum(r.meets_slo(slo_scale) for r in records) / len(records) if records else 0.0


def hit_rate(records: Sequence[RequestRecord]) -> float:
    """Prompt tokens served from a cache over prompt tokens (the pool's definition)."""
    total = sum(r.input_len for r in records)
    return sum(r.hit_tokens for r in records) / total if total else 0.0


@dataclass
class LoadTimeline:
    """KV tokens read per instance in fixed time windows (the paper's Fig. 10 "prefix cache
    accesses"): ``add(t, instance, tokens)``; ``cv()`` averages the per-window CV across
    instances over windows with any load."""

    num_instances: int
    window_s: float = 1.0
    windows: dict[int, np.ndarray] = field(default_factory=dict)

    def add(self, t: float, instance: int, tokens: float) -> None:
        w = self.windows.get(int(t // self.window_s))
        if w is None:
            w = self.windows[int(t // self.window_s)] = np.zeros(self.num_instances)
        w[instance] += tokens

    def matrix(self) -> tuple[np.ndarray, np.ndarray]:
        """(window start times [W], loads [W, num_instances]) in time order."""
        keys = sorted(self.windows)
        loads = np.array([self.windows[k] for k in keys]).reshape(len(keys), self.num_instances)
        return np.array(keys, dtype=float) * self.window_s, loads

    def cv(self) -> float:
        _, loads = self.matrix()
        cvs = [coefficient_of_variation(row) for row in loads if row.sum() > 0]
        return float(np.mean(cvs)) if cvs else 0.0


@dataclass(frozen=True)
class GoodputResult:
    goodput: float  # highest rate found with attainment >= target (0 if none)
    points: tuple[tuple[float, float], ...]  # (rate, attainment) evaluated, in order


def bisect_goodput(
    attainment_at: Callable[[float], float],
    lo: float,
    hi: float,
    target: float = 0.9,
    rel_tol: float = 0.1,
    max_evals: int = 10,
    width: int = 1,
    attainments: Callable[..., list[float]] | None = None,
    ahead: bool = False,
) -> GoodputResult:
    """Highest rate with ``attainment_at(rate) >= target``, by bisection in log space.

    Starts from ``lo`` (halved until it passes or 4 halvings fail) and ``hi`` (doubled until
    it fails, at most 4 times); stops when hi/lo <= 1 + rel_tol. Assumes attainment falls as
    the rate rises, as it does on average (a simulation is one sample). ``width > 1`` probes
    that many rates per round with ``attainments(rates)`` (run at once): ``lo`` and ``hi``
    together, then ``width`` rates splitting the bracket evenly in log space.

    ``ahead``: each bisection round calls ``attainments(rates, then)``, where
    ``then(known)`` gives the next round's rates if the rates not in ``known`` (a dict
    rate -> attainment of those already run) pass, ``[]`` if the search would end there — what
    a caller may start early on an idle worker. The rates probed do not change.
    """
    if width > 1 and attainments is None:
        raise ValueError("bisect_goodput: width > 1 needs attainments(rates)")
    many = attainments or (lambda rates: [attainment_at(r) for r in rates])
    points: list[tuple[float, float]] = []

    def oks(rates: list[float], then: Callable | None = None) -> list[bool]:
        values = many(rates) if then is None else many(rates, then)
        points.extend(zip(rates, values, strict=True))
        return [a >= target for a in values]

    # the bracket: lo halved while it fails, hi doubled while it passes (4 tries each); the
    # first round is lo, and hi with it when rounds are wide
    downs, ups = [lo / 2**i for i in range(4)], [hi * 2**i for i in range(4)]
    first = oks([downs[0], *ups[: min(width - 1, 1)]])
    down = not first[0]
    walk, tried, done = (downs, 1, []) if down else (ups, len(first) - 1, first[1:])
    edge, turned = (downs[0] if down else lo), False
    while True:
        for rate, ok in zip(walk[tried - len(done) : tried], done, strict=True):
            if ok != down:  # still failing going down, still passing going up
                edge = rate
                continue
            turned = True
            lo, hi = (rate, edge) if down else (edge, rate)
            break
        if turned or tried >= 4:
            break
        nxt = walk[tried : tried + width]
        done, tried = oks(nxt), tried + len(nxt)
    if not turned:
        return GoodputResult(0.0 if down else edge, tuple(points))

    def next_rates(lo: float, hi: float, num_points: int) -> list[float]:
        if hi / lo <= 1 + rel_tol or num_points >= max_evals:
            return []
        if width == 1:
            return [math.sqrt(lo * hi)]  # the sequential midpoint, bit for bit
        k = min(width, max_evals - num_points)
        return [lo * (hi / lo) ** ((i + 1) / (k + 1)) for i in range(k)]

    def narrow(lo: float, hi: float, rates: list[float], passed: list[bool]) -> tuple:
        for rate, ok in zip(rates, passed, strict=True):
            if not ok:
                return lo, rate
            lo = rate
        return lo, hi

    def then_of(lo: float, hi: float, rates: list[float]) -> Callable[[dict], list[float]]:
        n = len(points) + len(rates)
        return lambda known: next_rates(
            *narrow(lo, hi, rates, [known.get(r, target) >= target for r in rates]), n
        )

    while rates := next_rates(lo, hi, len(points)):
        lo, hi = narrow(lo, hi, rates, oks(rates, then_of(lo, hi, rates) if ahead else None))
    return GoodputResult(lo, tuple(points))
