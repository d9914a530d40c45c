"""Every baseline at its best: SGLang's slru eviction and schedule policies on constructed
cases, Mooncake at every prefill:decode split, its store keeping decode outputs, and the
harness sweeping all of it, one setting after another, to the best."""

from __future__ import annotations

import pytest

from tokenlake.benchmarks.goodput.harness import knobs_of, more_knobs_of, parse_args
from tokenlake.benchmarks.goodput.runs import Setting, knob_label, knob_setting
from tokenlake.benchmarks.sim.confidence import system_goodput
from tokenlake.benchmarks.sim.engine import LPM_MAX_QUEUE, Engine, EngineConfig
from tokenlake.benchmarks.sim.events import EventLoop
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.metrics import LoadTimeline
from tokenlake.benchmarks.sim.runner import RunConfig, make_record, simulate
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.sim.systems.radix_cache import LocalPrefixCache
from tokenlake.benchmarks.sim.systems.systems import (
    SYSTEMS,
    every_split,
    num_prefill,
    split_system,
)
from tokenlake.benchmarks.workloads.request import SimRequest, Workload

B = 512
SPEC = ClusterSpec()
TIMER = make_timer(SPEC)


# ---- SGLang's slru eviction ------------------------------------------------------------------
def _filled(eviction: str) -> LocalPrefixCache:
    """A (2 blocks) inserted by two requests, then B and C (2 blocks each) by one each; A is
    the least recently used."""
    c = LocalPrefixCache(6 * B, eviction)
    c.insert(["a1", "a2"], [B, B], lock=False)
    c.insert(["a1", "a2"], [B, B], lock=False)  # a second request: A reused
    c.insert(["b1", "b2"], [B, B], lock=False)
    c.insert(["c1", "c2"], [B, B], lock=False)
    return c


def test_slru_evicts_what_nobody_reused_before_older_reused_prefixes():
    lru, slru = _filled("lru"), _filled("slru")
    for c in (lru, slru):
        assert c.reserve(2 * B)  # room for a new request: two blocks must go
        c.check_invariants()
    assert lru.match(["a1", "a2"]).num_tokens == 0  # plain LRU: the oldest went
    assert lru.match(["b1", "b2"]).num_tokens == 2 * B
    assert slru.match(["a1", "a2"]).num_tokens == 2 * B  # protected: reused
    assert slru.match(["b1", "b2"]).num_tokens == 0  # the oldest unprotected
    assert slru.match(["c1", "c2"]).num_tokens == 2 * B


def test_slru_counts_one_hit_per_request_and_falls_back_to_lru():
    c = LocalPrefixCache(4 * B, "slru")
    c.insert(["a1", "a2"], [B, B], lock=False)
    # the same request inserting its finished sequence: its prompt is not a second hit
    c.insert(["a1", "a2", "out"], [B, B, B], lock=False, counted=2)
    c.insert(["b1"], [B], lock=False)
    assert c.reserve(3 * B)  # A is unprotected: LRU order among A, out, B
    c.check_invariants()
    assert c.match(["a1"]).num_tokens == 0 and c.match(["b1"]).num_tokens == B
    with pytest.raises(ValueError, match="eviction"):
        LocalPrefixCache(B, "lfu")


# ---- SGLang's schedule policies -------------------------------------------------------------
def _engine(policy: str, cached_blocks: int) -> Engine:
    cache = LocalPrefixCache(SPEC.capacity_tokens)
    cache.insert(list(range(cached_blocks)), [B] * cached_blocks, lock=False)
    cfg = EngineConfig(8 * B, schedule_policy=policy)
    return Engine(0, EventLoop(), TIMER, cache, cfg, LoadTimeline(1), lambda j, t: None)


def _job(rid: int, cached: int, new: int) -> Job:
    """A prompt of ``cached`` blocks of the engine's cache, then ``new`` blocks of its own."""
    blocks = tuple(range(cached)) + tuple(1000 * (rid + 1) + i for i in range(new))
    req = SimRequest(rid, 0.0, len(blocks) * B, 4, blocks)
    return Job(req, make_record(req, 0.0, TIMER), B)


# (rid, cached blocks, new blocks) in arrival order
QUEUE = [(0, 0, 6), (1, 4, 3), (2, 1, 1), (3, 8, 2)]


