"""Asynchronous iterations end to end: the scheduler keeps several iterations in flight on a
real Pool + LocalCluster, they run and complete in any order, and every query row equals
monolithic causal attention; memory pressure preempts the latest arrival and every request
still finishes, FCFS, exactly."""

from __future__ import annotations

import numpy as np
import pytest
from harness import tokens
from scheduler_cases import LATENCY, SHAPE, C

import tokenlake as tl
from tokenlake.engines.client.synthetic import SyntheticModel, run_iteration
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.scheduler import (
    DECODE,
    PREFILL,
    ElasticScheduler,
    SchedulerConfig,
)
from tokenlake.scheduler.request import Phase


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Driver:
    """Runs the scheduler asynchronously: launch every iteration ``step`` offers, then
    execute and complete one in flight (chosen by ``rng``), checking every row."""

    def __init__(self, num_instances, num_slots, seed=0, check=True, **cfg) -> None:
        self.check = check
        self.pool = tl.Pool(tl.PoolConfig(SHAPE, num_instances, num_slots, segment_len=C))
        self.cluster = LocalCluster(self.pool)
        self.synth = SyntheticModel(SHAPE, seed=1)
        self.clock = Clock()
        cfg.setdefault("chunk_len", 2 * C)
        config = SchedulerConfig(num_instances, C, sync_iterations=False, **cfg)
        self.sched = ElasticScheduler(config, LATENCY, self.pool, clock=self.clock)
        self.rng = np.random.default_rng(seed)
        self.inflight = []
        self.max_inflight = 0
        self.max_err = 0.0
        self.expected: dict = {}
        self.finished: list = []
        self.outputs: dict = {}
        self.preempted: dict = {}
        self.origins_after_loss: list = []

    def add(self, rid, prompt, n_out) -> None:
        self.sched.add_request(rid, prompt, n_out)
        self.expected[rid] = (len(prompt), n_out)

    def launch(self) -> None:
        while (it := self.sched.step()) is not None:
            self.check_disjoint(it)
            self.inflight.append(it)
            if len(self.pool.live_instances) < self.pool.config.num_instances:
                self.origins_after_loss.append(it.plans.origins)
        self.max_inflight = max(self.max_inflight, len(self.inflight))

    def check_disjoint(self, it) -> None:
        mine = {c.request_id for c in it.decision.chunks}
        for other in self.inflight:
            assert not mine & {c.request_id for c in other.decision.chunks}
            assert not set(it.plans.origins) & set(other.plans.origins)
        for b, phase in enumerate(it.decision.phases):
            assert len(it.decision.batches) == 1  # one batch per asynchronous iteration
            assert phase in (PREFILL, DECODE, "mixed") and (
                phase == PREFILL or it.decision.dops[b] == 1
            )

    def run_one(self, it=None) -> None:
        if it is None:
            it = self.inflight[int(self.rng.integers(len(self.inflight)))]
        self.inflight.remove(it)
        chunks = {c.request_id: c for c in it.decision.chunks}
        for r in run_iteration(self.cluster, it.plans, chunks, self.synth):
            if not self.check:
                continue
            o, lse = self.synth.reference(chunks[r.request_id].token_ids, r.first, r.end, r.layer)
            err = max(float((o - r.o).abs().max()), float((lse - r.lse).abs().max()))
            self.max_err = max(self.max_err, err)
        self.clock.now += 0.001 * (1 + self.rng.random())
        for req in self.sched.complete(it):
            assert len(req.output_ids) == self.expected[req.request_id][1]
            self.finished.append(req.request_id)
            self.outputs[req.request_id] = req.output_ids
            self.preempted[req.request_id] = req.num_preemptions
        self.cluster.retire(it.plans.epoch)
        self.pool.check_invariants()

    def drain(self, max_rounds=5000, arrivals=None) -> None:
        rounds = 0
        arrivals = dict(arrivals or {})
        while self.sched.has_work or arrivals:
            rounds += 1
            assert rounds < max_rounds, "no progress"
            for rid, prompt, n_out in arrivals.pop(rounds, []):
                self.add(rid, prompt, n_out)
            self.launch()
            if self.inflight:
                self.run_one()
        assert not self.inflight and not self.pool.requests


