"""The fixed cost of a remote holder (``LatencyModel.hop_s``): measured by the profiler, priced
per remote holder per step, and the DP spreads a batch only where the predicted step, hops
included, is shorter. With ``hop_s = 0`` every decision is what it was without the term."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

import tokenlake as tl
from tokenlake.errors import InvalidArgumentError, UnknownRequestError
from tokenlake.scheduler.config import SchedulerConfig
from tokenlake.scheduler.latency_model import DECODE, PREFILL, Coeffs, LatencyModel
from tokenlake.scheduler.policy import InstanceLimits, WorkItem, build_problem, plan_batches
from tokenlake.scheduler.profiler import measure_hop_seconds

C = 16
# a fixed cost per batch, ideal sequence parallelism beyond DoP 1 (extrapolated)
MODEL = LatencyModel({1: Coeffs(2e-3, 2e-5, 1e-9)}, Coeffs(2e-3, 5e-5, 0.0))
SOLVERS = ("cpp", "python")


def prefill_items(lengths) -> list[WorkItem]:
    return [
        WorkItem(f"p{i}", PREFILL, np.zeros(n, np.int32), 0, n, i) for i, n in enumerate(lengths)
    ]


def decode_items(count: int, first: int = 0) -> list[WorkItem]:
    return [
        WorkItem(f"d{i}", DECODE, np.zeros(40, np.int32), 39, 40, first + i) for i in range(count)
    ]


def config(n: int) -> SchedulerConfig:
    return SchedulerConfig(num_instances=n, segment_len=C)


def brute_force(items, cfg, model, load: float, limits: InstanceLimits) -> float:
    """The least ``sum(batch size * predicted latency)`` over every split of the DP's item
    order into contiguous batches and every DoP choice, from ``model.predict`` (hops
    included) rather than the DP's table."""
    problem, order = build_problem(items, cfg, model, load, limits)
    p = problem.num_prefill
    best = math.inf
    for cuts_p in _splits(p):
        for cuts_d in _splits(len(order) - p):
            batches = [(a, b) for a, b in cuts_p] + [(p + a, p + b) for a, b in cuts_d]
            pre = [bt for bt in batches if bt[0] < p]
            dec = [bt for bt in batches if bt[0] >= p]
            if len(dec) > limits.decode:
                continue
            for dops in itertools.product(range(1, limits.prefill + 1), repeat=len(pre)):
                if sum(dops) > limits.prefill or sum(dops) + len(dec) > limits.total:
                    continue
                cost = 0.0
                for (a, b), dop in zip(pre, dops, strict=True):
                    lens = [it.num_new for it in order[a:b]]
                    cost += (b - a) * model.predict(PREFILL, lens, dop, load)
                for a, b in dec:
                    cost += (b - a) * model.predict(DECODE, [1] * (b - a), 1, load)
                best = min(best, cost)
    return best


def _splits(n: int):
    """Every split of ``range(n)`` into contiguous non-empty runs."""
    if n == 0:
        yield []
        return
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        yield list(itertools.pairwise(bounds))


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("hop_s", [0.0, 1e-3, 0.05])
def test_the_dp_finds_the_least_predicted_cost_with_hops(solver, hop_s):
    rng = np.random.default_rng(7)
    model = MODEL.with_hop(hop_s)
    for _ in range(40):
        n = int(rng.integers(2, 5))
        lengths = [int(x) for x in rng.integers(1, 3000, int(rng.integers(1, 4)))]
        items = prefill_items(lengths) + decode_items(int(rng.integers(0, 3)), len(lengths))
        load = float(rng.choice([0.0, 0.3]))
        cfg = config(n)
        limits = InstanceLimits(n, n - 1, n - 1) if len(items) > len(lengths) else None
        limits = limits or InstanceLimits.of(cfg)
        d = plan_batches(items, cfg, model, load, solver, limits)
        assert d.cost == pytest.approx(brute_force(items, cfg, model, load, limits), rel=1e-9)
        for batch, dop, phase, latency in zip(
            d.batches, d.dops, d.phases, d.latencies, strict=True
        ):  # each batch's latency is the model's prediction, its hops included
            lens = [c.num_new_tokens for c in batch]
            want = model.predict(phase, lens if phase == PREFILL else [1] * len(lens), dop, load)
            assert latency == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("solver", SOLVERS)
