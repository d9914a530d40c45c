"""Bisection runs stop once the SLO attainment cannot reach the target any more: the misses
counted then are certain (a later event cannot undo them), the verdict is the full run's, and
a run that can still pass is not touched."""

import pytest

from tokenlake.benchmarks.sim.metrics import RequestRecord, certain_misses, slo_attainment
from tokenlake.benchmarks.sim.runner import SLO_MISSED, RunConfig, simulate
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.workloads import GENERATORS, GeneratorConfig


def record(output_len=3):
    # solo prefill 1 s, solo decode step 0.1 s: the SLO allows a 10 s TTFT and 1 s gaps
    return RequestRecord(0, 0.0, 1000, output_len, 1.0, (0.1, 0.0))


def emitted(*times, output_len=3):
    r = record(output_len)
    for t in times:
        r.emit(t)
    return r


def test_certain_misses_by_hand():
    rejected = record()
    rejected.rejected = "slo"
    cases = [  # (what, record, now, certain miss)
        ("waiting, still in time", record(), 9.9, False),
        ("waiting past the TTFT bound", record(), 10.1, True),
        ("decoding, gap in time", emitted(1.0), 1.9, False),
        ("decoding, gap past the bound", emitted(1.0), 2.1, True),
        ("a gap already too long", emitted(1.0, 2.5, output_len=4), 2.5, True),
        ("finished within the SLO", emitted(1.0, 1.1, 1.2), 12.0, False),
        ("finished late", emitted(10.5, 10.6, 10.7), 12.0, True),
        ("rejected", rejected, 0.0, True),
    ]
    for what, rec, now, miss in cases:
        assert certain_misses([rec], now) == miss, what
    # by 12 s the two still in time are late too: all but the one finished in time
    assert certain_misses([c[1] for c in cases], 12.0) == 7
    # a certain miss is a miss at the end whatever happens next
    late = emitted(1.0)
    assert certain_misses([late], 2.1) == 1
    late.emit(2.1)
    late.emit(2.2)
    assert slo_attainment([late]) == 0.0


def sharegpt(rate, n=40):
    return GENERATORS["sharegpt"](GeneratorConfig(n, rate, 4096, seed=0))


def run(system, rate, stop_below=0.0):
    spec = ClusterSpec(num_instances=1)  # one instance: a 400 req/s burst overloads every system
    cfg = RunConfig(system, prefill_tokens=2048, window_s=5.0, stop_below=stop_below)
    return simulate(sharegpt(rate), spec, make_timer(spec), cfg)


@pytest.mark.parametrize("system", ["router", "tokenlake"])
def test_an_overloaded_run_stops_early_with_the_full_runs_verdict(system):
    full, cut = run(system, 400.0), run(system, 400.0, stop_below=0.9)
    assert full.stop_reason == "done" and full.summary()["slo_attainment"] < 0.9
    s = cut.summary()
    assert cut.stop_reason == SLO_MISSED and s["slo_attainment"] < 0.9
    assert cut.sim_s < full.sim_s
    assert s["stalled"] == 0 and s["cut"] == s["total"] - s["finished"] - s["rejected"] > 0


def test_a_run_that_can_pass_is_unchanged():
    full, checked = run("router", 0.5), run("router", 0.5, stop_below=0.9)
    assert checked.stop_reason == "done" and full.summary()["slo_attainment"] >= 0.9
    drop = {"wall_s"}
    assert {k: v for k, v in checked.summary().items() if k not in drop} == {
        k: v for k, v in full.summary().items() if k not in drop
    }
