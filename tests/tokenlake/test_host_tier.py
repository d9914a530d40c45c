"""The host tier below the pool: a segment evicted from a full pool is demoted into a block
instead of being forgotten, matched as a hit, and loaded back into a slot by the plan that
reads it; attention over promoted segments equals monolithic attention (the in-process data
plane, whose tier is its own shared-memory region). The concurrent-iterations state machine
runs again with a tier (demotions, loads and tier evictions interleaved with everything
else, every executed row exact); the API fuzzer's tier runs are in test_fuzz_api.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from harness import Harness, tokens
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from pool_state import assert_restored, assert_same_state, pool_state
from test_concurrent_iterations import DOCS, ConcurrentIterations, InFlight

import tokenlake as tl
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.errors import IterationStateError, PoolFullError

SEG = 8
NO_REPLICAS = BalancerConfig(replicate=False)


def tiered(num_tier_blocks: int, num_slots: int = 4) -> Harness:
    """Two instances of ``num_slots`` slots: a small pool that evicts at once."""
    return Harness(2, SEG, num_slots=num_slots, num_tier_blocks=num_tier_blocks,
                   balancer=NO_REPLICAS, eviction=tl.EvictionConfig("lru"))  # fmt: skip


def fill(h: Harness, rid: str, ids: np.ndarray) -> float:
    """Prefill a request whole, from what is cached, then finish it."""
    start = min(h.cached(ids), len(ids) - 1)
    err = h.step([[tl.Chunk(rid, ids, start)]])
    h.pool.finish(rid)
    return err


def test_an_evicted_document_comes_back_from_the_tier_exactly():
    h = tiered(num_tier_blocks=16)
    doc_a, doc_b = tokens(1, 4 * SEG), tokens(2, 6 * SEG)
    errs = [fill(h, "a", np.append(doc_a, 1))]  # 4 sealed segments of A, its tail
    errs.append(fill(h, "b", np.append(doc_b, 2)))  # B needs the room: A goes to the tier
    stats = h.pool.get_stats()
    assert stats["tier_demotions"] >= 3 and stats["tier_segments"] >= 3, stats
    assert h.cached(doc_a) == 4 * SEG  # still a hit: the tier is matched
    # A's next turn reads it: the plan loads its segments before the layers read them
    turn = np.concatenate([doc_a, tokens(3, SEG + 3)])
    errs.append(h.step([[tl.Chunk("a2", turn, 4 * SEG)]]))
    tp = h.last_plans.transfer_plans[0]
    assert tp.num_loads >= 3
    stats = h.pool.get_stats()
    assert stats["tier_promotions"] >= 3 and stats["tier_hit_tokens"] >= 3 * SEG
    assert stats["tier_promotion_bytes"] == stats["tier_promotions"] * h.config.segment_bytes
    assert max(errs) <= h.tolerance, errs
    # decode over the promoted prefix: still exact
    for step in range(3):
        turn = np.append(turn, step)
        errs.append(h.step([[tl.Chunk("a2", turn, h.pool.num_stored_tokens("a2"))]]))
    assert max(errs) <= h.tolerance, errs


def test_without_a_tier_the_evicted_document_is_forgotten():
    """Tier capacity 0 is the pool without a tier: the same steps lose A's segments."""
    h = tiered(num_tier_blocks=0)
    doc_a, doc_b = tokens(1, 4 * SEG), tokens(2, 6 * SEG)
    fill(h, "a", np.append(doc_a, 1))
    fill(h, "b", np.append(doc_b, 2))
    assert h.cached(doc_a) < 4 * SEG
    stats = h.pool.get_stats()
    assert stats["tier_demotions"] == stats["tier_segments"] == stats["tier_blocks"] == 0


def test_a_full_tier_evicts_its_least_recently_demoted_leaf():
    h = tiered(num_tier_blocks=3)
    for i in range(4):
        fill(h, f"r{i}", np.append(tokens(10 + i, 4 * SEG), 1))
    stats = h.pool.get_stats()
    assert stats["tier_evictions"] > 0 and stats["tier_blocks_used"] == 3, stats
    assert stats["tier_segments"] == 3
    h.pool.check_invariants()


