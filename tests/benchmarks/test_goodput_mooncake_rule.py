"""The Mooncake baseline follows the Conductor of the Mooncake paper (Algorithm 1, §3.1, §4.2,
§4.3.2), checked rule by rule on constructed cases with a hand-computable timer."""

import math

import pytest

from tokenlake.benchmarks.sim.engine import Engine, EngineConfig
from tokenlake.benchmarks.sim.events import EventLoop
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.metrics import LoadTimeline, RequestRecord
from tokenlake.benchmarks.sim.runner import RunConfig, simulate
from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.benchmarks.sim.systems.mooncake import Conductor, ConductorConfig
from tokenlake.benchmarks.sim.systems.radix_cache import LocalPrefixCache
from tokenlake.benchmarks.workloads.request import SimRequest, Workload

B = 512


class FakeTimer:
    """prefill 0.1 s + 1 ms per new token; decode 0.05 s + 1e-6 s per context token; a KV
    transfer 0.2 s (the Conductor-only tests pass their own fetch cost)."""

    def prefill_time(self, new_lens, prefix_lens):
        return 0.1 + 0.001 * sum(new_lens)

    def decode_time(self, ctx_lens):
        return 0.05 + 1e-6 * sum(ctx_lens)

    def transfer_time(self, num_bytes, same_node=False):
        return 0.2


def job(rid, blocks, output_len=4, solo_prefill=1.0):
    req = SimRequest(rid, 0.0, len(blocks) * B, output_len, tuple(blocks))
    rec = RequestRecord(rid, 0.0, req.input_len, output_len, solo_prefill, (0.05, 1e-6))
    return Job(req, rec, B)


def cluster(
    num_prefill=2, num_decode=2, capacity=100_000, config=None, fetch=lambda n, s, d: 1e-4 * n
):
    loop, timer, load = EventLoop(), FakeTimer(), LoadTimeline(num_prefill + num_decode)

    def engine(i, role):
        cfg = EngineConfig(8192, role=role)
        return Engine(i, loop, timer, LocalPrefixCache(capacity), cfg, load, lambda j, t: None)

    prefill = [engine(i, "prefill") for i in range(num_prefill)]
    decode = [engine(num_prefill + i, "decode") for i in range(num_decode)]
    return Conductor(prefill, decode, timer, fetch, config), prefill, decode


def cache(engine, *blocks):
    engine.cache.insert(list(blocks), [B] * len(blocks), lock=False)


