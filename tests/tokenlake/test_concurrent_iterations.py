"""Several iterations in flight: a hypothesis state machine interleaves overlapping
iterations (each over its own requests and free instances), their execution on the
in-process cluster, partial executions, commits and aborts in any order, finishes, evictions
(a small pool), replication, and instance drops and restores. After every step the pool's
invariants hold (``check_invariants``: slot owners, pins, readers, no iteration reading or
writing another's pending slots); every executed row matches monolithic attention; an abort
right after planning brings back the exact state; a rejected call changes nothing.
Targeted interleavings: tests/tokenlake/test_concurrent_scenarios.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import Harness, tokens
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pool_state import assert_restored, assert_same_state, pool_state

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.errors import IterationStateError, PoolFullError

SEG = 8
DOCS = [tokens(500 + i, SEG * (2 + i) + 3) for i in range(3)]


class InFlight:
    def __init__(self, plans, batches, snapshot, mutation) -> None:
        self.plans = plans
        self.batches = batches
        self.executed = "no"  # "no", "partial", "full"
        self.snapshot = snapshot  # pool state before gen_plans
        self.mutation = mutation  # the pool's mutation count right after gen_plans


class ConcurrentIterations(RuleBasedStateMachine):
    h: Harness | None = None
    eviction: tl.EvictionConfig | None = None  # the pool's default policy

    @initialize(
        num_instances=st.integers(2, 4),
        num_slots=st.integers(4, 10),
        replicate=st.booleans(),
    )
    def setup(self, num_instances, num_slots, replicate):
        balancer = BalancerConfig(
            window=4, interval=1, overload_factor=1.0, max_replica_fraction=0.5, replicate=replicate
        )
        self.h = Harness(
            num_instances, SEG, num_slots=num_slots, balancer=balancer, eviction=self.eviction
        )
        self.pool = self.h.pool
        self.tokens: dict = {}  # running request -> every token known
        self.inflight: dict[int, InFlight] = {}
        self.dropped: set[int] = set()
        self.next_id = 0
        self.mutations = 0  # successful pool mutations, to know when an abort can be exact

    # ---- helpers -------------------------------------------------------------------------
    def idle_requests(self) -> list:
        return [r for r in self.tokens if self.pool.in_flight_epoch(r) is None]

    def rejected(self, call, *errors) -> None:
        before = pool_state(self.pool)
        with pytest.raises(errors):
            call()
        assert_same_state(before, pool_state(self.pool))

    # ---- planning ------------------------------------------------------------------------
    @rule(data=st.data())
    def plan(self, data):
        free = list(self.pool.free_instances)
        idle = self.idle_requests()
        chunks = []
        for rid in data.draw(
            st.lists(st.sampled_from(idle), unique=True, max_size=3) if idle else st.just([])
        ):
            ids = self.tokens[rid]
            stored = self.pool.num_stored_tokens(rid)
            end = data.draw(st.integers(stored + 1, len(ids)))
            chunks.append(tl.Chunk(rid, ids, stored, end))
        for _ in range(data.draw(st.integers(0 if chunks else 1, 2))):
            doc = DOCS[data.draw(st.integers(0, len(DOCS) - 1))]
            cut = data.draw(st.integers(1, len(doc)))
            ids = np.concatenate([doc[:cut], tokens(self.next_id, data.draw(st.integers(1, 12)))])
            cached = min(self.h.cached(ids), len(ids) - 1)
            start = data.draw(st.sampled_from(sorted({0, cached - cached % SEG, cached})))
            chunks.append(tl.Chunk(f"n{self.next_id}", ids, start))
            self.next_id += 1
        num_batches = data.draw(st.integers(1, len(chunks)))
        batches = [chunks[b::num_batches] for b in range(num_batches)]
        dops = [1] * num_batches
        if data.draw(st.booleans()) and len(free) > num_batches:
            dops[0] = min(2, sum(c.num_new_tokens for c in batches[0]))
        instances = None
        if data.draw(st.booleans()) and free:
            instances = [
                data.draw(
                    st.lists(st.sampled_from(free), unique=True, min_size=d, max_size=len(free))
                    if len(free) >= d
                    else st.just(free)
                )
                for d in dops
            ]
        before = pool_state(self.pool)
        try:
            plans = self.pool.gen_plans(batches, dops, instances=instances)
        except (PoolFullError, IterationStateError) as exc:
            event(f"gen_plans refused: {type(exc).__name__}")
            if isinstance(exc, IterationStateError):
                assert sum(dops) > len(free) or instances is not None
            assert_same_state(before, pool_state(self.pool))
            return
        except tl.InvalidArgumentError:
            # more sub-batches than live instances, or random instance sets with no assignment
            assert sum(dops) > len(self.pool.live_instances) or instances is not None
            assert_same_state(before, pool_state(self.pool))
            return
        self.mutations += 1
        assert set(plans.origins) <= set(free), "dispatched to a busy instance"
        it = self.pool.iterations_in_flight()[-1]
        event(f"planned with {len(self.inflight)} others in flight")
        if it.victims:
            event("planning evicted")
        if it.replications:
            event("planning replicated")
        for c in chunks:
            if c.request_id not in self.tokens:
                self.tokens[c.request_id] = c.token_ids
        self.inflight[plans.epoch] = InFlight(plans, batches, before, self.mutations)

    # ---- executing, committing, aborting ---------------------------------------------------
    def pick(self, data, executed=None) -> InFlight | None:
        cands = [f for f in self.inflight.values() if executed is None or f.executed in executed]
        return data.draw(st.sampled_from(cands)) if cands else None

    @precondition(lambda self: any(f.executed == "no" for f in self.inflight.values()))
    @rule(data=st.data())
    def execute(self, data):
        self.execute_one(self.pick(data, ("no",)))

    def execute_one(self, f: InFlight) -> None:
        err = self.h.execute(f.plans, f.batches)
        assert err <= self.h.tolerance, f"iteration {f.plans.epoch}: error {err}"
        f.executed = "full"

    @precondition(lambda self: any(f.executed == "no" for f in self.inflight.values()))
    @rule(data=st.data())
    def execute_partly(self, data):
        """Layer 0's puts of every sub-batch, then the iteration fails."""
        f = self.pick(data, ("no",))
        chunks = {c.request_id: c for b in f.batches for c in b}
        for qp, tp in zip(f.plans.query_plans, f.plans.transfer_plans, strict=True):
            engine = self.h.cluster.engine(qp.origin)
            engine.init_query(qp)
            kv_buf = engine.init_transfer(tp)
            for r, rid in enumerate(qp.request_ids):
                lo, hi = int(qp.q_indptr[r]), int(qp.q_indptr[r + 1])
                first = int(qp.positions[r])
                pos = np.arange(first, first + hi - lo)
                kv_buf[0, lo:hi] = self.h.model.kv(chunks[rid].token_ids[pos], pos, 0)
            engine.put(kv_buf, 0)
        f.executed = "partial"

    @precondition(lambda self: any(f.executed != "partial" for f in self.inflight.values()))
    @rule(data=st.data())
    def commit(self, data):
        """Commit an executed iteration (executing it first if it was not)."""
        f = self.pick(data, ("no", "full"))
        if f.executed == "no":
            self.execute_one(f)
        event(f"commit, {'not ' if f.plans.epoch != min(self.inflight) else ''}the oldest")
        self.pool.commit(f.plans)
        self.h.cluster.retire(f.plans.epoch)
        del self.inflight[f.plans.epoch]
        self.mutations += 1
        for batch in f.batches:
            for c in batch:
                if c.end == len(c.token_ids):  # the chunk ended the known tokens: one more
                    self.tokens[c.request_id] = np.append(c.token_ids, len(self.tokens) % 97)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), executed=st.booleans())
    def abort(self, data, executed):
        f = self.pick(data)
        if f.executed != "no":
            executed = True  # after a (partial) execution only the safe abort is allowed
        exact = not executed and f.mutation == self.mutations
        self.pool.abort(f.plans, executed=executed)
        self.h.cluster.retire(f.plans.epoch)
        del self.inflight[f.plans.epoch]
        self.mutations += 1
        for batch in f.batches:
            for c in batch:
                if c.request_id not in self.pool.requests:
                    del self.tokens[c.request_id]  # a new request is forgotten
        event(f"abort after execution={f.executed} executed={executed} exact={exact}")
        if exact:  # nothing happened since gen_plans: the pool is exactly as before it
            assert_restored(f.snapshot, pool_state(self.pool))
        self.rejected(lambda: self.pool.commit(f.plans), tl.StalePlanError)

    # ---- requests and instances ----------------------------------------------------------
    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens, key=str)))
        if self.pool.in_flight_epoch(rid) is not None:
            self.rejected(lambda: self.pool.finish(rid), IterationStateError)
            return
        self.pool.finish(rid)
        del self.tokens[rid]
        self.mutations += 1

    @rule(data=st.data(), now=st.integers(0, 3))
    def drop_instance(self, data, now):
        if now:  # rarely: a small cluster with one instance gone has little left to test
            return
        live = self.pool.live_instances
        instance_id = data.draw(st.sampled_from(live))
        using = [it.epoch for it in self.pool.iterations_in_flight() if instance_id in it.instances]
        if len(live) == 1:
            self.rejected(lambda: self.pool.drop_instance(instance_id), tl.InvalidArgumentError)
            return
        try:
            before = pool_state(self.pool)
            failed = self.pool.drop_instance(instance_id)
        except IterationStateError:
            event("drop refused: an iteration in flight uses the instance")
            assert using or any(self.inflight), "refused though no iteration uses it"
            assert_same_state(before, pool_state(self.pool))
            return
        assert not using, f"dropped instance {instance_id} used by iterations {using}"
        event(f"dropped an instance with {len(self.inflight)} iterations in flight")
        self.mutations += 1
        self.dropped.add(instance_id)
        for rid in failed:
            del self.tokens[rid]

    @precondition(lambda self: self.dropped)
    @rule(data=st.data())
    def restore_instance(self, data):
        instance_id = data.draw(st.sampled_from(sorted(self.dropped)))
        self.pool.restore_instance(instance_id)
        self.dropped.discard(instance_id)
        self.mutations += 1

    @invariant()
    def consistent(self):
        if self.h is None:
            return
        self.pool.check_invariants()
        assert set(self.pool.active_epochs) == set(self.inflight)
        assert set(self.tokens) == set(self.pool.requests)

    def teardown(self):
        """Everything aborted or committed, every request finished: nothing is left pinned,
        read or reserved, and the pool still serves exactly."""
        if self.h is None:
            return
        for f in list(self.inflight.values()):
            self.pool.abort(f.plans)
            self.h.cluster.retire(f.plans.epoch)
        for rid in list(self.pool.requests):
            self.pool.finish(rid)
        self.pool.check_invariants()
        table = self.pool.tree.table
        assert not table.pins.any() and not table.readers.any()
        ids = np.concatenate([DOCS[0], tokens(99_999, 5)])
        assert self.h.step([[tl.Chunk("last", ids, min(self.h.cached(ids), len(ids) - 1))]]) <= (
            self.h.tolerance
        )


TestConcurrentIterations = ConcurrentIterations.TestCase
TestConcurrentIterations.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