@pytest.mark.parametrize(
    "policy,first",
    [("fcfs", 0), ("lpm", 3), ("shortest-prefill-first", 2)],
)
def test_schedule_policy_picks_the_first_admitted(policy, first):
    e = _engine(policy, 8)
    for rid, cached, new in QUEUE:
        e.waiting.append(_job(rid, cached, new))
    batch = e._prefill_batch(B)  # room for one request's first chunk
    assert [j.rid for j, _ in batch] == [first]
    # the rest keep the policy's order, FCFS among ties
    want = {
        "fcfs": [1, 2, 3],
        "lpm": [1, 2, 0],  # longest cached prefix first
        "shortest-prefill-first": [3, 1, 0],  # fewest uncached tokens first
    }[policy]
    assert [j.rid for j in e.waiting] == want


def test_lpm_is_fcfs_beyond_sglangs_queue_limit():
    e = _engine("lpm", 8)
    for rid in range(LPM_MAX_QUEUE + 1):
        e.waiting.append(_job(rid, 8 if rid == LPM_MAX_QUEUE else 0, 1))
    assert e._prefill_batch(B)[0][0].rid == 0
    with pytest.raises(ValueError, match="schedule_policy"):
        EngineConfig(schedule_policy="lof")


# ---- Mooncake's splits and its store --------------------------------------------------------
def test_splits_by_name_and_by_knob():
    assert split_system("mooncake-2p2d-tbt") == ("mooncake-2p2d", frozenset({"tbt"}))
    assert split_system("mooncake") == ("mooncake", frozenset())
    assert split_system("mooncake-tbt-no-store") == ("mooncake", frozenset({"tbt", "no-store"}))
    assert num_prefill("mooncake-1p3d", 8) == 2 and num_prefill("mooncake-3p1d", 8) == 6
    assert num_prefill("mooncake-2p2d", 4) == 2 and num_prefill("mooncake", 4) == 2
    assert num_prefill("mooncake", 4, (3, 1)) == 3
    assert every_split(4) == [(1, 3), (2, 2), (3, 1)]
    with pytest.raises(ValueError, match="split"):
        num_prefill("mooncake", 4, (2, 3))
    with pytest.raises(ValueError, match="system"):
        split_system("mooncake-0p4d")
    assert {"mooncake", "mooncake-tbt", "router-tbt", "router-min-load"} <= set(SYSTEMS)


def test_mooncake_store_keeps_a_finished_requests_decode_output():
    """One request through Mooncake with its store: the store ends up holding its prompt and
    its decode output (written from the decode node)."""
    req = SimRequest(0, 0.0, 4 * B, 300, tuple(range(4)))
    spec = ClusterSpec(num_instances=4)
    for split in every_split(4):
        cfg = RunConfig("mooncake", split=split)
        res = simulate(Workload("t", (req,), B), spec, make_timer(spec), cfg)
        assert res.records[0].finished
        assert res.extra["store_tokens"] == 4 * B + 300


# ---- the harness sweeps every setting ---------------------------------------------------------
def test_the_sweep_finds_the_best_split_policy_and_eviction():
    """A known capacity per setting: the harness's stages (chunk, split, schedule policy,
    eviction, each at the best so far) end at the best combination of them."""
    args = parse_args(["--workload", "conversation", "--baseline-prefill-tokens", "2048,8192"])
    split_gain = {(1, 3): 1.5, (2, 2): 1.0, (3, 1): 0.8}
    policy_gain = {None: 1.0, "lpm": 1.2, "shortest-prefill-first": 1.1}

    def capacity(knob) -> float:
        k = knob_setting(knob)
        chunk = 1.1 if k.prefill == 8192 else 1.0
        return chunk * split_gain[k.split] * policy_gain[k.schedule] * (1.05 if k.eviction else 1)

    def attainment(rate: float, seed: int, knob) -> float:
        return 1.0 if rate <= capacity(knob) else 0.5

    knobs, stages = knobs_of(args, "mooncake"), more_knobs_of(args, "mooncake")
    assert knobs == [Setting(2048, split=(2, 2)), Setting(8192, split=(2, 2))]
    g = system_goodput(attainment, knobs, [0], 0.25, 1.0, 0.02, 20, more_knobs=stages)
    assert g.knob == Setting(8192, None, (1, 3), "lpm", "slru")
    assert knob_label(g.knob) == "8192 1P3D lpm slru"
    assert g.goodputs[0] == pytest.approx(capacity(g.knob), rel=0.02)
    assert len(g.by_knob) == 2 + 2 + 2 + 1  # chunks, other splits, policies, eviction
    # the router sweeps its thresholds, then the policies and the eviction; TokenLake none
    assert len(more_knobs_of(args, "router")) == 3 and more_knobs_of(args, "tokenlake") == []
