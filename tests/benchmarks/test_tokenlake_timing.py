"""The simulator's time model of asynchronous TokenLake iterations on constructed cases:
work on one instance shares its GPU (processor sharing), an iteration waits for all of its
work, and a delayed iteration is reported so its completion can be rescheduled."""

import numpy as np
import pytest

from tokenlake import Chunk, Pool, PoolConfig
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.sim.systems.tokenlake_timing import SharedGPU, TokenLakeTiming

SPEC = ClusterSpec(num_instances=4)


def timing():
    return TokenLakeTiming(make_timer(SPEC), SPEC, 512)


def place(t, work, now, net=0.0):
    w = np.zeros(4)
    for i, x in work.items():
        w[i] = x
    return t.place(w, net, now)


def test_alone_an_iteration_takes_its_longest_work():
    t = timing()
    a, moved = place(t, {0: 0.010, 1: 0.004}, now=1.0)
    assert a.end == pytest.approx(1.010) and not moved
    b, _ = place(t, {2: 0.001}, now=1.0, net=0.003)  # no earlier than its bytes
    assert b.end == pytest.approx(1.003)


def test_shared_instance_processor_sharing():
    t = timing()
    prefill, _ = place(t, {1: 0.300}, now=0.0)
    # a decode whose 4 ms query runs on instance 1 (busy): 8 ms at half speed
    decode, moved = place(t, {0: 0.006, 1: 0.004}, now=0.100)
    assert decode.end == pytest.approx(0.108)
    assert prefill.end == pytest.approx(0.304) and moved == [prefill]  # delayed by 4 ms
    t.finish(decode)
    third, moved = place(t, {1: 0.010}, now=0.200)  # 0.096 s of prefill left: shared
    assert third.end == pytest.approx(0.220) and prefill.end == pytest.approx(0.314)
    assert moved == [prefill]


def test_shared_gpu_finishes_in_order_and_frees_capacity():
    gpu = SharedGPU()
    a, b, c = object(), object(), object()
    gpu.add(a, 1.0)
    gpu.add(b, 3.0)
    ends = gpu.finishes()
    assert ends[a] == pytest.approx(2.0) and ends[b] == pytest.approx(4.0)  # 1+1, then 2 alone
    gpu.advance(1.0)  # both half done with 0.5 each
    assert gpu.tasks[a] == pytest.approx(0.5) and gpu.tasks[b] == pytest.approx(2.5)
    gpu.add(c, 0.5)
    ends = gpu.finishes()
    assert ends[a] == pytest.approx(2.5) and ends[c] == pytest.approx(2.5)
    assert ends[b] == pytest.approx(4.5)  # 3 s of work from 0 plus 1.5 shared
    gpu.advance(10.0)
    assert not gpu.tasks


def test_finished_instances_are_free_again():
    t = timing()
    a, _ = place(t, {1: 0.1}, now=0.0)
    t.finish(a)
    b, moved = place(t, {0: 0.001, 1: 0.004}, now=0.2)
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
    step = timer.config.decode_overhead_s + timer.forward_time([(0, 1)])
    assert flight.end >= step
    assert flight.end < step + timer.query_time(1, len(ids)) + 1e-3
