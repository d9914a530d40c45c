"""Honest runs: every request ends finished, rejected or stalled, and the counts say which; a
stall is warned about; TokenLake's admission keeps running requests within the pool, so it
finishes contexts larger than one instance instead of stalling."""

import argparse
import functools

import pytest

from tokenlake.benchmarks.goodput.report import GoodputReport
from tokenlake.benchmarks.sim import runner
from tokenlake.benchmarks.sim.runner import RunConfig, simulate
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.sim.systems.tokenlake_system import TokenLakeConfig, TokenLakeSystem
from tokenlake.benchmarks.workloads.request import SimRequest, Workload

B = 512


def blocks(start, n):
    return tuple(range(start, start + n))


def sessions(num_sessions=3, turns=3, first=10, growth=2, output=64):
    """Closed-loop sessions whose contexts grow past ``first`` blocks by ``growth`` a turn."""
    reqs = []
    for s in range(num_sessions):
        prefix, prev = blocks(1000 * s, first), -1
        for k in range(turns):
            ids = prefix + blocks(1000 * s + 500 + 10 * k, growth if k else 0)
            rid = len(reqs)
            reqs.append(SimRequest(rid, 0.5 * s, len(ids) * B, output, ids, s, prev, 1.0))
            prefix, prev = ids, rid
    return Workload("sessions", tuple(reqs), B)


def run(system, workload, n=4, capacity=4096, **kw):
    spec = ClusterSpec(num_instances=n, cache_tokens=capacity)
    return simulate(workload, spec, make_timer(spec), RunConfig(system, window_s=5.0, **kw))


def test_tokenlake_finishes_contexts_larger_than_one_instance():
    w = sessions()  # contexts 5K-7K tokens: one instance holds 4K, the pool 16K
    res = run("tokenlake", w)
    assert (res.num_finished, res.num_rejected, res.num_stalled) == (9, 0, 0)
    assert res.stop_reason == "done" and res.extra["pool_full_stalls"] == 0
    # the router cannot hold them at all: each first turn is rejected, its session dropped
    res = run("router", w)
    assert (res.num_finished, res.num_rejected, res.num_stalled) == (0, 9, 0)
    assert {r.rejected for r in res.records} == {"too_large", "session"}
    assert res.summary()["slo_attainment"] == 0.0


def test_a_request_larger_than_the_pool_is_rejected_not_stalled():
    w = Workload("big", (SimRequest(0, 0.0, 40 * B, 8, blocks(0, 40)),), B)
    res = run("tokenlake", w)  # 40 blocks > the 4 x 8 slots of the pool
    assert res.records[0].rejected == "too_large" and res.stop_reason == "done"


def test_a_stall_is_counted_and_warned(monkeypatch, capsys):
    # A system that never runs anything: requests are submitted, nothing is left to happen.
    monkeypatch.setattr(TokenLakeSystem, "_kick", lambda self: None)
    w = sessions(num_sessions=4, turns=1, first=6, output=1500)
    res = run("tokenlake", w, n=2)
    assert res.stop_reason == "stalled"
    assert res.num_stalled == 4 and res.num_finished == 0
    assert res.summary()["stalled"] == res.num_stalled
    args = argparse.Namespace(workload="sessions", trace=None, out="", seed=0)
    GoodputReport(args, ClusterSpec()).run(res, 1.0, 0, 8192, ClusterSpec())
    err = capsys.readouterr().err
    assert f"WARNING: tokenlake on sessions at 1 req/s, seed 0: {res.num_stalled} of 4" in err


@pytest.mark.parametrize("output_reserve", [1.0, 0.0])
def test_the_same_overload_finishes(monkeypatch, output_reserve):
    # the scheduler admits within the pool (reserving the outputs, or not and preempting)
    loose = functools.partial(TokenLakeConfig, output_reserve=output_reserve)
    monkeypatch.setattr(runner, "TokenLakeConfig", loose)
    w = sessions(num_sessions=4, turns=1, first=6, output=1500)
    res = run("tokenlake", w, n=2)
    assert (res.num_finished, res.num_stalled, res.stop_reason) == (4, 0, "done")


@pytest.mark.parametrize("system", ["router", "mooncake-1p3d", "tokenlake"])
def test_counts_add_up(system):
    w = sessions(num_sessions=2, turns=2, first=4)
    res = run(system, w, capacity=8192)
    s = res.summary()
    assert s["finished"] + s["rejected"] + s["stalled"] == s["total"] == 4
