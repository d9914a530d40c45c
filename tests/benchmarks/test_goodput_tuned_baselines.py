"""Tuned baselines on constructed cases: the TBT-aware chunk is the largest candidate whose step
fits the SLO beside the given decodes (against brute force), cascade decode reads a shared
prefix once, the page-groups switch and the system variants."""

from __future__ import annotations

import pytest

from tokenlake.benchmarks.sim.engine import Engine, EngineConfig
from tokenlake.benchmarks.sim.events import EventLoop
from tokenlake.benchmarks.sim.job import Job
from tokenlake.benchmarks.sim.metrics import LoadTimeline
from tokenlake.benchmarks.sim.runner import make_record
from tokenlake.benchmarks.sim.step_timer import ClusterSpec, make_timer
from tokenlake.benchmarks.sim.systems.cascade import (
    MIN_BATCH,
    cascade_read_tokens,
    common_prefix_tokens,
)
from tokenlake.benchmarks.sim.systems.radix_cache import LocalPrefixCache
from tokenlake.benchmarks.sim.systems.systems import split_system
from tokenlake.benchmarks.sim.tbt_chunk import (
    CHUNK_GRANULE,
    fill_chunk,
    largest_fitting_chunk,
    tbt_aware_chunk,
)
from tokenlake.benchmarks.workloads.request import SimRequest

SPEC = ClusterSpec()
TIMER = make_timer(SPEC)


def _brute_force(queued, ctxs, max_chunk, slo, mixed):
    """Every candidate size, each step priced from scratch (no shared code with the search)."""
    best = None
    for c in list(range(CHUNK_GRANULE, max_chunk, CHUNK_GRANULE)) + [max_chunk]:
        budget, news, prefixes = c - (len(ctxs) if mixed else 0), [], []
        for remaining, prefix in queued:
            take = min(remaining, max(budget, 0))
            if take:
                news.append(take)
                prefixes.append(prefix)
                budget -= take
        if mixed:
            news, prefixes = news + [1] * len(ctxs), prefixes + list(ctxs)
        if news and TIMER.prefill_time(news, prefixes) <= slo:
            best = c
    return best


@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize(
    "queued,ctxs",
    [
        ([(20_000, 0)], [3000] * 8),
        ([(700, 4096), (9000, 0)], [12_000] * 30),
        ([(100, 0), (100, 0), (30_000, 8192)], [2000, 50_000, 700]),
        ([(5000, 0)], [100_000] * 64),
    ],
)
@pytest.mark.parametrize("slo_scale", [3.0, 10.0, 40.0])
def test_tbt_chunk_is_the_largest_that_fits(queued, ctxs, mixed, slo_scale):
    slo = slo_scale * TIMER.decode_time([min(ctxs)])
    got = tbt_aware_chunk(TIMER, 8192, slo, queued, ctxs, mixed)
    want = _brute_force(queued, ctxs, 8192, slo, mixed)
    if want is None:  # nothing fits: the smallest candidate, so the prefill progresses
        assert got == CHUNK_GRANULE
    else:
        assert got == want
        news, prefixes = fill_chunk(got - (len(ctxs) if mixed else 0), queued)
        if mixed:
            news, prefixes = news + [1] * len(ctxs), prefixes + ctxs
        assert TIMER.prefill_time(news, prefixes) <= slo


def test_tbt_chunk_cases_cover_fit_and_cap():
    # the constructed cases above include a chunk cut below the cap and the cap itself
    slo = 10 * TIMER.decode_time([3000])
    assert tbt_aware_chunk(TIMER, 8192, slo, [(20_000, 0)], [3000] * 8, True) > CHUNK_GRANULE
    assert tbt_aware_chunk(TIMER, 8192, slo, [(20_000, 0)], [3000] * 8, True) < 8192
    assert tbt_aware_chunk(TIMER, 256, slo, [(20_000, 0)], [3000] * 8, True) == 256


def test_largest_fitting_chunk_on_a_step_function_and_bad_input():
    for limit in (0, 63, 64, 65, 1000, 8191, 8192, 10**6):
        got = largest_fitting_chunk(lambda c: float(c), 8192, float(limit), 64)
        fits = [c for c in list(range(64, 8192, 64)) + [8192] if c <= limit]
        assert got == (max(fits) if fits else 64)
    with pytest.raises(ValueError, match="max_chunk"):
        largest_fitting_chunk(lambda c: 0.0, 0, 1.0)


def _engine(cfg: EngineConfig) -> Engine:
    return Engine(
        0, EventLoop(), TIMER, LocalPrefixCache(SPEC.capacity_tokens), cfg, LoadTimeline(1), None
    )


