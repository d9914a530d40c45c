"""The start-up profile is stable by construction: each case is the median of its runs (one
run slowed by another process does not move it), the repeats stop at a time bound (every
case still measured once), the fit is printed as one readable line, and a calibration file
round-trips the model exactly, so a server started from it plans as the one that wrote it.
Times come from a scripted clock: nothing here depends on the machine's speed."""

from __future__ import annotations

import json
import statistics

import pytest

import tokenlake as tl
from tokenlake.errors import InvalidArgumentError
from tokenlake.scheduler import Coeffs, LatencyModel
from tokenlake.scheduler.latency_model import DECODE, PREFILL
from tokenlake.scheduler.profiler import measure_rows

SHAPE = tl.ModelShape(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=8)


class ScriptedRuns:
    """An ``execute`` whose n-th sub-batch takes ``durations[n]`` seconds of ``clock``."""

    def __init__(self, durations):
        self.durations = list(durations)
        self.now = 0.0
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def __call__(self, plans, chunks) -> None:
        self.now += self.durations[self.calls % len(self.durations)]
        self.calls += 1


def test_each_case_is_the_median_of_its_runs():
    pool = tl.Pool(tl.PoolConfig(SHAPE, 1, num_slots=16, segment_len=4))
    runs = ScriptedRuns([0.010, 0.011, 0.500, 0.009, 0.012])  # one run slowed 50x
    cases = [(PREFILL, 1, (8,)), (DECODE, 1, (1, 1))]
    rows = measure_rows(pool, runs, cases, repeats=5, vocab=50, clock=runs.clock,
                        statistic=statistics.median)  # fmt: skip
    assert [r.seconds for r in rows] == pytest.approx([0.011, 0.011])
    fastest = measure_rows(pool, runs, cases[:1], repeats=5, vocab=50, clock=runs.clock)
    assert fastest[0].seconds == pytest.approx(0.009)  # the default stays the minimum
    assert not pool.requests


def test_repeats_stop_at_the_time_bound_but_every_case_runs():
    pool = tl.Pool(tl.PoolConfig(SHAPE, 1, num_slots=16, segment_len=4))
    runs = ScriptedRuns([1.0])
    cases = [(PREFILL, 1, (4 * (i + 1),)) for i in range(6)]
    rows = measure_rows(pool, runs, cases, repeats=5, vocab=50, clock=runs.clock,
                        statistic=statistics.median, max_seconds=7.5)  # fmt: skip
    assert len(rows) == 6 and runs.calls == 5 + 3 + 4 * 1  # 5, then up to 8 s, then once each


def test_one_readable_line_and_a_calibration_file_round_trip(tmp_path):
    from tokenlake.serve.build import load_latency_model

    model = LatencyModel({1: Coeffs(2e-3, 4e-6, 1e-10), 2: Coeffs(3e-3, 2e-6, 5e-11)},
                         Coeffs(1.5e-3, 2e-5, 0.0), hop_s=8e-4)  # fmt: skip
    line = model.summary()
    assert "\n" not in line and "LatencyModel" not in line
    assert line.startswith("prefill DoP 1: 2 ms + 4 us/token + 100 us/ktok^2")
    assert "prefill DoP 2: 3 ms" in line and "decode: 1.5 ms + 20 us/token" in line
    assert line.endswith("hop: 0.8 ms")
    path = tmp_path / "latency.json"
    path.write_text(json.dumps(model.to_dict()))
    loaded = load_latency_model(path)
    assert loaded == model
    assert loaded.table(4).tolist() == model.table(4).tolist()  # the scheduler plans alike
    path.write_text('{"prefill": {"x": [1, 2, 3]}, "decode": [1, 2, 3]}')
    with pytest.raises(InvalidArgumentError, match="latency_model_file"):
        load_latency_model(path)
    path.write_text("not json")
    with pytest.raises(InvalidArgumentError, match="latency_model_file"):
        load_latency_model(path)
