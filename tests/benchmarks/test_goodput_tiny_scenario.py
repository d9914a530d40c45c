"""A tiny deterministic scenario whose timeline and metrics are worked out by hand."""

import pytest

from tokenlake.benchmarks.sim.runner import RunConfig, simulate
from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.benchmarks.workloads.request import SimRequest, Workload


class FakeTimer:
    """prefill 0.1 s + 1 ms per new token; decode 0.05 s; a P->D transfer 0.2 s."""

    def prefill_time(self, new_lens, prefix_lens):
        return 0.1 + 0.001 * sum(new_lens)

    def decode_time(self, ctx_lens):
        return 0.05

    def transfer_time(self, num_bytes, same_node=False):
        return 0.2


# A: blocks (0, 1), 3 output tokens, at t=0. B: blocks (0, 2) shares A's first block, 2 output
# tokens, at t=0.5.
WORKLOAD = Workload(
    "tiny",
    (SimRequest(0, 0.0, 1024, 3, (0, 1)), SimRequest(1, 0.5, 1024, 2, (0, 2))),
    block_size=512,
)


def run(system, n, mixed_chunk=False):
    spec = ClusterSpec(num_instances=n, cache_tokens=100_000)
    cfg = RunConfig(system, window_s=10.0, mixed_chunk=mixed_chunk)
    return simulate(WORKLOAD, spec, FakeTimer(), cfg)


def test_router_one_instance_by_hand():
    res = run("router", 1)
    a, b = res.records
    # A prefills 1024 tokens: 0.1 + 1.024 = 1.124. B then prefills 512 new tokens (block 0 is
    # cached): 1.124 + 0.612 = 1.736 (prefill first, A waits). Then decode [A, B] at 1.786
    # (B done), decode [A] at 1.836.
    assert a.first_token_s == pytest.approx(1.124)
    assert b.first_token_s == pytest.approx(1.736)
    assert b.finish_s == pytest.approx(1.786)
    assert a.finish_s == pytest.approx(1.836)
    assert a.max_tbt_s == pytest.approx(0.662)
    assert (a.hit_tokens, b.hit_tokens) == (0, 512)
    assert res.summary()["hit_rate"] == 0.25
    # A's 0.662 s gap is 13.2x the 0.05 s solo decode step: A misses the SLO, B meets it.
    assert a.max_tbt_ratio == pytest.approx(13.24)
    assert b.input_ratio == pytest.approx(1.236 / 1.124)
    assert [r.meets_slo() for r in res.records] == [False, True]
    # KV read (rows x stored prefix, the pool's definition): B's chunk 512 x 512; decode
    # [A, B] reads both prompts, 1024 + 1024; decode [A] reads 1025; one instance.
    _, loads = res.load.matrix()
    assert loads.tolist() == [[512 * 512 + 1024 + 1024 + 1025]]


def test_router_mixed_chunked_prefill_by_hand():
    res = run("router", 1, mixed_chunk=True)
    a, b = res.records
    # A prefills alone: 1.124. B's 512 new tokens then run with A's decode step in one mixed
    # batch of 513 tokens: 1.124 + 0.613 = 1.737 (A's second token and B's first). Then one
    # decode of [A, B] at 1.787 finishes both.
    assert a.first_token_s == pytest.approx(1.124)
    assert b.first_token_s == pytest.approx(1.737)
    assert a.finish_s == b.finish_s == pytest.approx(1.787)
    assert a.max_tbt_s == pytest.approx(0.613)  # vs 0.662 without mixing


def test_mooncake_1p1d_by_hand():
    res = run("mooncake-1p3d", 2)  # 1:3 of 2 instances rounds to 1P1D
    a, b = res.records
    # A: prefill 0 -> 1.124; its KV streams from the prefill's start (0.2 s on the NICs), so
    # it has arrived when the prefill ends: first token 1.124, decode 1.174, 1.224.
    assert a.first_token_s == pytest.approx(1.124)
    assert a.finish_s == pytest.approx(1.224)
    # B: prefill 512 new tokens 1.124 -> 1.736 (block 0 cached), KV streamed by then; decode
    # 1.786.
    assert b.first_token_s == pytest.approx(1.736)
    assert b.finish_s == pytest.approx(1.786)
    assert (a.hit_tokens, b.hit_tokens) == (0, 512)
    assert all(r.meets_slo() for r in res.records)


def test_the_run_stops_at_the_horizon():
    spec = ClusterSpec(num_instances=1, cache_tokens=100_000)
    res = simulate(WORKLOAD, spec, FakeTimer(), RunConfig("router", horizon_s=1.0))
    assert res.truncated and res.sim_s <= 1.5 + 1e-9  # last arrival 0.5 + horizon 1.0
    assert not any(r.finished for r in res.records)
    assert (res.stop_reason, res.num_stalled, res.summary()["stalled"]) == ("horizon", 2, 2)
