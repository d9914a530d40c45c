"""``tokenlake goodput --jobs``: runs in worker processes give the same runs as one at a time,
and the wide bisection (several rates per round) finds the same threshold as the sequential
one within its tolerance, against a known step function."""

from __future__ import annotations

import json
import math

import pytest

from tokenlake.benchmarks.goodput.harness import main
from tokenlake.benchmarks.sim.metrics import bisect_goodput


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
        "--baseline-schedule-policies",  # the chunk and threshold sweeps are enough here
        "fcfs",
        "--baseline-evictions",
        "lru",
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


def test_a_run_in_flight_is_shared_not_repeated():
    """Two threads asking for one key get one run (reported once); a run that may stop early
    does not answer a request for the full run, and a full run answers one that may stop."""
    from concurrent.futures import ThreadPoolExecutor

    from tokenlake.benchmarks.goodput.harness import make_workload, parse_args
    from tokenlake.benchmarks.goodput.runs import RunKey, Runs
    from tokenlake.benchmarks.sim.step_timer import ClusterSpec

    args = parse_args(["--workload", "sharegpt", "--requests", "30", "--jobs", "2"])
    spec = ClusterSpec(args.hardware, args.model, args.instances, args.tp)
    reported: list[tuple[float, float]] = []
    runs = Runs(args, make_workload, lambda res, key: reported.append(key[:6]), jobs=2)
    try:
        full = RunKey("router", 3.0, 0, 2048, spec)
        with ThreadPoolExecutor(2) as threads:
            a, b = threads.map(runs.one, [full, full])
        assert a is b and reported == [full[:6]]
        # in flight with an early stop: the full run is its own run
        early = RunKey("tokenlake", 500.0, 0, 2048, spec, 0.9)
        late = RunKey("tokenlake", 500.0, 0, 2048, spec)
        with ThreadPoolExecutor(2) as threads:
            first = threads.submit(runs.one, early)
            second = threads.submit(runs.one, late)
            first.result(), second.result()
        assert sorted(reported[1:]) == sorted([early[:6], late[:6]])
        # kept: asking again runs nothing
        assert runs.one(late) is second.result() and len(reported) == 3
    finally:
        runs.close()


class _HeldExecutor:
    """An executor whose runs end when the test says so; records what it was handed."""

    def __init__(self) -> None:
        from concurrent.futures import Future

        self._future = Future
        self.handed: list = []  # (rate, future) in the order runs were handed over

    def submit(self, fn, args, make_workload, key):
        fut = self._future()
        fut.set_running_or_notify_cancel()
        self.handed.append((key.rate, fut))
        return fut

    def shutdown(self, cancel_futures: bool = False) -> None:
        pass