def test_zero_hop_cost_changes_no_decision(solver):
    rng = np.random.default_rng(3)
    legacy = LatencyModel(dict(MODEL.prefill), MODEL.decode)  # built without the term
    for _ in range(60):
        n = int(rng.integers(1, 6))
        lengths = [int(x) for x in rng.integers(1, 20000, int(rng.integers(1, 5)))]
        items = prefill_items(lengths)
        load = float(rng.choice([0.0, 0.5]))
        a = plan_batches(items, config(n), legacy, load, solver)
        b = plan_batches(items, config(n), MODEL.with_hop(0.0), load, solver)
        assert (a.dops, a.latencies, a.cost) == (b.dops, b.latencies, b.cost)
        assert [[c.request_id for c in x] for x in a.batches] == [
            [c.request_id for c in x] for x in b.batches
        ]


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_large_hop_cost_keeps_a_small_batch_on_one_instance(solver):
    small, large = prefill_items([64]), prefill_items([60000])
    free = plan_batches(small, config(4), MODEL, 0.0, solver)
    assert free.dops[0] > 1  # without hops, splitting 64 tokens looks shorter
    costly = MODEL.with_hop(5e-3)  # a few ms per remote holder per step
    assert plan_batches(small, config(4), costly, 0.0, solver).dops == (1,)
    # a long prefill still pays for its hops: it is spread
    spread = plan_batches(large, config(4), costly, 0.0, solver)
    assert spread.dops[0] > 1
    assert costly.predict(PREFILL, [60000], spread.dops[0]) < costly.predict(PREFILL, [60000])
    assert costly.predict(PREFILL, [64], 1) < min(
        costly.predict(PREFILL, [64], k) for k in (2, 3, 4)
    )


def test_hop_cost_checks_its_arguments():
    for bad in (-1e-3, math.nan, math.inf, "x", None):
        with pytest.raises(InvalidArgumentError, match="hop_s"):
            LatencyModel(dict(MODEL.prefill), MODEL.decode, bad)
    with pytest.raises(InvalidArgumentError, match="remote_holders"):
        MODEL.predict(DECODE, [1], remote_holders=-1)
    assert MODEL.with_hop(2e-3).predict(DECODE, [1], remote_holders=3) == pytest.approx(
        MODEL.predict(DECODE, [1]) + 6e-3
    )


class _FakeDataPlane:
    """An ``execute`` whose runs take ``BASE_S`` plus ``HOP_S`` per remote holder of the
    plans' queries, on a clock it advances (no real time is measured)."""

    BASE_S, HOP_S = 4e-3, 7e-4

    def __init__(self) -> None:
        self.now = 0.0
        self.runs = 0

    def clock(self) -> float:
        return self.now

    def execute(self, plans, chunks) -> None:
        remote = sum(
            int(h != qp.origin) for qp in plans.query_plans for h in qp.holder_ids.tolist()
        )
        self.now += self.BASE_S + remote * self.HOP_S
        self.runs += 1


def test_the_profiler_measures_the_fixed_cost_of_a_remote_holder():
    shape = tl.ModelShape(2, 4, 2, 16, "float32")
    pool = tl.Pool(tl.PoolConfig(shape, 3, num_slots=16, segment_len=C))
    fake = _FakeDataPlane()
    hop = measure_hop_seconds(pool, fake.execute, repeats=3, clock=fake.clock)
    assert hop == pytest.approx(_FakeDataPlane.HOP_S, rel=1e-9)
    assert fake.runs == 1 + 2 * 3  # the prompt, then a local and a remote decode per repeat
    with pytest.raises(UnknownRequestError):  # nothing left running
        pool.num_stored_tokens("profile-hop")
    single = tl.Pool(tl.PoolConfig(shape, 1, num_slots=16, segment_len=C))
    assert measure_hop_seconds(single, fake.execute, clock=fake.clock) == 0.0
    with pytest.raises(InvalidArgumentError, match="repeats"):
        measure_hop_seconds(pool, fake.execute, repeats=0)
