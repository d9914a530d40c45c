"""Asynchronous decisions on constructed cases: decode lanes, waiting for a lane that frees
soon, elastic vs fixed splits; memory costs and the preemption victim."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import tokenlake as tl
from tokenlake.scheduler.config import SchedulerConfig
from tokenlake.scheduler.lanes import (
    LANE_GAIN,
    Running,
    decode_step_time,
    lanes_needed,
    prefill_budget,
    split_free_instances,
)
from tokenlake.scheduler.latency_model import DECODE, PREFILL, Coeffs, LatencyModel
from tokenlake.scheduler.memory import future_slots, new_request_cost, pin_cost, victim
from tokenlake.scheduler.request import Phase, Request

C = 16
# a decode batch of n steps takes 10 ms + 1 ms per step
MODEL = LatencyModel({1: Coeffs(1e-3, 1e-5, 0)}, Coeffs(0.01, 0.001, 0))


def decodes(n: int, ready_at: float = 0.0, first: int = 0) -> list[Request]:
    out = []
    for i in range(n):
        r = Request.create(first + i, np.arange(10, dtype=np.int32), 5, first + i, ready_at)
        r.phase, r.num_stored, r.num_generated = Phase.DECODE, 10, 1
        out.append(r)
    return out


def split(mode="elastic", free=(0, 1, 2, 3), running=(), ready=(), now=0.0, waits=False, **kw):
    kw.setdefault("lane_tbt_fraction", 0.5)  # the cases below count in 50 ms of a 100 ms SLO
    cfg = SchedulerConfig(4, C, mode=mode, sync_iterations=False, **kw)
    live = [0, 1, 2, 3]
    return split_free_instances(
        cfg, MODEL, 0.0, now, live, list(free), running, ready, prefill_waits=waits
    )


def test_lanes_needed_is_the_fewest_within_the_slo_share():
    cfg = SchedulerConfig(4, C, tbt_slo=0.1, lane_tbt_fraction=0.5)  # 50 ms per decode batch
    assert lanes_needed(cfg, MODEL, 0, 4, 0.0) == 0
    assert lanes_needed(cfg, MODEL, 40, 4, 0.0) == 1  # 10 + 40 ms
    assert lanes_needed(cfg, MODEL, 41, 4, 0.0) == 2
    assert lanes_needed(cfg, MODEL, 1000, 4, 0.0) == 4  # none suffices: every instance
    assert lanes_needed(cfg, MODEL, 40, 4, 0.5) == 3  # load doubles it: 14 steps, 48 ms
    no_slo = SchedulerConfig(4, C)
    assert lanes_needed(no_slo, MODEL, 10_000, 4, 0.0) == 1
    for n in range(1, 200, 7):  # the chosen lanes meet the share, one fewer would not
        k = lanes_needed(cfg, MODEL, n, 4, 0.0)
        assert k == 4 or decode_step_time(MODEL, -(-n // k), 0.0) <= 0.05
        assert k == 1 or decode_step_time(MODEL, -(-n // (k - 1)), 0.0) > 0.05


@pytest.mark.parametrize("fixed", [0.01, 0.03, 0.06, 0.1])
def test_lanes_needed_past_the_slo_share_takes_the_fewest_near_the_limits_step(fixed):
    """Brute force over decode counts: when no lane count meets the share, the fewest lanes
    whose step is within LANE_GAIN of the limit's (a fixed cost dominating gives 1 lane)."""
    model = LatencyModel({1: Coeffs(1e-3, 1e-5, 0)}, Coeffs(fixed, 2e-4, 0))
    cfg = SchedulerConfig(4, C, tbt_slo=0.1, lane_tbt_fraction=0.5)
    for n in range(1, 2000, 37):
        for limit in (1, 2, 3, 4):
            steps = {k: decode_step_time(model, -(-n // k), 0.0) for k in range(1, limit + 1)}
            within = [k for k, t in steps.items() if t <= 0.05]
            if not within:
                within = [k for k, t in steps.items() if t <= steps[limit] * (1 + LANE_GAIN)]
            assert lanes_needed(cfg, model, n, limit, 0.0) == min(within)
    if fixed == 0.1:  # 100 ms + 0.2 ms a step: 4 lanes would save 6% of 1 lane's 108 ms
        assert lanes_needed(cfg, model, 40, 4, 0.0) == 1
    if fixed == 0.01:  # 10 ms + 0.2 ms a step, 1,000 steps: only 4 lanes come near 60 ms
        assert lanes_needed(cfg, model, 1000, 4, 0.0) == 4


def test_no_decodes_all_free_instances_prefill():
    s = split()
    assert s.decode_instances == () and s.decodes == () and s.prefill_instances == (0, 1, 2, 3)


def test_one_lane_opens_and_the_rest_prefill():
    s = split(ready=decodes(8), tbt_slo=0.1)
    assert s.decode_instances == (0,) and len(s.decodes) == 8 and s.lane_cap == 8
    assert s.prefill_instances == (1, 2, 3)


def test_many_decodes_open_more_lanes_each_within_the_cap():
    s = split(ready=decodes(100), tbt_slo=0.1)  # 100 steps: 3 lanes of <= 34 (44 ms)
    assert len(s.decode_instances) == 3 and s.lane_cap == 34
    assert len(s.decodes) == 100 and s.prefill_instances == (3,)


def test_ready_decodes_wait_for_a_lane_that_frees_soon():
    lane = Running(DECODE, (0,), 10, predicted_end=0.012)
    prefill = Running(PREFILL, (1,), 0, predicted_end=0.5)
    ready = decodes(3, ready_at=0.0, first=100)  # e.g. prompts that just ended
    s = split(free=(2, 3), running=[lane, prefill], ready=ready, now=0.001, tbt_slo=0.1)
    assert s.decode_instances == () and s.decodes == ()  # join lane 0 at 12 ms
    assert s.prefill_instances == (2, 3)
    # the lane is busy too long for their next token (100 ms SLO): one more lane opens
    slow = Running(DECODE, (0,), 10, predicted_end=0.2)
    s = split(free=(2, 3), running=[slow, prefill], ready=ready, now=0.001, tbt_slo=0.1)
    assert s.decode_instances == (2,) and len(s.decodes) == 3 and s.prefill_instances == (3,)


def test_planned_lanes_leave_an_instance_for_prefill():
    """1,000 decodes want every instance as a lane (none meets the SLO share): three lanes
    open and one instance prefills, as TokenLake-1P3D, whether prefill work waits now or not
    (a prompt arriving next would otherwise wait for a lane's multi-step batch to end)."""
    for waits in (False, True):
        s = split(ready=decodes(1000), tbt_slo=0.1, waits=waits)
        assert s.decode_instances == (0, 1, 2) and s.prefill_instances == (3,)
        assert s.lane_cap == 334 and len(s.decodes) == 1000  # every ready decode has a lane
    fixed = split("xpyd", ready=decodes(1000), tbt_slo=0.1, num_prefill_instances=1)
    assert len(fixed.decode_instances) == 3 and len(fixed.prefill_instances) == 1
    # few decodes: still one lane and three prefill instances (TokenLake-3P1D)
    s = split(ready=decodes(8), tbt_slo=0.1, waits=True)
    assert s.decode_instances == (0,) and s.prefill_instances == (1, 2, 3)


def test_waiting_prefill_stops_the_lane_overshoot_at_n_minus_one():
    """Three lanes busy too long for the ready decodes' next token: a fourth lane opens only
    when nothing waits to prefill; otherwise the free instance prefills and the ready decodes
    wait for a busy lane, as they would on TokenLake-1P3D's three decode instances."""
    lanes = [Running(DECODE, (i,), 30, predicted_end=0.2) for i in range(3)]
    ready = decodes(3, ready_at=0.0, first=100)
    s = split(free=(3,), running=lanes, ready=ready, now=0.001, tbt_slo=0.1)
    assert s.decode_instances == (3,) and len(s.decodes) == 3
    s = split(free=(3,), running=lanes, ready=ready, now=0.001, tbt_slo=0.1, waits=True)
    assert s.decode_instances == () and s.decodes == () and s.prefill_instances == (3,)
    two = lanes[:2] + [Running(PREFILL, (2,), 0, predicted_end=0.5)]
    s = split(free=(3,), running=two, ready=ready, now=0.001, tbt_slo=0.1, waits=True)
    assert s.decode_instances == (3,)  # two lanes busy: the third may still open


def test_one_live_instance_keeps_its_lane():
    cfg = SchedulerConfig(4, C, sync_iterations=False, tbt_slo=0.1)
    s = split_free_instances(cfg, MODEL, 0.0, 0.0, [2], [2], [], decodes(5), prefill_waits=True)
    assert s.decode_instances == (2,) and s.prefill_instances == ()


def test_prefill_budget_per_instance_and_within_the_tbt_slo_while_decoding():
    """``max_prefill_tokens`` per free instance; while requests decode (elastic), cut to the
    segments one instance prefills within the TBT SLO (prefill: 1 ms + 10 us/token)."""
    cfg = SchedulerConfig(4, C, max_prefill_tokens=64 * C, tbt_slo=0.01, sync_iterations=False)
    assert prefill_budget(cfg, MODEL, 1) == 1024 and prefill_budget(cfg, MODEL, 3) == 3072
    assert prefill_budget(cfg, MODEL, 3, decoding=True) == 3 * 896  # 1 + 8.96 ms <= 10 ms
    assert MODEL.predict(PREFILL, [896 + C]) > 0.01
    assert prefill_budget(replace(cfg, tbt_slo=math.inf), MODEL, 2, decoding=True) == 2048
    assert prefill_budget(replace(cfg, tbt_slo=1e-3), MODEL, 2, decoding=True) == 2 * C
    assert prefill_budget(replace(cfg, max_prefill_tokens=0, chunk_len=4 * C), MODEL, 2) == 8 * C


def test_xpyd_keeps_roles():
    ready = decodes(6)
    s = split("xpyd", ready=ready, num_prefill_instances=1)
    assert s.decode_instances == (1, 2, 3) and s.prefill_instances == (0,)
    assert s.lane_cap == 2 and len(s.decodes) == 6
    s = split("xpyd", free=(0,), ready=ready, num_prefill_instances=1)
    assert s.decode_instances == () and s.prefill_instances == (0,)  # decodes wait for D
    s = split("xpyd", free=(2, 3), num_prefill_instances=3)
    assert s.decode_instances == () and s.prefill_instances == (2,)  # 3 stays decode-only


def test_elastic_matches_the_fixed_split_when_one_lane_suffices():
    """With few decodes, elastic is TokenLake-3P1D: one lane, three prefill instances; with
    no SLO pressure the split does not depend on how many decodes there are."""
    for n in (1, 5, 30):
        s = split(ready=decodes(n), tbt_slo=0.5)
        fixed = split("xpyd", ready=decodes(n), num_prefill_instances=3, tbt_slo=0.5)
        assert len(s.decode_instances) == len(fixed.decode_instances) == 1
        assert len(s.prefill_instances) == len(fixed.prefill_instances) == 3


def make(prompt_len, out, phase=Phase.WAITING, stored=0, generated=0, arrival=0):
    r = Request.create(arrival, np.arange(prompt_len, dtype=np.int32) % 50, out, arrival)
    r.phase, r.num_stored, r.num_generated = phase, stored, generated
    return r


def test_future_slots_count_the_rest_of_prompt_and_output():
    r = make(40, 10, Phase.PREFILL, stored=16)  # 50 tokens = 4 segments, holds 1
    assert future_slots(r, 16, C, 1.0) == 3
    assert future_slots(r, 16, C, 0.0) == 2  # 40 tokens = 3 segments
    r = make(40, 10, Phase.DECODE, stored=45, generated=6)  # 46 known, 4 more to come
    assert future_slots(r, 45, C, 1.0) == 1 and future_slots(r, 45, C, 0.0) == 0


def test_new_request_cost_includes_its_pins():
    shape = tl.ModelShape(1, 2, 1, 8)
    pool = tl.Pool(tl.PoolConfig(shape, 1, 16, C))
    ids = np.arange(3 * C + 4, dtype=np.int32)
    plans = pool.gen_plans([[tl.Chunk("a", ids, 0)]])
    pool.commit(plans)
    pool.finish("a")  # 3 sealed segments + a 4-token tail, all unpinned
    r = make(4 * C, 8)
    r.tokens[: 3 * C + 4] = ids
    m = pool.get_prefix_tree().match(r.token_ids)
    assert pin_cost(m, 3 * C + 2, C) == 4  # 3 segments + the partial source
    # writes from the partial segment on: 4C + 8 tokens = 5 segments, 3 cached
    assert new_request_cost(r, m, 3 * C + 2, C, 1.0) == 2 + 4
    plans = pool.gen_plans([[tl.Chunk("b", r.token_ids, 3 * C + 2)]])  # b pins them
    assert pin_cost(m, 3 * C + 2, C) == 0
    pool.abort(plans, executed=False)


def test_victim_is_the_latest_running_arrival():
    reqs = [
        make(10, 2, Phase.DECODE, 10, 1, arrival=0),
        make(10, 2, Phase.PREFILL, 5, 0, arrival=3),
        make(10, 2, Phase.WAITING, arrival=5),  # not running: never a victim
        make(10, 2, Phase.DECODE, 10, 1, arrival=2),
    ]
    assert victim(reqs).arrival == 3
    assert victim(reqs[2:3]) is None
    assert victim(reqs[:1]).arrival == 0


@pytest.mark.parametrize("bad", [0, 1.5, True, "x"])
def test_config_rejects_bad_lane_fraction(bad):
    with pytest.raises(tl.InvalidArgumentError, match="lane_tbt_fraction"):
        SchedulerConfig(2, C, lane_tbt_fraction=bad)


def test_lanes_open_where_the_ready_decodes_kv_lives():
    """A light stream: one ready decode whose KV is on instance 3 gets its lane there (the
    lowest free id otherwise); with several, the oldest decodes' homes come first."""
    one = decodes(1)
    assert split(ready=one).decode_instances == (0,)
    cfg = SchedulerConfig(4, C, sync_iterations=False, tbt_slo=0.1, lane_tbt_fraction=0.5)
    homes = {one[0].request_id: 3}
    s = split_free_instances(cfg, MODEL, 0.0, 0.0, [0, 1, 2, 3], [0, 1, 2, 3], [], one,
                             homes=homes)  # fmt: skip
    assert s.decode_instances == (3,) and s.decodes == tuple(one)
    busy_home = split_free_instances(cfg, MODEL, 0.0, 0.0, [0, 1, 2, 3], [0, 1, 2], [], one,
                                     homes=homes)  # fmt: skip
    assert busy_home.decode_instances == (0,)  # its home runs something else: any free one
    many = decodes(60, ready_at=0.0)
    homes = {r.request_id: 2 if i < 30 else 1 for i, r in enumerate(many)}
    s = split_free_instances(cfg, MODEL, 0.0, 0.0, [0, 1, 2, 3], [0, 1, 2, 3], [], many,
                             homes=homes)  # fmt: skip
    assert s.decode_instances[:2] == (2, 1)
