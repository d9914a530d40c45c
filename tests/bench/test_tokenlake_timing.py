"""The simulator's time model of asynchronous TokenLake iterations on constructed cases:
compute and foreign work (queries, puts) sharing an instance delay each other, an iteration
waits for its remote queries, and a moved end is reported so its event can be rescheduled."""

import numpy as np
import pytest

from tokenlake.bench.sim.step_timer import ClusterSpec, make_timer
from tokenlake.bench.sim.tokenlake_timing import TokenLakeTiming
from tokenlake import Chunk, Pool, PoolConfig

SPEC = ClusterSpec(num_instances=4)


def timing(interference=1.0):
    return TokenLakeTiming(make_timer(SPEC), SPEC, 512, interference)


def place(t, own, foreign, now, net=0.0):
    f = np.zeros(4)
    for h, q in foreign.items():
        f[h] = q
    return t.place(own, f, np.full(4, net), now, payload=None)


def test_alone_an_iteration_takes_its_compute_or_its_remote_work():
    t = timing()
    a, moved = place(t, {0: 0.010}, {1: 0.004}, now=1.0)
    assert a.end == pytest.approx(1.010) and not moved
    b, _ = place(t, {2: 0.002}, {3: 0.006}, now=1.0)  # waits for its remote query
    assert b.end == pytest.approx(1.006)
    c, _ = place(t, {3: 0.001}, {}, now=1.0, net=0.003)  # no earlier than its bytes
    assert c.end == pytest.approx(1.003)


def test_a_query_on_a_busy_instance_shares_it():
    t = timing()
    prefill, _ = place(t, {1: 0.300}, {}, now=0.0)
    decode, moved = place(t, {0: 0.008}, {1: 0.004}, now=0.100)
    assert decode.end == pytest.approx(0.108)  # its own 8 ms > the shared 4 ms query (8 ms)
    assert prefill.end == pytest.approx(0.304) and moved == [prefill]  # delayed by 4 ms
    heavy, moved = place(t, {2: 0.001}, {1: 0.010}, now=0.100)  # queued after the 4 ms one
    assert heavy.end == pytest.approx(0.108 + 0.020)
    assert prefill.end == pytest.approx(0.314) and moved == [prefill]


def test_compute_started_on_a_busy_query_engine_is_delayed():
    t = timing()
    place(t, {0: 0.001}, {2: 0.050}, now=0.0)  # instance 2 serves 50 ms of queries
    own, _ = place(t, {2: 0.020}, {}, now=0.010)
    assert own.end == pytest.approx(0.010 + 0.040)  # 20 ms, shared with the backlog


def test_no_interference_means_perfect_overlap():
    t = timing(interference=0.0)
    prefill, _ = place(t, {1: 0.300}, {}, now=0.0)
    decode, moved = place(t, {0: 0.002}, {1: 0.004}, now=0.1)
    assert decode.end == pytest.approx(0.104) and prefill.end == pytest.approx(0.3)
    assert not moved


def test_finished_instances_are_free_again():
    t = timing()
    a, _ = place(t, {1: 0.1}, {}, now=0.0)
    t.finish(a)
    b, moved = place(t, {0: 0.001}, {1: 0.004}, now=0.2)
    assert b.end == pytest.approx(0.204) and not moved


def test_start_reads_real_plans():
    """A decode whose prefix is spread over several holders: the origin's own part and the
    holders' parts are priced with the cost model, reads counted per holder."""
    pool = Pool(PoolConfig(SPEC.mp.shape, 4, 64, 512, namespace="t"))
    ids = np.arange(8 * 512 + 7, dtype=np.int32) % 30000
    plans = pool.gen_plans([[Chunk("a", ids, 0)]], [4])
    pool.commit(plans)
    ids = np.append(ids, 5).astype(np.int32)
    plans = pool.gen_plans([[Chunk("a", ids, len(ids) - 1)]])
    t = timing()
    flight, moved = t.start(plans, False, 0.0, payload="x")
    assert flight.payload == "x" and not moved
    assert flight.reads.sum() == len(ids) - 1  # one row over its cached prefix
    timer = make_timer(SPEC)
    o = plans.query_plans[0].origin
    step = timer.config.decode_overhead_s + timer.forward_time([(0, 1)])
    assert flight.origin_end[o] >= step
    assert flight.end < step + timer.query_time(1, len(ids)) + 1e-3