def test_waiting_runs_start_lowest_rate_first():
    """With every worker busy, the waiting run at the lowest rate (the longest replay) starts
    first, whatever order the runs were asked for in; a worker never holds two runs."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from tokenlake.benchmarks.goodput.harness import make_workload, parse_args
    from tokenlake.benchmarks.goodput.runs import RunKey, Runs
    from tokenlake.benchmarks.sim.step_timer import ClusterSpec

    args = parse_args(["--workload", "sharegpt", "--requests", "30"])
    spec = ClusterSpec(args.hardware, args.model, args.instances, args.tp)
    pool = _HeldExecutor()
    reported: list = []
    runs = Runs(args, make_workload, lambda res, key: reported.append(key.rate), 1, pool)
    rates = [2.0, 3.0, 0.5, 1.0]

    def wait_for(cond) -> None:
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cond()

    with ThreadPoolExecutor(len(rates)) as threads:
        results = []
        for i, rate in enumerate(rates):  # the first takes the only worker, the rest wait
            results.append(threads.submit(runs.one, RunKey("router", rate, 0, 2048, spec)))
            wait_for(lambda i=i: len(pool.handed) + runs.num_waiting == i + 1)
        assert len(pool.handed) == 1  # one worker: one run at a time
        for step in range(len(rates)):
            wait_for(lambda step=step: len(pool.handed) == step + 1)
            pool.handed[step][1].set_result(SimpleNamespace(stop_reason="done"))
        for r in results:
            r.result(timeout=10)
    assert [rate for rate, _ in pool.handed] == [2.0, 0.5, 1.0, 3.0]
    assert sorted(reported) == sorted(rates)
    runs.close()


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("capacity", [0.37, 1.0, 1.7, 3.3, 12.0])
def test_ahead_names_the_next_round_and_changes_no_probe(width, capacity):
    """``then`` of a round, given that round's real outcomes, is the next round's rates
    (``[]`` after the last); the rates probed are those of the search without it."""
    rounds: list[tuple[list[float], object]] = []

    def attainments(rates, then=None):
        rounds.append((list(rates), then))
        return [1.0 if r <= capacity else 0.5 for r in rates]

    res = bisect_goodput(
        None, 1.0, 2.0, rel_tol=0.02, max_evals=12, width=width, attainments=attainments,
        ahead=True,
    )  # fmt: skip
    plain = bisect_goodput(
        None, 1.0, 2.0, rel_tol=0.02, max_evals=12, width=width, attainments=_step(capacity, [])
    )
    assert res.points == plain.points and res.goodput == plain.goodput
    bisecting = [i for i, (_, then) in enumerate(rounds) if then is not None]
    assert bisecting and bisecting == list(range(bisecting[0], len(rounds)))
    for i in bisecting:
        rates, then = rounds[i]
        attained = {r: 1.0 if r <= capacity else 0.5 for r in rates}
        following = rounds[i + 1][0] if i + 1 < len(rounds) else []
        assert then(attained) == following
        # nothing known yet: the next round as if every rate passes
        assert then({}) == then({r: 1.0 for r in rates})


def test_an_idle_worker_starts_the_next_run_ahead():
    """With a worker idle, the run a waiting caller would ask for next (if its run passes)
    starts at once; asked for later it is that run, reported once; never asked for, it is
    not reported."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from tokenlake.benchmarks.goodput.harness import make_workload, parse_args
    from tokenlake.benchmarks.goodput.runs import RunKey, Runs
    from tokenlake.benchmarks.sim.step_timer import ClusterSpec

    args = parse_args(["--workload", "sharegpt", "--requests", "30"])
    spec = ClusterSpec(args.hardware, args.model, args.instances, args.tp)
    pool = _HeldExecutor()
    reported: list = []
    runs = Runs(args, make_workload, lambda res, key: reported.append(key.rate), 2, pool)
    first, second, third = (RunKey("router", r, 0, 2048, spec, 0.9) for r in (1.0, 1.5, 1.2))
    seen: list[dict] = []

    def then(known):
        seen.append(dict(known))
        return [second] if not known else [third]

    def wait_for(cond) -> None:
        deadline = time.monotonic() + 10
        while not cond() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cond()

    with ThreadPoolExecutor(1) as threads:
        asked = threads.submit(runs.many, [first], then)
        wait_for(lambda: len(pool.handed) == 2)
        assert [rate for rate, _ in pool.handed] == [1.0, 1.5] and runs.num_ahead == 1
        assert runs.num_ahead_used == 0
        assert seen == [{}]  # nothing known while the first run goes
        pool.handed[0][1].set_result(SimpleNamespace(stop_reason="done"))
        asked.result(timeout=10)
        assert reported == [1.0]  # the run started ahead is not reported until asked for
        later = threads.submit(runs.one, second)
        time.sleep(0.1)
        assert len(pool.handed) == 2  # the same run, not a new one
        pool.handed[1][1].set_result(SimpleNamespace(stop_reason="done"))
        assert later.result(timeout=10) is pool.handed[1][1].result()
    assert reported == [1.0, 1.5] and runs.num_ahead == runs.num_ahead_used == 1
    runs.close()
