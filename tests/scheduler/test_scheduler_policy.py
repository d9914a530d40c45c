"""Pure iteration decisions: chunking, admission, batching per mode (no pool involved)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tokenlake.errors import InvalidArgumentError
from tokenlake.scheduler.config import SchedulerConfig
from tokenlake.scheduler.latency_model import DECODE, PREFILL, Coeffs, LatencyModel
from tokenlake.scheduler.policy import MIXED, item_slo, plan_batches, select_work
from tokenlake.scheduler.request import Phase, Request, chunk_end

C = 16
MODEL = LatencyModel(
    {1: Coeffs(1e-3, 1e-5, 1e-7), 2: Coeffs(1.2e-3, 0.55e-5, 0.55e-7)}, Coeffs(1e-3, 2e-5, 0)
)


def test_chunk_end_is_aligned_and_bounded():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        prompt_len = int(rng.integers(1, 400))
        start = int(rng.integers(0, prompt_len))
        limit = int(rng.integers(1, 200))
        end = chunk_end(start, prompt_len, limit, C)
        assert start <= end <= min(prompt_len, start + limit)
        assert end in (start, prompt_len) or end % C == 0  # end == start: no room
        if limit >= C:
            assert end > start  # a full segment of room always makes progress


def make_requests(specs, seed=0):
    """specs: (prompt_len, phase, num_stored, num_generated) per request, arrival order."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i, (n, phase, stored, generated) in enumerate(specs):
        r = Request.create(f"r{i}", rng.integers(0, 1000, n), 8, i)
        r.phase, r.num_stored, r.num_generated = phase, stored, generated
        reqs.append(r)
    return reqs


def test_select_work_lifecycle_and_budget():
    reqs = make_requests(
        [
            (100, Phase.WAITING, 0, 0),  # fully cached: recomputes its last token
            (200, Phase.WAITING, 0, 0),  # 40 cached tokens (partial tail: unaligned start)
            (90, Phase.PREFILL, 32, 0),  # running prefill: after the cached turn r0 (no deadlines)
            (50, Phase.DECODE, 51, 2),
            (300, Phase.WAITING, 0, 0),
        ]
    )
    cached = {"r0": 100, "r1": 40, "r4": 0}
    cfg = SchedulerConfig(2, C, chunk_len=64, max_prefill_tokens=150)
    items = select_work(reqs, cfg, lambda r: cached[r.request_id])
    by_id = {it.request_id: it for it in items}
    assert [it.request_id for it in items] == ["r3", "r0", "r2", "r1", "r4"]
    assert (by_id["r3"].phase, by_id["r3"].start, by_id["r3"].end) == (DECODE, 51, 52)
    assert (by_id["r2"].start, by_id["r2"].end) == (32, 90)  # ends the prompt
    assert (by_id["r0"].start, by_id["r0"].end) == (99, 100)
    assert (by_id["r1"].start, by_id["r1"].end) == (40, 96)  # 64-token cap, ends aligned
    assert (by_id["r4"].start, by_id["r4"].end) == (0, 32)  # the 35 tokens left, aligned
    prefill = [it for it in items if it.phase == PREFILL]
    assert sum(it.num_new for it in prefill) <= 150
    assert all(it.end % C == 0 or it.end == len(it.token_ids) for it in prefill)
    # one phase only, and a cap on admissions
    only_decode = select_work(reqs, cfg, lambda r: cached[r.request_id], phases=(DECODE,))
    assert [it.request_id for it in only_decode] == ["r3"]
    capped = select_work(reqs, cfg, lambda r: cached[r.request_id], max_new_requests=1)
    assert [it.request_id for it in capped] == ["r3", "r0", "r2"]


def test_colocated_budget_counts_decode_tokens():
    reqs = make_requests([(40, Phase.DECODE, 41, 2)] * 10 + [(500, Phase.WAITING, 0, 0)] * 3)
    cfg = SchedulerConfig(2, C, mode="colocated", chunk_len=64)
    items = select_work(reqs, cfg, lambda r: 0)
    prefill = [it for it in items if it.phase == PREFILL]
    assert sum(it.num_new for it in items) <= 2 * 64
    assert [it.num_new for it in prefill] == [64, 48]  # 128 - 10 decodes: 64 (cap), 54 → 48