@pytest.mark.parametrize(
    "mode,num_instances,extra",
    [
        ("elastic", 1, {}),
        ("elastic", 2, {"tbt_slo": 0.01}),
        ("elastic", 4, {"tbt_slo": 0.01, "input_token_slo": 1e-3}),
        ("xpyd", 4, {"num_prefill_instances": 1}),
        ("xpyd", 4, {"num_prefill_instances": 3}),
        ("colocated", 3, {}),
    ],
)
def test_async_iterations_are_exact_in_any_order(mode, num_instances, extra):
    d = Driver(num_instances, 96, seed=num_instances, mode=mode, **extra)
    doc = tokens(0, 3 * C + 5)
    for i in range(6):
        d.add(f"a{i}", np.concatenate([doc, tokens(10 + i, 7 + 13 * i)]), 2 + i % 3)
    later = {
        5: [(f"b{i}", np.concatenate([doc, tokens(20 + i, 40 + i)]), 3) for i in range(3)],
        9: [(f"c{i}", tokens(30 + i, 5 + i), 4) for i in range(3)],
    }
    d.drain(arrivals=later)
    assert d.max_err <= 1e-5
    assert sorted(d.finished) == sorted(d.expected)
    if num_instances > 1:
        assert d.max_inflight >= 2, "several iterations in flight"
    stats = d.pool.get_stats()
    assert stats["num_iterations_in_flight"] == 0


def test_async_decodes_do_not_wait_for_prefill():
    """A long prefill in flight does not hold the decodes: the lane decodes again as soon as
    its batch completes, and a request finishes all its tokens while the long prompt's
    first chunk is still in flight."""
    d = Driver(4, 200, mode="elastic", chunk_len=8 * C, tbt_slo=0.05)
    d.add("short", tokens(2, 5), 6)
    d.launch()
    d.run_one()  # its prompt: first token out, now in decode
    d.add("long", tokens(1, 40 * C), 1)
    d.launch()
    long_its = [it for it in d.inflight if it.decision.chunks[0].request_id == "long"]
    assert len(long_its) == 1 and long_its[0].decision.phases == (PREFILL,)
    for _ in range(5):  # the remaining 5 tokens, each its own decode iteration
        lane = [it for it in d.inflight if it.decision.phases[0] == DECODE]
        assert len(lane) == 1 and lane[0].decision.chunks[0].request_id == "short"
        assert not set(lane[0].plans.origins) & set(long_its[0].plans.origins)
        d.run_one(lane[0])
        d.launch()
        assert long_its[0] in d.inflight  # the prefill has not completed
    assert d.finished == ["short"]
    d.drain()
    assert d.finished == ["short", "long"] and d.max_err <= 1e-5


def test_preemption_under_an_adversarial_burst():
    """Admission reserves no output (``output_reserve=0``, vLLM-style), so a burst of requests
    with long outputs overfills the pool: the scheduler preempts the latest arrivals instead
    of failing, they recompute from their cached prefix, and every request finishes with
    exactly the tokens a solo run gives (the synthetic tokens depend only on the prefix)."""
    d = Driver(2, 6, seed=3, mode="elastic", output_reserve=0.0, kv_watermark=0.0)
    prompts = {f"r{i}": tokens(100 + i, 20 + 3 * i) for i in range(5)}
    for rid, prompt in prompts.items():
        d.add(rid, prompt, 24)  # 2 slots each at admission, 3..4 at the end: > 12
    d.drain()
    assert d.max_err <= 1e-5
    assert d.sched.num_preemptions > 0
    assert sorted(d.finished) == sorted(prompts)
    assert d.preempted["r0"] == 0  # the oldest is never preempted for a younger one
    solo = Driver(1, 20, check=False, mode="elastic")
    for rid, prompt in prompts.items():
        solo.add(rid, prompt, 24)
    solo.drain()
    for rid in prompts:
        assert np.array_equal(d.outputs[rid], solo.outputs[rid])


def test_running_request_too_large_for_the_pool_is_refused():
    d = Driver(2, 4, mode="elastic")
    with pytest.raises(tl.InvalidArgumentError, match="prompt"):
        d.add("big", tokens(1, 8 * C), 2)
    d.add("fits", tokens(1, 7 * C), 1)  # 7 segments + its output in the 8th
    d.drain()
    assert d.finished == ["fits"]


def test_request_preempted_keeps_its_priority():
    d = Driver(2, 8, mode="elastic", output_reserve=0.0, kv_watermark=0.0)
    for i in range(4):  # 2 slots each admitted, 5 each at the end: 20 > 16
        d.add(i, tokens(200 + i, 30), 50)
    d.drain()
    assert d.sched.num_preemptions > 0
    assert sorted(d.finished) == [0, 1, 2, 3]
    assert d.preempted[0] == 0  # the oldest is never preempted for a younger one
    assert d.preempted[3] >= d.preempted[1]  # the latest arrival goes first


def test_preempt_recovers_requests_whose_kv_was_lost():
    """``preempt`` is also the recovery path when an instance dies: the pool fails the
    requests whose KV was only there, the scheduler sends them back to waiting, and they
    recompute (from what is still cached) and finish exactly on the surviving instances."""
    d = Driver(3, 64, mode="elastic", tbt_slo=0.05)
    doc = tokens(7, 4 * C)
    for i in range(4):
        d.add(i, np.concatenate([doc, tokens(50 + i, 9 + 5 * i)]), 6)
    for _ in range(6):
        d.launch()
        d.run_one(d.inflight[0])
    while d.inflight:  # nothing in flight may use the instance being dropped
        d.run_one(d.inflight[0])
    failed = d.pool.drop_instance(2)
    assert failed, "some request held KV only on instance 2"
    for rid in failed:
        d.sched.preempt(rid)
        assert d.sched.request(rid).num_stored == 0
    with pytest.raises(tl.InvalidArgumentError, match="in flight"):
        d.launch()
        d.sched.preempt(d.inflight[0].decision.chunks[0].request_id)
    d.drain()
    assert sorted(d.finished) == [0, 1, 2, 3] and d.max_err <= 1e-5
    assert all(2 not in it_origins for it_origins in d.origins_after_loss)