def queue(engine, new_tokens):
    """Queue a prompt of ``new_tokens`` uncached tokens on an idle engine (it stays waiting)."""
    engine.busy = True  # no step runs: the work just sits in the queue
    engine.submit(job(99, list(range(1000, 1000 + new_tokens // B))))


def test_longest_local_prefix_wins_when_queues_are_equal():
    c, (p0, p1), _ = cluster(config=ConductorConfig(kvcache_balancing_threshold=10.0))
    cache(p1, 1, 2, 3)
    cache(p0, 1)
    choice = c.select_prefill([1, 2, 3, 4], 4 * B)
    # p0: ratio 3/1 <= 10, own prefix 512: 0.1 + 1.536 = 1.636; p1: 0.1 + 0.512 = 0.612
    assert (choice.instance, choice.prefix_len, choice.fetch_from) == (1, 3 * B, -1)
    assert choice.ttft == pytest.approx(0.612)


def test_queue_time_sends_a_request_away_from_its_cache():
    c, (p0, p1), _ = cluster(config=ConductorConfig(kvcache_balancing_threshold=10.0))
    cache(p1, 1, 2, 3)
    cache(p0, 1)
    queue(p1, 2 * B)  # T_queue on p1 = 0.1 + 1.024
    choice = c.select_prefill([1, 2, 3, 4], 4 * B)
    # p1: 1.124 + 0.612 = 1.736 > p0: 1.636
    assert (choice.instance, choice.prefix_len) == (0, B)
    assert choice.ttft == pytest.approx(1.636)


def test_fetching_the_best_prefix_beyond_the_balancing_threshold():
    c, (p0, p1), _ = cluster()  # threshold 1.0
    cache(p1, 1, 2, 3)
    queue(p1, 2 * B)
    choice = c.select_prefill([1, 2, 3, 4], 4 * B)
    # p0 holds nothing (ratio infinite): fetch 3 blocks from p1 (0.1536 s), then 0.612
    assert (choice.instance, choice.fetch_from, choice.fetch_tokens) == (0, 1, 3 * B)
    assert choice.prefix_len == 3 * B and choice.ttft == pytest.approx(0.1536 + 0.612)


def test_no_fetch_when_the_local_prefix_is_within_the_threshold():
    c, (p0, p1), _ = cluster(config=ConductorConfig(kvcache_balancing_threshold=4.0))
    cache(p1, 1, 2, 3)
    cache(p0, 1)
    queue(p1, 2 * B)
    choice = c.select_prefill([1, 2, 3, 4], 4 * B)
    assert (choice.instance, choice.fetch_from, choice.prefix_len) == (0, -1, B)  # 3 <= 4


def test_decode_instance_with_the_lowest_predicted_tbt_that_can_hold_it():
    c, _, (d0, d1) = cluster()
    c.assigned[0].add(job(7, list(range(50, 60))))  # d0 already holds a 5120-token context
    j = job(1, [1, 2])
    assert c.select_decode(j) == (1, pytest.approx(0.05 + 1e-6 * 2 * B))
    small = cluster(capacity=3 * B)[0]
    assert small.select_decode(job(2, [1, 2, 3])) == (-1, math.inf)  # 1536 + 4 tokens > cap


def test_early_rejection_on_predicted_ttft_or_tbt():
    c, _, _ = cluster()
    j = job(1, [1, 2], solo_prefill=0.1)  # TTFT SLO 1.0 s; TBT SLO 10 x (0.05 + 1e-6 x 1024)
    assert not c.rejects(j, ttft=0.9, tbt=0.5)
    assert c.rejects(j, ttft=1.1, tbt=0.5)
    assert c.rejects(j, ttft=0.9, tbt=0.52)
    off = cluster(config=ConductorConfig(early_rejection=False))[0]
    assert not off.rejects(j, ttft=100.0, tbt=100.0)


def run(requests, n=2, capacity=100_000):
    w = Workload("t", tuple(requests), B)
    spec = ClusterSpec(num_instances=n, cache_tokens=capacity)
    return simulate(w, spec, FakeTimer(), RunConfig("mooncake-1p3d", window_s=10.0))


def test_a_request_missing_its_slo_is_rejected_before_any_work():
    # 1P1D: A (16 blocks) occupies the prefill instance; B needs 1 block and arrives right
    # after: its predicted TTFT (A's 8.292 s queue + 0.612 s) > 10 x its 0.612 s solo prefill.
    a = SimRequest(0, 0.0, 16 * B, 2, tuple(range(16)))
    b = SimRequest(1, 0.01, B, 2, (100,))
    res = run([a, b])
    ra, rb = res.records
    assert ra.finished and rb.rejected == "slo" and not rb.finished
    assert (res.num_finished, res.num_rejected, res.num_stalled) == (1, 1, 0)


def test_decode_admission_waits_for_memory_fcfs():
    # decode capacity 3 blocks: A (2 blocks + 100 output tokens) and B cannot decode together
    a = SimRequest(0, 0.0, 2 * B, 100, (1, 2))
    b = SimRequest(1, 0.0, 2 * B, 3, (3, 4))
    res = run([a, b], capacity=3 * B)
    ra, rb = res.records
    assert ra.finished and rb.finished
    # B's KV arrives at 2.248 (after both prefills) but B decodes only once A has finished
    assert rb.first_token_s == pytest.approx(2.248)
    assert ra.finish_s < rb.last_token_s
    assert rb.max_tbt_s > ra.finish_s - rb.first_token_s - 1e-9


def test_fetched_prefix_stays_cached_on_the_chosen_instance():
    spec = ClusterSpec(num_instances=4, cache_tokens=100_000)
    # 3P1D: A warms prefill 0 with blocks 0..7; B and C share them and arrive while prefill 0
    # is busy with a long D, so they fetch the prefix to another prefill instance
    reqs = [
        SimRequest(0, 0.0, 8 * B, 2, tuple(range(8))),
        SimRequest(1, 5.0, 30 * B, 2, tuple(range(100, 130))),
        SimRequest(2, 5.01, 9 * B, 2, tuple(range(8)) + (200,)),
        SimRequest(3, 5.02, 9 * B, 2, tuple(range(8)) + (201,)),
    ]
    w = Workload("t", tuple(reqs), B)
    # without the DRAM store, which would serve the prefix instead
    res = simulate(w, spec, FakeTimer(), RunConfig("mooncake-3p1d-no-store", window_s=10.0))
    assert res.extra["prefix_fetches"] >= 1
    assert all(r.finished for r in res.records)
    assert [r.hit_tokens for r in res.records][2:] == [8 * B, 8 * B]