def decide(mode, specs, num_instances=4, **kw):
    reqs = make_requests(specs, seed=1)
    cfg = SchedulerConfig(num_instances, C, mode=mode, chunk_len=256, **kw)
    items = select_work(reqs, cfg, lambda r: 0)
    return plan_batches(items, cfg, MODEL, load=0.1), cfg


SPECS = (
    [(700, Phase.WAITING, 0, 0)] * 3
    + [(300, Phase.PREFILL, 64, 0)]
    + [(80 + 10 * i, Phase.DECODE, 81 + 10 * i + 3, 4) for i in range(9)]
)


def test_elastic_respects_pd_and_dops():
    d, cfg = decide("elastic", SPECS)
    phase_of = {f"r{i}": DECODE if sp[1] is Phase.DECODE else PREFILL for i, sp in enumerate(SPECS)}
    assert d.load == 0.1
    for batch, dop, phase in zip(d.batches, d.dops, d.phases, strict=True):
        kinds = {phase_of[c.request_id] for c in batch}
        assert phase in (PREFILL, DECODE) and len(kinds) == 1
        assert dop == 1 or phase == PREFILL
    assert sum(d.dops) <= cfg.num_instances
    assert {c.request_id for c in d.chunks} == {f"r{i}" for i in range(len(SPECS))}
    # the python reference decides the same
    reqs = make_requests(SPECS, seed=1)
    items = select_work(reqs, cfg, lambda r: 0)
    ref = plan_batches(items, cfg, MODEL, 0.1, solver="python")
    assert ref.dops == d.dops and ref.phases == d.phases and ref.latencies == d.latencies
    assert [[c.request_id for c in b] for b in ref.batches] == [
        [c.request_id for c in b] for b in d.batches
    ]


def test_xpyd_limits_prefill_and_decode_instances():
    d, _ = decide("xpyd", SPECS, num_prefill_instances=1)
    pre = [dop for dop, ph in zip(d.dops, d.phases, strict=True) if ph == PREFILL]
    dec = [dop for dop, ph in zip(d.dops, d.phases, strict=True) if ph == DECODE]
    assert sum(pre) <= 1 and len(dec) <= 3 and all(x == 1 for x in dec)


def test_colocated_mixes_batches_with_dop_one():
    d, _ = decide("colocated", SPECS, num_instances=1)
    assert d.dops == (1,) and d.phases == (MIXED,)
    d, _ = decide("colocated", SPECS, num_instances=3)
    assert all(dop == 1 for dop in d.dops) and len(d.batches) <= 3


def test_sync_iterations_hold_prefill_to_the_tbt_slo():
    specs = [(4000, Phase.WAITING, 0, 0)] + [(50, Phase.DECODE, 51, 1)] * 4
    model = LatencyModel({1: Coeffs(1e-3, 1e-5, 0)}, Coeffs(1e-3, 1e-5, 0))
    kw = dict(chunk_len=4096, tbt_slo=0.02, input_token_slo=1.0)
    for sync in (True, False):
        reqs = make_requests(specs)
        cfg = SchedulerConfig(4, C, sync_iterations=sync, **kw)
        items = select_work(reqs, cfg, lambda r: 0)
        slos = {it.phase: item_slo(it, cfg, decoding=True) for it in items}
        assert slos == {DECODE: 0.02, PREFILL: 0.02 if sync else 4000.0}
    d = plan_batches(items, SchedulerConfig(4, C, **kw), model)
    # the 4000-token chunk takes 0.041 s alone: it must be spread to meet the TBT bound
    assert d.slo_met and max(d.latencies) <= 0.02 and max(d.dops) >= 3


def test_infeasible_slo_falls_back():
    reqs = make_requests([(4000, Phase.WAITING, 0, 0)])
    cfg = SchedulerConfig(2, C, chunk_len=4096, input_token_slo=1e-9)
    d = plan_batches(select_work(reqs, cfg, lambda r: 0), cfg, MODEL)
    assert not d.slo_met and len(d.batches) == 1
    assert math.isfinite(d.cost)


def test_config_validation():
    for kw, name in [
        (dict(chunk_len=20), "chunk_len"),
        (dict(mode="pd"), "mode"),
        (dict(mode="xpyd", num_prefill_instances=2), "num_prefill_instances"),
        (dict(tbt_slo=0), "tbt_slo"),
        (dict(num_instances=0), "num_instances"),
    ]:
        with pytest.raises(InvalidArgumentError, match=name):
            SchedulerConfig(**{"num_instances": 2, "segment_len": C, **kw})
    with pytest.raises(InvalidArgumentError, match="solver"):
        plan_batches([], SchedulerConfig(2, C), MODEL, solver="fortran")