def test_multi_step_decode_is_exact_and_gives_the_same_tokens():
    """``decode_steps`` > 1 runs several decode steps per iteration on synthetic tokens: every
    row is still exact, and every request ends with the tokens one step at a time gives."""
    prompts = {f"m{i}": tokens(300 + i, 9 + 7 * i) for i in range(4)}
    outs = {}
    for steps in (1, 4):
        d = Driver(2, 64, seed=5, mode="elastic", decode_steps=steps)
        for rid, prompt in prompts.items():
            d.add(rid, prompt, 11)
        d.launch()
        d.drain()
        assert d.max_err <= 1e-5 and sorted(d.finished) == sorted(prompts)
        outs[steps] = d.outputs
    for rid in prompts:
        assert np.array_equal(outs[1][rid], outs[4][rid])


def test_multi_step_refuses_sampled_tokens():
    d = Driver(2, 64, mode="elastic", decode_steps=4)
    d.add("x", tokens(9, 5), 8)
    d.launch()
    d.run_one()  # the prompt
    d.launch()
    it = d.inflight[0]
    assert it.decision.chunks[0].num_new_tokens == 4
    with pytest.raises(tl.InvalidArgumentError, match="new_token_ids"):
        d.sched.complete(it, {"x": 3})
    d.drain()


def test_decode_step_time_is_calibrated_on_measured_iterations():
    """Decode iterations that take twice the model's time make the scheduler plan with twice
    the step time (fewer steps per multi-step iteration, more lanes if needed)."""
    d = Driver(2, 64, mode="elastic", decode_steps=8, tbt_slo=1.0)
    d.add("x", tokens(9, 5), 200)
    d.launch()
    d.run_one()
    scales = []
    for _ in range(5):
        d.launch()
        it = d.inflight[0]
        d.clock.now = it.started_at + 2 * it.predicted_end - 2 * it.started_at
        d.inflight.remove(it)
        d.sched.complete(it)
        scales.append(d.sched._deciding.decode_scale)
    assert scales[0] == pytest.approx(1.2) and scales[-1] > 1.7
    assert all(a < b for a, b in zip(scales, scales[1:], strict=False))


def test_new_request_prefills_while_many_requests_decode():
    """A TBT SLO no lane count meets makes every decode want a lane of its own; still, a new
    request that arrives while eight requests decode gets an instance for its prompt before
    any of them finishes (one instance stays out of the lanes while prefill work waits)."""
    d = Driver(4, 400, seed=5, mode="elastic", tbt_slo=1e-4)
    olds = [f"d{i}" for i in range(8)]
    for i, rid in enumerate(olds):
        d.add(rid, tokens(50 + i, 20), 40)
    for _ in range(200):
        d.launch()
        if all(d.sched.request(r).phase is Phase.DECODE for r in olds):
            break
        d.run_one()
    assert all(d.sched.request(r).phase is Phase.DECODE for r in olds)
    d.add("new", tokens(1, 3 * C), 2)
    started = False
    for _ in range(12):
        d.launch()
        if any(c.request_id == "new" for it in d.inflight for c in it.decision.chunks):
            started = True
            break
        d.run_one()
    assert started and not d.finished
    d.drain()
    assert sorted(d.finished) == sorted([*olds, "new"]) and d.max_err <= 1e-5


@pytest.mark.parametrize("mode,extra", [("elastic", {}), ("xpyd", {"num_prefill_instances": 3})])
def test_prefill_budget_is_per_free_instance(mode, extra):
    """``max_prefill_tokens`` is each free instance's prefill budget in an asynchronous
    decision (the baselines' chunked-prefill size is per instance too), not a share of a
    cluster-wide budget (a quarter of it on each of four elastic instances): four free
    elastic instances (three prefill ones in 3P1D) start one 2-segment prompt each at once."""
    d = Driver(4, 400, mode=mode, chunk_len=2 * C, max_prefill_tokens=2 * C, **extra)
    for i in range(8):
        d.add(i, tokens(300 + i, 2 * C), 2)
    d.launch()
    started = {c.request_id for it in d.inflight for c in it.decision.chunks}
    prefill_instances = 4 if mode == "elastic" else 3
    assert len(started) == prefill_instances
    d.drain()
    assert sorted(d.finished) == list(range(8)) and d.max_err <= 1e-5