def test_a_recompute_of_a_segment_in_the_tier_becomes_its_pool_copy():
    """A request that recomputes a prefix in the tier (start 0, not its match) seals the same
    segments: the tier's copies give way to the new pool copies, blocks freed."""
    h = tiered(num_tier_blocks=16)
    doc_a = tokens(1, 4 * SEG)
    fill(h, "a", np.append(doc_a, 1))
    fill(h, "b", np.append(tokens(2, 6 * SEG), 2))
    nodes = h.pool.tree.match(doc_a).nodes
    assert any(n.in_tier for n in nodes)
    assert h.step([[tl.Chunk("again", np.append(doc_a, 5), 0)]]) <= h.tolerance
    after = h.pool.tree.match(doc_a).nodes
    assert [n.key for n in after] == [n.key for n in nodes]
    assert all(n.num_replicas and n.tier_block < 0 for n in after)
    h.pool.check_invariants()


def test_an_abort_before_execution_restores_the_tier_exactly():
    h = tiered(num_tier_blocks=2)
    for i in range(3):  # a full tier, then demotions that evict from it
        fill(h, f"r{i}", np.append(tokens(20 + i, 4 * SEG), 1))
    before = pool_state(h.pool)
    ids = np.append(tokens(30, 5 * SEG), 1)
    plans = h.pool.gen_plans([[tl.Chunk("x", ids, 0)]])
    victims = h.pool.iterations_in_flight()[-1].victims
    assert "demoted" in {v.kind for v in victims} and len({v.kind for v in victims}) >= 2
    h.pool.abort(plans, executed=False)
    h.cluster.retire(plans.epoch)
    assert_restored(before, pool_state(h.pool))
    h.pool.check_invariants()


def test_the_data_plane_refuses_hostile_tier_runs():
    """Tier runs in a plan are range-checked against the receiver's tier before anything
    moves: a block past the tier, a slot past the pool, a block written twice, or any tier
    run on a data plane without a tier."""
    h = tiered(num_tier_blocks=4)
    fill(h, "a", np.append(tokens(1, 4 * SEG), 1))
    fill(h, "b", np.append(tokens(2, 6 * SEG), 2))
    ids = np.concatenate([tokens(1, 4 * SEG), tokens(3, 3)])
    plans = h.pool.gen_plans([[tl.Chunk("c", ids, 4 * SEG)]])
    tp = plans.transfer_plans[0]
    assert tp.num_loads
    i32 = lambda v: tl.plans.frozen_i32(v)  # noqa: E731
    n = tp.num_loads
    hostile = {
        "load_src_block": i32([99] * n),
        "load_dst_slot": i32([10**6] * n),
        "load_dst_instance": i32([7] * n),
    }
    engine = h.cluster.engine(tp.origin)
    pools = [p.data.clone() for p in h.cluster.kv_pools]
    for field, value in hostile.items():
        with pytest.raises(tl.InvalidArgumentError, match=field):
            engine.init_transfer(dataclasses.replace(tp, **{field: value}))
    twice = dataclasses.replace(
        tp, demote_src_instance=i32([0, 0]), demote_src_slot=i32([0, 1]),
        demote_dst_block=i32([1, 1]),
    )  # fmt: skip
    with pytest.raises(tl.InvalidArgumentError, match="demote_dst_block"):
        engine.init_transfer(twice)
    untiered = Harness(2, SEG, num_slots=4)
    with pytest.raises(tl.InvalidArgumentError, match="no host tier"):
        untiered.cluster.engine(tp.origin).init_transfer(tp)
    assert all(np.array_equal(a, p.data) for a, p in zip(pools, h.cluster.kv_pools, strict=True))
    h.pool.abort(plans, executed=False)


def test_config_and_pool_refuse_a_bad_tier():
    shape = tl.ModelShape(2, 4, 2, 8)
    for bad in (-1, 1.5, True, "4", 2**40):
        with pytest.raises(tl.InvalidArgumentError, match="num_tier_blocks"):
            tl.PoolConfig(shape, 2, 4, SEG, num_tier_blocks=bad)
    with pytest.raises(tl.InvalidArgumentError, match="num_tier_blocks"):
        tl.Pool(tl.PoolConfig(shape, 2, 4, SEG, num_tier_blocks=4), engine_slots=True)