def test_prefill_goes_by_first_token_deadline():
    """With an input-token SLO, a short request that arrived later is due earlier than a long
    one: its chunk is chosen before the long new request's, and before a running prefill
    due later (putting every running prefill first made short prompts miss their first
    tokens on the synthetic trace)."""
    reqs = make_requests(
        [(900, Phase.PREFILL, 256, 0), (2000, Phase.WAITING, 0, 0)] + [(40, Phase.WAITING, 0, 0)]
    )
    reqs[0].deadline, reqs[1].deadline, reqs[2].deadline = 9.0, 20.0, 1.4
    cfg = SchedulerConfig(2, C, chunk_len=256, max_prefill_tokens=300)
    items = select_work(reqs, cfg, lambda r: 0)
    assert [it.request_id for it in items] == ["r2", "r0"]  # 40 + 256 of 300
    r = Request.create("d", np.arange(50, dtype=np.int32), 1, 7, now=2.0, input_token_slo=0.01)
    assert r.deadline == pytest.approx(2.5) and r.priority == (pytest.approx(2.5), 7)


def test_cached_requests_go_before_longer_uncached_ones():
    """A new request with a cached prefix whose uncached rest fits one chunk (a session's next
    turn) is chosen before an earlier-due request that must compute more; short uncached
    prompts and running prefills stay in deadline order with the other new requests."""
    reqs = make_requests(
        [
            (2000, Phase.WAITING, 0, 0),  # cold: due first, 2000 uncached tokens
            (900, Phase.PREFILL, 256, 0),  # running prefill
            (2100, Phase.WAITING, 0, 0),  # next turn: 2048 cached, 52 to compute
            (40, Phase.WAITING, 0, 0),  # short
        ]
    )
    for r, deadline in zip(reqs, (1.0, 9.0, 5.0, 7.0), strict=True):
        r.deadline = deadline
    cached = {"r0": 0, "r2": 2048, "r3": 0}
    cfg = SchedulerConfig(2, C, chunk_len=256, max_prefill_tokens=2000)
    items = select_work(reqs, cfg, lambda r: cached[r.request_id])
    assert [it.request_id for it in items] == ["r2", "r0", "r3", "r1"]
    assert (items[0].start, items[0].end) == (2048, 2100)
    # with the budget for one chunk only, the cached turn takes it
    cfg = SchedulerConfig(2, C, chunk_len=256, max_prefill_tokens=64)
    assert [it.request_id for it in select_work(reqs, cfg, lambda r: cached[r.request_id])] == [
        "r2"
    ]


def test_compute_lanes_one_gives_one_batch_per_phase():
    """``compute_lanes=1`` (one process computes every instance's batches, as in
    ``tokenlake serve``): at most one prefill batch at DoP 1 and one decode batch, every
    request still scheduled; the same work on 4 parallel instances splits it."""
    spread, cfg = decide("elastic", SPECS)
    assert len(spread.batches) > 2 or max(spread.dops) > 1
    one, cfg = decide("elastic", SPECS, compute_lanes=1)
    assert cfg.parallel_instances == 1 and cfg.prefill_instances == cfg.decode_instances == 1
    assert sorted(one.phases) in ([DECODE, PREFILL], [DECODE], [PREFILL])
    assert one.dops == (1,) * len(one.batches)
    prefill_ids = {c.request_id for b, ph in zip(one.batches, one.phases, strict=True)
                   for c in b if ph == PREFILL}  # fmt: skip
    decode_ids = {c.request_id for b, ph in zip(one.batches, one.phases, strict=True)
                  for c in b if ph == DECODE}  # fmt: skip
    assert decode_ids == {f"r{i}" for i, sp in enumerate(SPECS) if sp[1] is Phase.DECODE}
    assert prefill_ids  # the budget of one instance's chunk
    co, _ = decide("colocated", SPECS, compute_lanes=1)
    assert len(co.batches) == 1 and co.phases == (MIXED,)
    two = SchedulerConfig(4, C, compute_lanes=2)
    assert (
        two.parallel_instances == 2
        and SchedulerConfig(4, C, compute_lanes=9).parallel_instances == 4
    )
    with pytest.raises(InvalidArgumentError, match="compute_lanes"):
        SchedulerConfig(4, C, compute_lanes=-1)
