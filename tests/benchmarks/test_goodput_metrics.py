"""SLO accounting on hand-built timelines, goodput bisection, load CV."""

import math

import numpy as np
import pytest

from tokenlake.benchmarks.sim.metrics import (
    LoadTimeline,
    RequestRecord,
    bisect_goodput,
    hit_rate,
    slo_attainment,
)


def record(arrival=0.0, input_len=1000, output_len=3, solo_prefill=1.0, solo=(0.1, 0.0)):
    return RequestRecord(0, arrival, input_len, output_len, solo_prefill, solo)


def test_slo_on_hand_built_timeline():
    # TTFT 5 s = 5x the 1 s solo prefill; gaps 0.5 s and 0.9 s vs a 0.1 s solo step.
    r = record()
    for t in (5.0, 5.5, 6.4):
        r.emit(t)
    assert r.finished and r.finish_s == 6.4
    assert r.input_token_latency == pytest.approx(5.0 / 1000)
    assert r.input_ratio == pytest.approx(5.0)
    assert r.max_tbt_s == pytest.approx(0.9)
    assert r.max_tbt_ratio == pytest.approx(9.0)
    assert r.meets_slo(10.0)
    assert not r.meets_slo(8.0)  # the 0.9 s gap is 9x


def test_slo_misses_on_ttft_tbt_and_unfinished():
    slow_first = record()
    for t in (10.5, 10.6, 10.7):
        slow_first.emit(t)
    slow_gap = record()
    for t in (1.0, 1.1, 2.2):  # 1.1 s gap = 11x
        slow_gap.emit(t)
    unfinished = record()
    unfinished.emit(1.0)
    ok = record()
    for t in (1.0, 1.1, 1.2):
        ok.emit(t)
    recs = [slow_first, slow_gap, unfinished, ok]
    assert [r.meets_slo() for r in recs] == [False, False, False, True]
    assert slo_attainment(recs) == 0.25


def test_tbt_ratio_uses_the_context_at_each_token():
    # solo step = 0.1 + 1e-4 * context; second token at context 1001, third at 1002
    r = record(solo=(0.1, 1e-4))
    for t in (1.0, 1.2, 1.3):
        r.emit(t)
    assert r.max_tbt_ratio == pytest.approx(0.2 / (0.1 + 1e-4 * 1001))


def test_hit_rate_weights_tokens():
    a, b = record(input_len=100), record(input_len=300)
    a.hit_tokens, b.hit_tokens = 50, 150
    assert hit_rate([a, b]) == 0.5


def test_load_timeline_cv():
    tl = LoadTimeline(2, window_s=1.0)
    tl.add(0.2, 0, 10)
    tl.add(0.7, 1, 10)  # window 0: [10, 10] -> CV 0
    tl.add(1.5, 0, 30)
    tl.add(1.9, 1, 10)  # window 1: [30, 10] -> CV 0.5
    times, loads = tl.matrix()
    assert times.tolist() == [0.0, 1.0]
    np.testing.assert_array_equal(loads, [[10, 10], [30, 10]])
    assert tl.cv() == pytest.approx(0.25)


@pytest.mark.parametrize("capacity", [0.37, 1.0, 3.3, 12.0])
def test_bisection_finds_the_threshold(capacity):
    res = bisect_goodput(lambda r: 1.0 if r <= capacity else 0.5, lo=1.0, hi=2.0, rel_tol=0.02)
    assert res.goodput <= capacity < res.goodput * 1.02 + 1e-12
    assert all(a == (1.0 if r <= capacity else 0.5) for r, a in res.points)


def test_bisection_gives_zero_when_nothing_passes():
    res = bisect_goodput(lambda r: 0.0, lo=1.0, hi=2.0)
    assert res.goodput == 0.0 and len(res.points) == 4
    assert not math.isnan(res.goodput)
