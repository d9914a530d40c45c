"""A new request whose next uncached segment another request's prefill is computing waits for
that commit (SGLang's in-batch prefix caching) instead of computing the segment again: in an
asynchronous iteration in flight, and within one synchronous decision. Checked against the
pool's own prefix tree: after the wait, the request starts where the other's chunk ended."""

from __future__ import annotations

import numpy as np
import pytest
from scheduler_cases import LATENCY, SHAPE, C

import tokenlake as tl
from tokenlake.errors import InvalidArgumentError
from tokenlake.scheduler import Coeffs, ElasticScheduler, LatencyModel, SchedulerConfig
from tokenlake.scheduler.pending import PendingPrefixes

RNG = np.random.default_rng(7)
DOC = RNG.integers(0, 1000, 6 * C).astype(np.int32)
# DoP 2 costs a second more: every prefill runs on one instance, the other stays free
DOP1 = LatencyModel({1: LATENCY.coeffs("prefill", 1), 2: Coeffs(1.0, 0.0, 0.0)}, LATENCY.decode)


def _prompt(tail_len: int, doc=DOC) -> np.ndarray:
    return np.concatenate([doc, RNG.integers(0, 1000, tail_len).astype(np.int32)])


def test_pending_segments_match_by_whole_prefix():
    pending = PendingPrefixes(C)
    a = _prompt(5)
    pending.add(a, 0, 4 * C)  # segments 0..3 of the document are being computed
    assert pending.covers(_prompt(3), 0)
    assert pending.covers(_prompt(3), 3 * C + 2)  # a partial cached tail inside segment 3
    assert not pending.covers(_prompt(3), 4 * C)  # segment 4 is nobody's chunk
    # same segment tokens at the same place after a different prefix: not the same segment
    other = _prompt(3, np.concatenate([DOC[:C] + 1, DOC[C:]]))
    assert not pending.covers(other, 2 * C)
    assert not pending.covers(a[: 2 * C + 3], 2 * C)  # only a partial tail left to compute


def _scheduler(sync: bool, defer: bool = True, num_instances: int = 2):
    pool = tl.Pool(tl.PoolConfig(SHAPE, num_instances, 64, segment_len=C))
    config = SchedulerConfig(
        num_instances, C, chunk_len=8 * C, sync_iterations=sync, defer_pending_prefix=defer
    )
    return ElasticScheduler(config, DOP1, pool), pool


def _starts(it) -> dict:
    return {c.request_id: (c.start, c.end) for c in it.decision.chunks}


def _all_starts(sched) -> dict:
    """Chunks of every iteration ``step`` hands out now."""
    out = {}
    while (it := sched.step()) is not None:
        out.update(_starts(it))
    return out


@pytest.mark.parametrize("defer", [True, False])
def test_async_request_waits_for_a_prefix_in_flight(defer):
    sched, pool = _scheduler(sync=False, defer=defer)
    sched.add_request("a", _prompt(5), 2)
    first = sched.step()
    assert _starts(first) == {"a": (0, 6 * C + 5)}
    sched.add_request("b", _prompt(7), 2)  # the same document, while a computes it
    second = sched.step()
    if not defer:  # it computes the document a second time, on the other instance
        assert _starts(second) == {"b": (0, 6 * C + 7)}
        return
    assert second is None  # a free instance, and b waits
    sched.complete(first)
    assert _all_starts(sched)["b"] == (6 * C, 6 * C + 7)  # the document is cached now
    assert pool.get_prefix_tree().match(_prompt(0)).num_tokens == 6 * C


def test_sync_decision_defers_the_second_request_of_a_shared_prefix():
    sched, _ = _scheduler(sync=True)
    sched.add_request("a", _prompt(5), 2)
    sched.add_request("b", _prompt(7), 2)
    sched.add_request("c", RNG.integers(0, 1000, 2 * C).astype(np.int32), 2)
    it = sched.step()
    assert set(_starts(it)) == {"a", "c"}
    sched.complete(it)
    it = sched.step()  # a decodes; b starts from the cached document
    assert _starts(it)["b"] == (6 * C, 6 * C + 7)


def test_the_setting_is_validated():
    with pytest.raises(InvalidArgumentError, match="defer_pending_prefix"):
        SchedulerConfig(2, C, defer_pending_prefix=1)