class TieredIterations(ConcurrentIterations):
    """The concurrent-iterations state machine over a small pool with a host tier (plain
    LRU, so that shared documents, not only the requests' own suffixes, reach the tier)."""

    eviction = tl.EvictionConfig("lru")

    @initialize(
        num_instances=st.integers(2, 3),
        num_slots=st.integers(4, 6),  # small: most plans evict
        replicate=st.booleans(),
        num_tier_blocks=st.integers(1, 12),
    )
    def setup(self, num_instances, num_slots, replicate, num_tier_blocks):
        balancer = BalancerConfig(
            window=4, interval=1, overload_factor=1.0, max_replica_fraction=0.5, replicate=replicate
        )
        self.h = Harness(
            num_instances, 8, num_slots=num_slots, balancer=balancer, eviction=self.eviction,
            num_tier_blocks=num_tier_blocks,
        )  # fmt: skip
        self.pool = self.h.pool
        self.tokens = {}
        self.inflight = {}
        self.dropped = set()
        self.next_id = 0
        self.mutations = 0
        self.prompts: list[np.ndarray] = []  # flooded prompts, revisited later

    @rule()
    def finish_idle(self):
        """Every request not in flight finishes: its segments may leave the pool now."""
        for rid in self.idle_requests():
            self.pool.finish(rid)
            del self.tokens[rid]
            self.mutations += 1

    @rule(data=st.data())
    def flood(self, data):
        """A new request with a fresh prompt about the pool's size: its plan evicts most of
        what is unpinned, into the tier."""
        ids = tokens(7_000 + self.next_id, data.draw(
            st.integers(SEG, self.h.config.capacity_tokens // 2)))  # fmt: skip
        if self.submit(tl.Chunk(f"f{self.next_id}", ids, 0), "flood") is not None:
            self.prompts.append(ids)

    def submit(self, chunk: tl.Chunk, what: str) -> tl.Plans | None:
        self.next_id += 1
        if not self.pool.free_instances:
            return None
        before = pool_state(self.pool)
        try:
            plans = self.pool.gen_plans([[chunk]])
        except (PoolFullError, IterationStateError):
            assert_same_state(before, pool_state(self.pool))
            return None
        event(f"{what}: planned")
        self.mutations += 1
        self.tokens[chunk.request_id] = chunk.token_ids
        self.inflight[plans.epoch] = InFlight(plans, [[chunk]], before, self.mutations)
        return plans

    @rule(data=st.data())
    def revisit(self, data):
        """A new request on a document some of whose segments are in the tier only, from its
        whole match: its plan loads them."""
        docs = DOCS + self.prompts
        doc = docs[data.draw(st.integers(0, len(docs) - 1))]
        if not self.pool.free_instances or not any(
            n.in_tier for n in self.pool.get_prefix_tree().match(doc).nodes
        ):
            return
        ids = np.concatenate([doc, tokens(self.next_id, 3)])
        chunk = tl.Chunk(f"v{self.next_id}", ids, min(self.h.cached(ids), len(ids) - 1))
        plans = self.submit(chunk, "revisit (loads from the tier)")
        assert plans is None or sum(tp.num_loads for tp in plans.transfer_plans) > 0

    @invariant()
    def tier_moves(self):
        if self.h is not None:
            stats = self.pool.get_stats()
            for key in ("tier_demotions", "tier_promotions", "tier_evictions"):
                if stats[key]:
                    event(f"{key} > 0")


TestTieredIterations = TieredIterations.TestCase
TestTieredIterations.settings = settings(
    max_examples=30,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class TierDriver:
    """Demotions, tier hits and loads, tier evictions, commits and aborts (before and after
    execution) of up to two overlapping iterations, over a pool that is always nearly full:
    prompts flood it, earlier ones come back (mostly those with segments in the tier). A seeded random walk (long runs reach the tier
    states a short generated example rarely does). After every step the invariants hold;
    every executed row equals monolithic attention; an abort right after planning restores
    the exact state."""

    def __init__(self, seed: int, num_slots: int, num_tier_blocks: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.h = Harness(2, SEG, num_slots=num_slots, num_tier_blocks=num_tier_blocks,
                         balancer=NO_REPLICAS, eviction=tl.EvictionConfig("lru"))  # fmt: skip
        self.pool = self.h.pool
        self.prompts: list[np.ndarray] = []
        self.inflight: list[InFlight] = []
        self.next_id = 0
        self.mutations = 0
        self.figures: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.figures[what] = self.figures.get(what, 0) + 1

    def submit(self, ids: np.ndarray, start: int) -> None:
        chunk = tl.Chunk(f"r{self.next_id}", ids, start)
        self.next_id += 1
        before = pool_state(self.pool)
        try:
            plans = self.pool.gen_plans([[chunk]])
        except (PoolFullError, IterationStateError):
            assert_same_state(before, pool_state(self.pool))
            self.count("refused")
            return
        self.mutations += 1
        self.count("planned")
        if any(tp.num_loads for tp in plans.transfer_plans):
            self.count("planned loads")
        if any(tp.num_demotions for tp in plans.transfer_plans):
            self.count("planned demotions")
        self.inflight.append(InFlight(plans, [[chunk]], before, self.mutations))

    def flood(self) -> None:
        cap = self.h.config.capacity_tokens
        ids = tokens(9_000 + self.next_id, int(self.rng.integers(cap // 3, cap + 1)))
        self.prompts.append(ids)
        self.submit(ids, 0)

    def revisit(self) -> None:
        view = self.pool.get_prefix_tree()
        tiered = [p for p in self.prompts if any(n.in_tier for n in view.match(p).nodes)]
        pick = tiered if tiered and self.rng.random() < 0.7 else self.prompts
        ids = pick[int(self.rng.integers(len(pick)))]
        ids = np.concatenate([ids, tokens(self.next_id, int(self.rng.integers(1, SEG + 1)))])
        hit = min(self.h.cached(ids), len(ids) - 1)
        self.submit(ids, int(self.rng.choice([0, hit - hit % SEG, hit, hit])))

    def end(self) -> None:
        f = self.inflight.pop(int(self.rng.integers(len(self.inflight))))
        how = str(self.rng.choice(["commit", "commit", "abort", "abort unexecuted"]))
        if how != "abort unexecuted":
            assert self.h.execute(f.plans, f.batches) <= self.h.tolerance
        exact = how == "abort unexecuted" and f.mutation == self.mutations
        if how == "commit":
            self.pool.commit(f.plans)
        else:
            self.pool.abort(f.plans, executed=how == "abort")
        self.h.cluster.retire(f.plans.epoch)
        self.mutations += 1
        self.count(how)
        for batch in f.batches:
            for c in batch:
                if c.request_id in self.pool.requests:
                    self.pool.finish(c.request_id)
        if exact:
            assert_restored(f.snapshot, pool_state(self.pool))
            self.count("exact restore")

    def run(self, num_steps: int) -> dict:
        for _ in range(num_steps):
            r = self.rng.random()
            if self.inflight and (r < 0.45 or len(self.inflight) == 2):
                self.end()
            elif self.prompts and r < 0.75:
                self.revisit()
            else:
                self.flood()
            self.pool.check_invariants()
        return {**self.figures, **self.pool.get_stats()}


@pytest.mark.parametrize("seed, num_slots, num_tier_blocks", [(0, 4, 12), (1, 5, 24), (2, 3, 3)])
def test_random_walk_through_the_tier(seed, num_slots, num_tier_blocks):
    figures = TierDriver(seed, num_slots, num_tier_blocks).run(150)
    for key in ("planned loads", "planned demotions", "exact restore", "commit", "abort"):
        assert figures.get(key, 0) > 0, (key, figures)
    assert figures["tier_promotions"] > 0 and figures["tier_demotions"] > 0, figures


def test_plans_on_the_wire_carry_tier_runs_and_are_range_checked():
    """A transfer plan's tier runs travel in the plan codec; a receiver without a tier, or
    with fewer blocks, refuses them before touching anything."""
    from tokenlake import plan_wire
    from tokenlake.wire import WireError

    h = tiered(num_tier_blocks=4)
    fill(h, "a", np.append(tokens(1, 4 * SEG), 1))
    fill(h, "b", np.append(tokens(2, 6 * SEG), 2))
    plans = h.pool.gen_plans([[tl.Chunk("c", np.concatenate([tokens(1, 4 * SEG), [3]]), 4 * SEG)]])
    tp = plans.transfer_plans[0]
    data = plan_wire.encode(tp)
    limits = plan_wire.PlanLimits(2, 4, SEG, num_tier_blocks=4)
    back = plan_wire.decode(data, limits, tl.TransferPlan)
    assert np.array_equal(back.load_src_block, tp.load_src_block) and back.num_loads
    for blocks in (0, int(tp.load_src_block.max())):
        with pytest.raises(WireError, match=r"transfer_plan\.(load|demote)_\w+: "):
            plan_wire.decode(data, dataclasses.replace(limits, num_tier_blocks=blocks))
    h.pool.abort(plans, executed=False)
