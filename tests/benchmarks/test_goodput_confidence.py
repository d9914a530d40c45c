"""Goodput with a knob sweep and repeat seeds: the best knob is chosen on the first seed, the
other seeds are bisected at it, and a win needs non-overlapping ranges."""

import pytest

from tokenlake.benchmarks.sim.confidence import SystemGoodput, system_goodput

# capacity of a fake system (req/s) by knob, and a per-seed factor
CAPACITY = {2048: 1.0, 4096: 3.0, 8192: 2.0}
SEED_FACTOR = {0: 1.0, 1: 0.8, 2: 1.1}


def attainment(rate, seed, knob):
    return 1.0 if rate <= CAPACITY[knob] * SEED_FACTOR[seed] else 0.5


def test_best_knob_on_seed_zero_then_every_seed_at_it():
    g = system_goodput(attainment, [2048, 4096, 8192], [0, 1, 2], 0.25, 1.0, rel_tol=0.02)
    assert g.knob == 4096
    for knob, cap in CAPACITY.items():
        assert g.by_knob[knob] <= cap < g.by_knob[knob] * 1.02 + 1e-9
    for got, seed in zip(g.goodputs, [0, 1, 2], strict=True):
        assert got <= 3.0 * SEED_FACTOR[seed] < got * 1.02 + 1e-9
    assert g.median == g.goodputs[0] and g.low == g.goodputs[1] and g.high == g.goodputs[2]
    assert {k for s, k, _, _ in g.points if s > 0} == {4096}  # later seeds only at the best


def test_ties_keep_the_first_knob():
    g = system_goodput(lambda r, s, k: 1.0 if r <= 2 else 0.0, [2048, 8192], [0], 1, 2, 0.1)
    assert g.knob == 2048


@pytest.mark.parametrize(
    "a, b, wins",
    [([2.0, 2.2, 2.5], [1.0, 1.5, 1.9], True), ([2.0, 2.2, 2.5], [1.0, 1.5, 2.1], False)],
)
def test_a_win_needs_disjoint_ranges(a, b, wins):
    ga, gb = SystemGoodput(0, {}, a), SystemGoodput(0, {}, b)
    assert ga.beats(gb) is wins and not gb.beats(ga)
