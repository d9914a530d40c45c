"""The §6.2 DP: C++ core == Python reference == brute force over every batching of the sorted
items (every split into contiguous single-phase batches × every DoP assignment)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tokenlake.errors import InvalidArgumentError
from tokenlake.scheduler.dp import DPProblem, solve
from tokenlake.scheduler.dp_reference import solve_reference


def latency(p: DPProblem, start: int, end: int, dop: int) -> float:
    lens = p.lens[start:end]
    a, b, c = p.prefill_coef[dop - 1] if start < p.num_prefill else p.decode_coef
    return (a + b * lens.sum() + c * (lens**2).sum()) / (1 - p.load)


def compositions(lo: int, hi: int):
    """Every split of items lo..hi-1 into contiguous runs, as (start, end) lists."""
    n = hi - lo
    if n == 0:
        yield []
        return
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [lo] + [lo + i + 1 for i, cut in enumerate(cuts) if cut] + [hi]
        yield list(itertools.pairwise(bounds))


def brute_force(p: DPProblem, enforce_slo: bool) -> tuple[float, list]:
    """Least cost over all batchings (inf when none is feasible) and the optimal plans."""
    m, n = p.num_prefill, p.num_items
    kp = min(p.max_prefill_instances, p.num_instances)
    kd = min(p.max_decode_instances, p.num_instances)
    best, plans = math.inf, []
    for pre in compositions(0, m):
        dop_choices = [
            range(1, min(len(p.prefill_coef), kp, int(p.lens[s:e].sum())) + 1) for s, e in pre
        ]
        for dops in itertools.product(*dop_choices):
            if sum(dops) > kp:
                continue
            for dec in compositions(m, n):
                if len(dec) > kd or sum(dops) + len(dec) > p.num_instances:
                    continue
                batches = [(s, e, d) for (s, e), d in zip(pre, dops, strict=True)]
                batches += [(s, e, 1) for s, e in dec]
                cost, ok = 0.0, True
                for s, e, d in batches:
                    t = latency(p, s, e, d)
                    ok &= t <= p.slos[s:e].min()
                    cost += (e - s) * t
                if enforce_slo and not ok:
                    continue
                if cost < best * (1 - 1e-12):
                    best, plans = cost, [batches]
                elif cost <= best * (1 + 1e-12):
                    plans.append(batches)
    return best, plans


def random_problem(rng: np.random.Generator, slo_scale: float) -> DPProblem:
    m = int(rng.integers(0, 8))
    num_prefill = int(rng.integers(0, m + 1))
    both = 0 < num_prefill < m
    n = int(rng.integers(2 if both else 1, 5))
    lens = rng.integers(1, 64, m).astype(float)
    lens[num_prefill:] = 1
    max_dop = int(rng.integers(1, n + 1))
    prefill_coef = rng.uniform(0.1, 1.0, (max_dop, 3)) * [0.2, 0.05, 0.002]
    if rng.random() < 0.5:  # sequence-parallel-like: per-token terms shrink with the DoP
        prefill_coef[:, 1:] /= np.arange(1, max_dop + 1)[:, None]
    slos = rng.uniform(0.2, 1.0, m) * slo_scale
    if rng.random() < 0.5:  # alike decode steps (one TBT SLO): the core's even-split path
        slos[num_prefill:] = slos[-1] if m else 0
    return DPProblem(
        lens=lens,
        slos=slos,
        num_prefill=num_prefill,
        prefill_coef=prefill_coef,
        decode_coef=rng.uniform(0.1, 1.0, 3) * [1.0, 0.1, 0.01],
        num_instances=n,
        max_prefill_instances=int(rng.integers(1, n + 1)),
        max_decode_instances=int(rng.integers(1, n + 1)),
        load=float(rng.choice([0.0, rng.uniform(0, 0.6)])),
    )


@pytest.mark.parametrize("seed", range(8))
def test_cpp_equals_reference_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        # slo_scale spans "always feasible" to "often infeasible"
        p = random_problem(rng, slo_scale=float(rng.choice([2.0, 6.0, 1e9])))
        fast, ref = solve(p), solve_reference(p)
        assert fast == ref  # same loops, same float ops: identical plans and costs
        feasible_cost, feasible_plans = brute_force(p, enforce_slo=True)
        if math.isfinite(feasible_cost):
            # SLO met whenever a feasible plan exists, at the least cost
            assert fast.slo_met
            assert fast.cost == pytest.approx(feasible_cost, rel=1e-9)
            for s, e, d in fast.batches:
                assert latency(p, s, e, d) <= p.slos[s:e].min() * (1 + 1e-12)
        else:
            # no feasible plan: throughput fallback = the least cost ignoring SLOs
            assert not fast.slo_met
            any_cost, _ = brute_force(p, enforce_slo=False)
            assert fast.cost == pytest.approx(any_cost, rel=1e-9)
        check_plan_shape(p, fast.batches)
        recomputed = sum((e - s) * latency(p, s, e, d) for s, e, d in fast.batches)
        assert recomputed == pytest.approx(fast.cost, rel=1e-9)


def check_plan_shape(p: DPProblem, batches) -> None:
    """Covers every item once, in order; PD constraint; decode DoP 1; instance limits."""
    bounds = [0] + [e for _, e, _ in batches]
    assert [s for s, _, _ in batches] == bounds[:-1] and bounds[-1] == p.num_items
    pre = [(s, e, d) for s, e, d in batches if s < p.num_prefill]
    dec = [(s, e, d) for s, e, d in batches if s >= p.num_prefill]
    assert all(e <= p.num_prefill for _, e, _ in pre), "a batch mixes prefill and decode"
    assert all(d == 1 for _, _, d in dec)
    assert all(1 <= d <= p.lens[s:e].sum() for s, e, d in pre)
    assert sum(d for _, _, d in pre) <= min(p.max_prefill_instances, p.num_instances)
    assert len(dec) <= min(p.max_decode_instances, p.num_instances)
    assert sum(d for _, _, d in batches) <= p.num_instances


def test_ties_resolve_identically_with_integer_coefficients():
    rng = np.random.default_rng(7)
    for _ in range(100):
        m = int(rng.integers(1, 8))
        p = DPProblem(
            lens=rng.integers(1, 4, m).astype(float),
            slos=np.full(m, np.inf),
            num_prefill=m,
            prefill_coef=rng.integers(0, 3, (4, 3)).astype(float),
            decode_coef=[1, 1, 0],
            num_instances=4,
            max_prefill_instances=4,
            max_decode_instances=4,
        )
        assert solve(p) == solve_reference(p)


def test_elastic_dop_and_load():
    """One long prefill chunk: more instances cut its latency, so the DP spreads it; under
    cache load every latency stretches by 1 / (1 - L)."""
    coef = [[0.01, 1e-4, 1e-8], [0.01, 0.5e-4, 0.5e-8], [0.01, 1 / 3 * 1e-4, 1 / 3 * 1e-8]]
    kwargs = dict(slos=[np.inf], num_prefill=1, prefill_coef=coef, decode_coef=[0.01, 0, 0])
    p = DPProblem(lens=[8192.0], num_instances=3, max_prefill_instances=3,
                  max_decode_instances=3, **kwargs)  # fmt: skip
    r = solve(p)
    assert r.batches == ((0, 1, 3),)
    loaded = solve(DPProblem(lens=[8192.0], num_instances=3, max_prefill_instances=3,
                             max_decode_instances=3, load=0.5, **kwargs))  # fmt: skip
    assert loaded.cost == pytest.approx(2 * r.cost)


def test_xpyd_limits_each_phase():
    p = DPProblem(
        lens=[512.0] * 4 + [1.0] * 6,
        slos=np.full(10, np.inf),
        num_prefill=4,
        prefill_coef=[[0.01, 1e-4, 1e-8]] * 4,
        decode_coef=[0.01, 1e-3, 0],
        num_instances=4,
        max_prefill_instances=1,
        max_decode_instances=3,
    )
    r = solve(p)
    assert r.batches[0] == (0, 4, 1)  # one prefill instance: one batch, DoP 1
    assert len(r.batches) == 4 and all(d == 1 for _, _, d in r.batches[1:])


def test_empty_and_bad_input():
    empty = DPProblem([], [], 0, [[1, 0, 0]], [1, 0, 0], 2, 2, 2)
    assert solve(empty) == solve_reference(empty) == ((), 0.0, True)
    good = dict(
        lens=[4.0, 1.0],
        slos=[1.0, 1.0],
        num_prefill=1,
        prefill_coef=[[1, 0, 0]],
        decode_coef=[1, 0, 0],
        num_instances=2,
        max_prefill_instances=2,
        max_decode_instances=2,
    )
    bad = {
        "lens": [0.5, 1.0],
        "slos": [1.0, float("nan")],
        "num_prefill": 3,
        "prefill_coef": [[1, 0]],
        "decode_coef": [1, 0, float("inf")],
        "num_instances": 1,
        "max_prefill_instances": 0,
        "load": 1.0,
    }
    for name, value in bad.items():
        with pytest.raises(InvalidArgumentError, match=name):
            DPProblem(**{**good, name: value})