def _job(rid: int, blocks: tuple, input_len: int, generated: int = 1) -> Job:
    req = SimRequest(rid, 0.0, input_len, 100, blocks)
    job = Job(req, make_record(req, 0.0, TIMER), 512)
    job.prefix_len, job.generated = input_len, generated
    return job


def test_engine_budget_is_tbt_aware_only_beside_decodes():
    slo = 10 * TIMER.decode_time([3000])
    tbt = _engine(EngineConfig(8192, mixed_chunk=True, tbt_slo_s=slo))
    plain = _engine(EngineConfig(8192, mixed_chunk=True))
    for e in (tbt, plain):
        e.waiting.append(_job(99, tuple(range(100, 140)), 20_000, 0))
        e.waiting[0].prefix_len = 0
        e.waiting[0].extra["queued_prefix"] = 0
    assert tbt.chunk_budget(False) == plain.chunk_budget(False) == 8192  # nothing decodes
    for e in (tbt, plain):
        e.running = [_job(i, (i,), 3000) for i in range(8)]
    want = tbt_aware_chunk(TIMER, 8192, slo, [(20_000, 0)], [3000] * 8, True)
    assert tbt.chunk_budget(True) == want - 8 < plain.chunk_budget(True) == 8192 - 8


def test_cascade_reads_the_common_prefix_once():
    shared = tuple(range(8))  # 4096 tokens in 512-token blocks
    jobs = [_job(i, shared + (100 + i,), 4096 + 300 + i) for i in range(MIN_BATCH)]
    e = _engine(EngineConfig(2048, cascade=True))
    reads = e.decode_reads(jobs)
    ctxs = [j.context_len for j in jobs]
    assert reads == [ctxs[0]] + [c - 4096 for c in ctxs[1:]]
    assert sum(reads) == sum(ctxs) - (MIN_BATCH - 1) * 4096
    assert TIMER.decode_time(ctxs, sum(reads)) < TIMER.decode_time(ctxs)
    assert _engine(EngineConfig(2048)).decode_reads(jobs) is None  # off by default
    assert e.decode_reads(jobs[: MIN_BATCH - 1]) is None  # vLLM: too small a batch
    other = [_job(50, (999,) + shared, 5000)]
    assert e.decode_reads(jobs + other) is None  # no common prefix


def test_common_prefix_tokens_against_a_direct_count():
    lists = [(1, 2, 3, 4), (1, 2, 3, 9), (1, 2, 7)]
    assert common_prefix_tokens(lists, [2048, 2048, 1500], 512) == 1024
    assert common_prefix_tokens([(1, 2, 3)], [1200], 512) == 1200  # at most the prompt
    assert common_prefix_tokens([(1,), (2,)], [512, 512], 512) == 0
    assert cascade_read_tokens([1000] * MIN_BATCH, 255) is None
    assert cascade_read_tokens([1000] * MIN_BATCH, 256) == 1000 * MIN_BATCH - (MIN_BATCH - 1) * 256


def test_system_variants_parse_and_refuse():
    assert split_system("router-cascade-tbt") == ("router", frozenset({"tbt", "cascade"}))
    assert split_system("tokenlake-3p1d-no-groups") == ("tokenlake-3p1d", {"no-groups"})
    assert split_system("mooncake-1p3d") == ("mooncake-1p3d", frozenset())
    for bad in ("router-groups", "tokenlake-cascade", "mooncake-1p3d-min-load", "x", "router-"):
        with pytest.raises(ValueError, match="system"):
            split_system(bad)


def test_page_groups_off_reads_every_rows_pages():
    import numpy as np

    from tokenlake.benchmarks.sim.systems.tokenlake_timing import TokenLakeTiming

    spec = ClusterSpec(num_instances=2)
    timer = make_timer(spec)
    rows, tokens, holders = np.array([1, 1, 1]), np.array([4096, 4096, 1024]), np.array([1, 1, 1])
    off = TokenLakeTiming(timer, spec, 512, page_groups=False)
    work_off = np.zeros((2, 2))  # [origin, holder]
    off._queries(work_off, [(rows, tokens, holders, 0, None)], has_prefill=False)
    work_off = work_off.sum(axis=0)
    assert work_off[1] == pytest.approx(timer.query_time(1, 9216))  # every row's own pages
    on = TokenLakeTiming(timer, spec, 512)
    work_on = np.zeros((2, 2))
    shared = np.array([0.0, 4096 + 1024])  # the 4096-token prefix read once
    on._queries(work_on, [(rows, tokens, holders, 0, shared)], has_prefill=False)
    work_on = work_on.sum(axis=0)
    assert work_on[1] == pytest.approx(timer.cost.query_time(1, 9216, 5120))
    assert work_on[1] < work_off[1]
