"""A small decode reads replicas where it reads anyway once hops are priced
(:mod:`tokenlake.cluster.locality`): the real replica choice on the biased load, against
brute force over every choice on tiny cases; unchanged with ``hop_bytes = 0`` or when every
such instance is overloaded; exact attention and pool invariants through a served pool."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from harness import Harness, tokens

import tokenlake as tl
from tokenlake import _C
from tokenlake.cluster.balancer import BalancerConfig
from tokenlake.cluster.locality import fixed_tokens, is_small_decode, prefer_home

C = 16


def random_case(rng, n: int):
    """One or two decoding requests over a few pages, some with two replicas."""
    num_pages = int(rng.integers(1, 6))
    num_rep = rng.integers(1, 3, num_pages).astype(np.int32)
    rep_inst = np.full((num_pages, n), -1, dtype=np.int32)
    for p in range(num_pages):
        rep_inst[p, : num_rep[p]] = rng.choice(n, int(num_rep[p]), replace=False)
    table = SimpleNamespace(num_replicas=num_rep, rep_inst=rep_inst)
    num_req = int(rng.integers(1, 3))
    cut = sorted(rng.integers(0, num_pages + 1, num_req - 1).tolist())
    bounds = [0, *cut, num_pages]
    states = [SimpleNamespace(page_idx=np.arange(a, b)) for a, b in itertools.pairwise(bounds)]
    open_len = rng.integers(0, C, num_req)
    start = np.array([(b - a) * C for a, b in itertools.pairwise(bounds)]) + open_len
    cs = SimpleNamespace(
        states=states,
        start=start,
        end=start + 1,
        open_len=open_len,
        open_inst=rng.integers(0, n, num_req),
    )
    return cs, table


class Batch(SimpleNamespace):
    def __len__(self) -> int:
        return len(self.states)


def choose(table, load: np.ndarray, seed: int) -> dict[int, int]:
    """The C++ replica choice (power of two choices) for every page with several replicas,
    in page order as ``plan_pages`` makes it: ``{page: instance}``."""
    multi = np.flatnonzero(table.num_replicas > 1)
    if not len(multi):
        return {}
    chosen = np.empty(len(multi), dtype=np.int32)
    weight = np.full(len(multi), float(C))
    _C.choose_replicas(
        np.ascontiguousarray(table.rep_inst[multi]), table.num_replicas[multi], weight,
        load.astype(np.float64).copy(), seed, chosen,
    )  # fmt: skip
    return {int(p): int(table.rep_inst[p, c]) for p, c in zip(multi, chosen, strict=True)}


def holders(cs, table, picks: dict[int, int]) -> set[int]:
    fixed = fixed_tokens(cs, table, C, table.rep_inst.shape[1])
    return set(np.flatnonzero(fixed > 0).tolist()) | set(picks.values())


@pytest.mark.parametrize("seed", range(60))
def test_choice_on_the_biased_load_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 5))
    raw, table = random_case(rng, n)
    cs = Batch(**vars(raw))
    load = rng.integers(0, 4, n).astype(float) * 100 * (rng.random() < 0.8)
    factor = float(rng.choice([1.0, 1.5, 100.0]))
    config = BalancerConfig(hop_bytes=1e6, overload_factor=factor)
    live = list(range(n))
    # the instances read anyway, by an independent count
    fixed = np.zeros(n)
    for st, s, ol, oi in zip(cs.states, cs.start, cs.open_len, cs.open_inst, strict=True):
        for p in st.page_idx[: s // C]:
            if table.num_replicas[p] == 1:
                fixed[table.rep_inst[p, 0]] += C
        fixed[oi] += ol
    assert np.array_equal(fixed_tokens(cs, table, C, n), fixed)
    mean = load.mean()
    ok = (fixed > 0) & ((load <= factor * mean) | (mean == 0))
    biased = prefer_home(load, cs, [1], table, C, live, config)
    picks = choose(table, biased, seed)
    if not ok.any():  # nothing to prefer: the plain choice
        assert biased is load
        assert picks == choose(table, load, seed)
        return
    for p, inst in picks.items():
        reps = table.rep_inst[p, : table.num_replicas[p]].tolist()
        good = [r for r in reps if ok[r]]
        if good:  # two replicas: both drawn, so a preferred one always wins
            assert ok[inst] and fixed[inst] == max(fixed[r] for r in good)
    # brute force over every choice: when each replicated page has a replica on a preferred
    # instance and nothing read anyway is overloaded, no choice adds fewer holders
    every = [table.rep_inst[p, : table.num_replicas[p]].tolist() for p in picks]
    if all(any(ok[r] for r in reps) for reps in every) and ok[fixed > 0].all():
        best = min(
            len(holders(cs, table, dict(zip(picks, combo, strict=True))))
            for combo in itertools.product(*every)
        )
        assert len(holders(cs, table, picks)) == best


def test_hop_zero_large_batches_and_prefill_keep_the_load():
    rng = np.random.default_rng(3)
    raw, table = random_case(rng, 3)
    cs = Batch(**vars(raw))
    load = np.array([5.0, 1.0, 2.0])
    live = [0, 1, 2]
    assert prefer_home(load, cs, [1], table, C, live, BalancerConfig()) is load
    priced = BalancerConfig(hop_bytes=1.0, small_decode_rows=len(cs) - 1)
    assert prefer_home(load, cs, [1], table, C, live, priced) is load  # not small
    priced = BalancerConfig(hop_bytes=1.0)
    assert prefer_home(load, cs, [2], table, C, live, priced) is load  # DoP 2: a prefill
    assert not is_small_decode(Batch(**{**vars(raw), "end": raw.end + 1}), [1], 8)
    assert is_small_decode(cs, [1], 8)


def decode_run(balancer: BalancerConfig, n: int, seed: int):
    """A document read by many requests (the balancer replicates it), then several
    requests decoding over it one at a time; the origin and holders of every decode step.
    More requests than instances stay running (the oldest finished as new ones come), so
    the pool is never light and load is balanced."""
    h = Harness(n, C, num_slots=24, balancer=balancer)
    rng = np.random.default_rng(seed)
    doc = tokens(seed, C * 4)
    steps, errs, running = [], [], []
    for i in range(12):
        ids = np.concatenate([doc, tokens(100 + i, 5)])
        errs.append(h.step([[tl.Chunk(f"r{i}", ids, h.cached(ids))]]))
        h.pool.check_invariants()
        running.append(f"r{i}")
        if i % 3 == 0:
            for _ in range(int(rng.integers(1, 4))):
                ids = np.append(ids, int(rng.integers(0, 50))).astype(np.int32)
                errs.append(h.step([[tl.Chunk(f"r{i}", ids, len(ids) - 1)]]))
                qp = h.last_plans.query_plans[0]
                steps.append((qp.origin, qp.holder_ids.tolist()))
                h.pool.check_invariants()
        while len(running) > n + 1:
            h.pool.finish(running.pop(0))
            h.pool.check_invariants()
    for rid in running:
        h.pool.finish(rid)
    assert max(errs) <= h.tolerance
    assert h.pool.get_stats()["num_replicated_segments"] > 0
    return steps


@pytest.mark.parametrize(("n", "seed"), [(2, 3), (3, 0), (3, 1), (4, 3)])  # these replicate
def test_served_pool_stays_exact_and_hop_zero_is_unchanged(n, seed):
    base = BalancerConfig(window=2, overload_factor=1.0, max_replications=8)
    plain = decode_run(base, n, seed)
    assert (
        decode_run(
            BalancerConfig(window=2, overload_factor=1.0, max_replications=8, hop_bytes=0.0),
            n,
            seed,
        )
        == plain
    )
    priced = decode_run(
        BalancerConfig(window=2, overload_factor=1.0, max_replications=8, hop_bytes=1e6), n, seed
    )
    assert len(priced) == len(plain)
    # preferring replicas on instances read anyway never added holders in these runs
    assert sum(len(h) for _, h in priced) <= sum(len(h) for _, h in plain)
