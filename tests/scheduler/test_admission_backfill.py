"""Admission backfill: a new request that does not fit in memory yet is passed over by later ones
that fit, until its first-token deadline passes; then admission blocks behind it (so it cannot
starve), and without an input-token SLO admission always blocks (FCFS)."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_cases import LATENCY, SHAPE, C

import tokenlake as tl
from tokenlake.scheduler import ElasticScheduler, SchedulerConfig

RNG = np.random.default_rng(3)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _tokens(n: int) -> np.ndarray:
    return RNG.integers(0, 1000, n).astype(np.int32)


def _setup(backfill: bool, slo: float | None):
    """Two instances of 8 slots; a running request holding 10 of the 16."""
    pool = tl.Pool(tl.PoolConfig(SHAPE, 2, 8, segment_len=C))
    extra = {} if slo is None else {"input_token_slo": slo}
    config = SchedulerConfig(2, C, chunk_len=16 * C, admission_backfill=backfill, **extra)
    clock = Clock()
    sched = ElasticScheduler(config, LATENCY, pool, clock=clock)
    sched.add_request("running", _tokens(9 * C), 4)  # 10 slots with its output
    sched.complete(sched.step())
    return sched, clock


def _admitted(sched) -> set:
    """New requests in the next (synchronous) iteration, which is then completed."""
    it = sched.step()
    sched.complete(it)
    return {c.request_id for c in it.decision.chunks} - {"running"}


def _run_to_end(sched, max_steps: int = 200) -> set:
    """Step and complete (bounded) until nothing is left to run; the ids that finished."""
    done = set()
    for _ in range(max_steps):
        it = sched.step()
        if it is None:
            break
        done |= {r.request_id for r in sched.complete(it)}
    return done


@pytest.mark.parametrize(("backfill", "slo"), [(True, 1.0), (False, 1.0), (True, None)])
def test_a_request_that_does_not_fit_is_passed_over_until_its_deadline(backfill, slo):
    sched, clock = _setup(backfill, slo)
    sched.add_request("big", _tokens(7 * C), 2)  # 8 slots: does not fit beside "running"
    clock.now = 6 * C  # small's first-token deadline comes after big's (EDF keeps big first)
    sched.add_request("small", _tokens(C + 4), 2)  # 2 slots: fits
    if not (backfill and slo):
        assert _admitted(sched) == set()  # blocked behind "big" (FCFS)
        return
    assert _admitted(sched) == {"small"}
    clock.now = 7 * C * slo + 1.0  # past big's first-token deadline: admission blocks behind it
    sched.add_request("late", _tokens(C + 4), 2)
    assert not _admitted(sched) & {"big", "late"}  # late would fit, but waits behind big


def test_a_new_request_that_does_not_fit_does_not_hold_back_a_running_prefill():
    """Running prefills keep their deadline order with new requests; one due later than a new
    request that does not fit in memory still gets its chunks (FCFS blocks only later new
    requests), and both finish."""
    pool = tl.Pool(tl.PoolConfig(SHAPE, 2, 8, segment_len=C))
    config = SchedulerConfig(2, C, chunk_len=C, input_token_slo=1.0, admission_backfill=False)
    sched = ElasticScheduler(config, LATENCY, pool, clock=Clock())
    sched.add_request("running", _tokens(6 * C), 4)  # due at 6C, ~7 of the 16 slots
    sched.complete(sched.step())  # its first chunk: now a running prefill
    sched.add_request("big", _tokens(5 * C), 6 * C)  # due first (5C), needs 11 slots: no room
    it = sched.step()
    assert {c.request_id for c in it.decision.chunks} == {"running"}
    sched.complete(it)
    done = _run_to_end(sched)
    assert done == {"running", "big"}
    pool.check_invariants()


def test_a_cached_turn_held_back_by_memory_leaves_the_budget_to_the_running_prefill():
    """One instance of 5 slots: a second request reusing a running prefill's first chunk is a
    cached turn (chosen first) that does not fit beside it; the prefill budget it was given
    goes back to the running prefill, which finishes, and then the cached turn runs (the
    state machine found this stall: the held-back turn had taken the whole budget)."""
    pool = tl.Pool(tl.PoolConfig(SHAPE, 1, 5, segment_len=C))
    config = SchedulerConfig(1, C, chunk_len=2 * C, output_reserve=0.0)
    sched = ElasticScheduler(config, LATENCY, pool, clock=Clock())
    doc = _tokens(3 * C + 4)
    sched.add_request("first", doc, 1)
    sched.add_request("second", doc.copy(), 1)
    done = _run_to_end(sched)
    assert done == {"first", "second"} and not sched.has_work
    pool.check_invariants()
