"""``tokenlake goodput --jobs``: runs in worker processes give the same runs as one at a time,
and the wide bisection (several rates per round) finds the same threshold as the sequential
one within its tolerance, against a known step function."""

from __future__ import annotations

import json
import math

import pytest

from tokenlake.bench.goodput import main
from tokenlake.bench.sim.metrics import bisect_goodput


def _step(capacity: float, calls: list[list[float]]):
    def attainments(rates: list[float]) -> list[float]:
        calls.append(list(rates))
        return [1.0 if r <= capacity else 0.5 for r in rates]

    return attainments


@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("capacity", [0.05, 0.37, 1.0, 1.7, 3.3, 12.0, 40.0])
def test_wide_bisection_brackets_the_threshold(width, capacity):
    calls: list[list[float]] = []
    res = bisect_goodput(
        None, 1.0, 2.0, rel_tol=0.02, max_evals=40, width=width, attainments=_step(capacity, calls)
    )
    seq = bisect_goodput(
        lambda r: 1.0 if r <= capacity else 0.5, 1.0, 2.0, rel_tol=0.02, max_evals=40
    )
    if capacity < 1 / 8:  # 4 halvings fail in both
        assert res.goodput == seq.goodput == 0.0
    elif capacity >= 16:  # 4 doublings pass in both: a lower bound at 16
        assert res.goodput == seq.goodput == 16.0
    else:
        assert res.goodput <= capacity < res.goodput * 1.02 + 1e-12
    assert all(len(c) <= width for c in calls) and calls[0] == [1.0, 2.0]
    assert [r for c in calls for r in c] == [r for r, _ in res.points]


def test_wide_bisection_keeps_to_max_evals_and_needs_attainments():
    calls: list[list[float]] = []
    res = bisect_goodput(
        None, 1.0, 8.0, rel_tol=0.001, max_evals=5, width=2, attainments=_step(3.0, calls)
    )
    assert len(res.points) == 5 and [len(c) for c in calls] == [2, 2, 1]
    assert 1.0 <= res.goodput <= 3.0 and not math.isnan(res.goodput)
    with pytest.raises(ValueError, match="attainments"):
        bisect_goodput(lambda r: 1.0, 1.0, 2.0, width=2)


def _lines(out: str) -> list[dict]:
    rows = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    for r in rows:
        r.pop("wall_s", None)
    return rows


def test_jobs_run_the_same_runs(capsys):
    args = [
        "--workload",
        "sharegpt",
        "--requests",
        "40",
        "--systems",
        "tokenlake,router",
        "--prefill-tokens",
        "2048",
        "--seeds",
        "1",
        "--goodput",
        "--lo",
        "2",
        "--hi",
        "8",
        "--max-evals",
        "4",
    ]
    assert main(args) == 0
    one = _lines(capsys.readouterr().out)
    assert main(args + ["--jobs", "2"]) == 0  # one process per system: the same bisections
    two = _lines(capsys.readouterr().out)
    key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
    assert sorted(map(key, one)) == sorted(map(key, two)) and len(one) >= 6


def test_jobs_is_validated(capsys):
    with pytest.raises(SystemExit):
        main(["--workload", "sharegpt", "--jobs", "0"])
    assert "--jobs: expected >= 1, got 0" in capsys.readouterr().err
