"""Hypothesis state machine: arrivals, asynchronous steps, completions and aborts in any
order, cancellations and memory pressure (preemption) against a real Pool + LocalCluster.
After every rule the pool's invariants hold, the scheduler and the pool agree on which
requests run, iterations in flight are disjoint; every executed row equals monolithic
attention; at the end every request that was not cancelled finishes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import tokenlake as tl
from tokenlake.engines.client.synthetic import SyntheticModel, run_iteration
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.scheduler import Coeffs, ElasticScheduler, LatencyModel, SchedulerConfig
from tokenlake.scheduler.request import Phase

C = 8
SHAPE = tl.ModelShape(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8)
LATENCY = LatencyModel({1: Coeffs(1e-3, 1e-5, 1e-8)}, Coeffs(1e-3, 1e-4, 0.0))
DOCS = [np.random.default_rng(s).integers(0, 500, 3 * C + 3).astype(np.int32) for s in range(2)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_instances=st.integers(1, 3),
        mode=st.sampled_from(["elastic", "xpyd", "colocated"]),
        output_reserve=st.sampled_from([0.0, 1.0]),
        num_slots=st.integers(5, 9),
    )
    def setup(self, num_instances, mode, output_reserve, num_slots):
        if mode == "xpyd" and num_instances < 2:
            mode = "elastic"
        self.pool = tl.Pool(tl.PoolConfig(SHAPE, num_instances, num_slots, C))
        self.cluster = LocalCluster(self.pool)
        self.synth = SyntheticModel(SHAPE, seed=2)
        self.now = 0.0
        cfg = SchedulerConfig(
            num_instances,
            C,
            mode=mode,
            chunk_len=2 * C,
            num_prefill_instances=1 if mode == "xpyd" else 0,
            sync_iterations=False,
            tbt_slo=0.05,
            output_reserve=output_reserve,
        )
        self.sched = ElasticScheduler(cfg, LATENCY, self.pool, clock=lambda: self.now)
        self.inflight = []
        self.next_id = 0
        self.cancelled = set()
        self.finished = set()
        self.max_err = 0.0

    @rule(doc=st.integers(-1, 1), extra=st.integers(1, 3 * C), out=st.integers(1, 20))
    def add(self, doc, extra, out):
        tail = np.random.default_rng(1000 + self.next_id).integers(0, 500, extra)
        prompt = tail.astype(np.int32) if doc < 0 else np.concatenate([DOCS[doc], tail])
        capacity = self.pool.config.num_slots * self.pool.config.num_instances
        if -(-(len(prompt) + out) // C) > capacity:  # refused: larger than the whole pool
            with pytest.raises(tl.InvalidArgumentError, match="prompt"):
                self.sched.add_request(self.next_id, prompt.astype(np.int32), out)
            return
        self.sched.add_request(self.next_id, prompt.astype(np.int32), out)
        self.next_id += 1

    @rule()
    def step(self):
        while (it := self.sched.step()) is not None:
            self.inflight.append(it)

    @precondition(lambda self: self.inflight)
    @rule(pick=st.integers(0, 100))
    def complete(self, pick):
        self._run(self.inflight.pop(pick % len(self.inflight)))

    @precondition(lambda self: self.inflight)
    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        it = self.inflight.pop(pick % len(self.inflight))
        self.sched.abort(it)
        self.cluster.retire(it.plans.epoch)

    @rule(pick=st.integers(0, 100))
    def cancel(self, pick):
        busy = {c.request_id for it in self.inflight for c in it.decision.chunks}
        idle = [r for r in self.sched._requests if r not in busy]
        if idle:
            rid = idle[pick % len(idle)]
            self.sched.cancel(rid)
            self.cancelled.add(rid)

    def _run(self, it):
        chunks = {c.request_id: c for c in it.decision.chunks}
        for r in run_iteration(self.cluster, it.plans, chunks, self.synth):
            o, lse = self.synth.reference(chunks[r.request_id].token_ids, r.first, r.end, r.layer)
            err = max(float((o - r.o).abs().max()), float((lse - r.lse).abs().max()))
            self.max_err = max(self.max_err, err)
        self.now += 0.003
        for req in self.sched.complete(it):
            assert len(req.output_ids) == req.max_output_tokens
            self.finished.add(req.request_id)
        self.cluster.retire(it.plans.epoch)

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        assert self.max_err <= 1e-5
        running = {
            rid
            for rid, r in self.sched._requests.items()
            if r.phase in (Phase.PREFILL, Phase.DECODE)
        }
        busy_new = set()
        seen, origins = set(), set()
        for it in self.inflight:
            ids = {c.request_id for c in it.decision.chunks}
            assert not ids & seen and not set(it.plans.origins) & origins
            seen |= ids
            origins |= set(it.plans.origins)
            busy_new |= {
                c.request_id
                for c in it.decision.chunks
                if self.sched.request(c.request_id).phase is Phase.WAITING
            }
        assert set(self.pool.requests) == running | busy_new
        for rid in running - seen:
            assert self.pool.num_stored_tokens(rid) == self.sched.request(rid).num_stored

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for _ in range(2000):
            self.step()
            if not self.inflight:
                break
            self._run(self.inflight.pop(0))
        assert not self.sched.has_work and not self.inflight
        assert self.finished | self.cancelled == set(range(self.next_id))
        assert not self.pool.requests
        self.pool.check_invariants()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=12,
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
