"""P90 goodput with a knob sweep and repeat seeds: each system at its best setting, with ranges.

For one system: bisect the goodput on seed 0 at every value of the prefill knob and keep the
best value (the first on ties); then bisect the other seeds at that value, each starting near
the seed-0 result. The figure reported is the median over seeds with its min-max range; two
systems differ ("win") only where their ranges do not overlap.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from tokenlake.benchmarks.sim.metrics import bisect_goodput

TARGET = 0.9  # P90 goodput: the highest rate where 90% of requests meet the SLO
# attainment(rate, seed, knob) -> SLO attainment of one run
Attainment = Callable[[float, int, int], float]
# attainments(rates, seed, knob[, then]) -> SLO attainments of runs at once (``then``: see
# system_goodput's ``ahead``)
Attainments = Callable[..., list[float]]


@dataclass
class SystemGoodput:
    """Goodputs of one system: ``by_knob[k]`` on seed 0; ``goodputs`` per seed at ``knob``;
    ``points`` every run as (seed, knob, rate, attainment)."""

    knob: Hashable  # a prefill size, or (prefill size, further settings)
    by_knob: dict
    goodputs: list[float]
    points: list[tuple[int, int, float, float]] = field(default_factory=list)

    @property
    def lower_bound(self) -> bool:
        """True when some seed met the SLO at every rate tried (its goodput is a "≥")."""
        for seed, g in zip(self.seeds, self.goodputs, strict=True):
            tried = [(r, a) for s, k, r, a in self.points if s == seed and k == self.knob]
            if g > 0 and all(a >= TARGET for r, a in tried if r >= g):
                return True
        return False

    @property
    def seeds(self) -> list[int]:
        return list(dict.fromkeys(s for s, _, _, _ in self.points))[: len(self.goodputs)]

    @property
    def median(self) -> float:
        return statistics.median(self.goodputs)

    @property
    def low(self) -> float:
        return min(self.goodputs)

    @property
    def high(self) -> float:
        return max(self.goodputs)

    def beats(self, other: SystemGoodput) -> bool:
        """A win: this system's whole range lies above the other's."""
        return self.low > other.high


def system_goodput(
    attainment: Attainment,
    knobs: Sequence[int],
    seeds: Sequence[int],
    lo: float,
    hi: float,
    rel_tol: float,
    max_evals: int = 10,
    width: int = 1,
    attainments: Attainments | None = None,
    ahead: bool = False,
    more_knobs: Callable[[Hashable], Sequence[Hashable]]
    | Sequence[Callable[[Hashable], Sequence[Hashable]]]
    | None = None,
) -> SystemGoodput:
    """``width > 1``: each bisection probes that many rates per round through
    ``attainments`` (see :func:`~tokenlake.benchmarks.sim.metrics.bisect_goodput`); ``ahead``:
    its rounds call ``attainments(rates, seed, knob, then)``, ``then`` the next round's
    rates if the rates not yet run pass (a run may start before it is asked for).
    ``more_knobs(best)``: further knob values to try once ``knobs`` are done, derived from the
    best of them (a second knob swept at the first one's best value: one bisection each); a
    sequence of them sweeps one knob after another, each at the best setting so far."""
    if not knobs or not seeds:
        raise ValueError("system_goodput: expected at least one knob value and one seed")
    points: list[tuple[int, int, float, float]] = []

    def bisect(seed: int, knob: int, lo: float, hi: float) -> float:
        def at(rate: float) -> float:
            a = attainment(rate, seed, knob)
            points.append((seed, knob, rate, a))
            return a

        def many(rates: list[float], then=None) -> list[float]:
            values = attainments(rates, seed, knob, *([then] if then else []))
            points.extend((seed, knob, r, a) for r, a in zip(rates, values, strict=True))
            return values

        wide = many if attainments is not None else None
        return bisect_goodput(
            at, lo, hi, TARGET, rel_tol, max_evals, width, wide, ahead and wide is not None
        ).goodput

    by_knob: dict = {}

    def sweep(values: Sequence[Hashable]) -> None:
        for knob in values:
            if knob in by_knob:
                continue
            best = max(by_knob.values(), default=0.0)
            start = (best / (1 + rel_tol), best * (1 + rel_tol)) if best > 0 else (lo, hi)
            by_knob[knob] = bisect(seeds[0], knob, *start)

    def best_knob() -> Hashable:
        order = list(by_knob)
        return max(order, key=lambda k: (by_knob[k], -order.index(k)))

    sweep(knobs)
    stages = [more_knobs] if callable(more_knobs) else list(more_knobs or ())
    for stage in stages:
        sweep(stage(best_knob()))
    knob = best_knob()
    goodputs = [by_knob[knob]]
    g0 = goodputs[0]
    for seed in seeds[1:]:
        start = (g0 / (1 + rel_tol), g0 * (1 + rel_tol)) if g0 > 0 else (lo, hi)
        goodputs.append(bisect(seed, knob, *start))
    return SystemGoodput(knob, by_knob, goodputs, points)
