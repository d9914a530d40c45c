"""The scheduler drives a real Pool + LocalCluster: its gen_plans calls are accepted, every
query result equals monolithic causal attention, requests go through their whole lifecycle."""

from __future__ import annotations

import numpy as np
import pytest
from harness import tokens
from scheduler_cases import LATENCY, SHAPE, C

import tokenlake as tl
from tokenlake.cluster.load_model import LoadModel
from tokenlake.cluster.profiles import A100_80G, LLAMA2_7B
from tokenlake.engines.client.synthetic import SyntheticModel, run_iteration
from tokenlake.engines.clusters.local import LocalCluster
from tokenlake.scheduler import (
    DECODE,
    PREFILL,
    ElasticScheduler,
    SchedulerConfig,
    fit_latency_model,
)
from tokenlake.scheduler.profiler import default_cases, measure_rows


def run_workload(mode: str, num_instances: int, load_model=None, **cfg):
    pool = tl.Pool(
        tl.PoolConfig(SHAPE, num_instances, num_slots=96, segment_len=C), load_model=load_model
    )
    cluster = LocalCluster(pool)
    synth = SyntheticModel(SHAPE, seed=1)
    config = SchedulerConfig(num_instances, C, mode=mode, chunk_len=2 * C, **cfg)
    sched = ElasticScheduler(config, LATENCY, pool)
    doc = tokens(0, 3 * C + 5)
    outputs = {}
    wave = [
        (f"a{i}", np.concatenate([doc, tokens(10 + i, 7 + 13 * i)]), 2 + i % 3) for i in range(5)
    ]
    later = [(f"b{i}", np.concatenate([doc, tokens(20 + i, 40 + i)]), 3) for i in range(3)]
    for rid, prompt, n_out in wave:
        sched.add_request(rid, prompt, n_out)
        outputs[rid] = (len(prompt), n_out)
    seen, hits, max_err, loads, steps = set(), 0, 0.0, [], 0
    while sched.has_work:
        steps += 1
        assert steps < 200
        if steps == 4:  # arrives while the first wave runs: shares its document
            for rid, prompt, n_out in later:
                sched.add_request(rid, prompt, n_out)
                outputs[rid] = (len(prompt), n_out)
        it = sched.step()
        d = it.decision
        loads.append(d.load)
        tree = pool.get_prefix_tree()
        chunks = {c.request_id: c for c in d.chunks}
        for batch, dop, phase in zip(d.batches, d.dops, d.phases, strict=True):
            assert 1 <= dop <= sum(c.num_new_tokens for c in batch)
            if mode != "colocated":
                assert phase in (PREFILL, DECODE) and (dop == 1 or phase == PREFILL)
        assert sum(d.dops) <= num_instances
        if mode == "xpyd":  # fixed roles: the first P instances prefill, the rest decode
            num_p = cfg["num_prefill_instances"]
            for b, phase in enumerate(d.phases):
                for origin in it.plans.groups[b]:
                    assert (origin < num_p) == (phase == PREFILL)
        for c in d.chunks:
            prompt_len = outputs[c.request_id][0]
            if c.request_id not in seen:  # a new request starts at its cached prefix
                match = tree.match(c.token_ids).num_tokens
                assert c.start == min(match, prompt_len - 1)
                hits += c.start > 0
                seen.add(c.request_id)
            if c.end <= prompt_len:  # prefill chunks end aligned unless they end the prompt
                assert c.end == prompt_len or c.end % C == 0
            else:
                assert c.num_new_tokens == 1
        for r in run_iteration(cluster, it.plans, chunks, synth):
            o, lse = synth.reference(chunks[r.request_id].token_ids, r.first, r.end, r.layer)
            max_err = max(max_err, float((o - r.o).abs().max()), float((lse - r.lse).abs().max()))
        for req in sched.complete(it):
            assert len(req.output_ids) == outputs[req.request_id][1]
            del outputs[req.request_id]
        pool.check_invariants()
    assert not outputs, "every request finished"
    assert not pool.requests, "finish released every request"
    return max_err, hits, loads


@pytest.mark.parametrize(
    "mode,num_instances,extra",
    [
        ("elastic", 1, {}),
        ("elastic", 4, {"tbt_slo": 0.01, "input_token_slo": 1e-3}),
        ("xpyd", 4, {"num_prefill_instances": 1}),
        ("xpyd", 4, {"num_prefill_instances": 3}),
        ("colocated", 2, {}),
    ],
)
def test_scheduler_runs_exact_iterations(mode, num_instances, extra):
    max_err, hits, _ = run_workload(mode, num_instances, **extra)
    assert max_err <= 1e-5
    assert hits >= 3  # the later wave reuses the first wave's document


def test_cache_load_from_the_pool():
    max_err, _, loads = run_workload("elastic", 2, load_model=LoadModel(A100_80G, LLAMA2_7B))
    assert max_err <= 1e-5
    assert max(loads) > 0 and all(0 <= x < 1 for x in loads)


def test_step_idle_abort_and_bad_input():
    pool = tl.Pool(tl.PoolConfig(SHAPE, 2, num_slots=32, segment_len=C))
    sched = ElasticScheduler(SchedulerConfig(2, C, chunk_len=C), LATENCY, pool)
    assert sched.step() is None
    sched.add_request("x", tokens(1, 40), 2)
    with pytest.raises(tl.InvalidArgumentError, match="request_id"):
        sched.add_request("x", tokens(1, 40), 2)
    with pytest.raises(tl.InvalidArgumentError, match="max_output_tokens"):
        sched.add_request("y", tokens(1, 40), 0)
    it = sched.step()
    assert sched.step() is None  # synchronous: one iteration in flight at a time
    sched.abort(it)
    assert not pool.requests and sched.num_waiting == 1
    again = sched.step()
    assert again.decision.chunks[0].end == C  # the same first chunk, planned again
    with pytest.raises(tl.InvalidArgumentError, match="iteration"):
        sched.complete(it)
    with pytest.raises(tl.InvalidArgumentError, match="new_token_ids"):
        sched.complete(again, {"x": -1})
    assert pool.active_epoch == again.plans.epoch  # nothing committed
    sched.complete(again, {"x": 5})
    assert sched.request("x").num_stored == C
    with pytest.raises(tl.InvalidArgumentError, match="config"):
        ElasticScheduler(SchedulerConfig(3, C), LATENCY, pool)


def test_profiler_measures_rows_on_the_local_cluster():
    pool = tl.Pool(tl.PoolConfig(SHAPE, 2, num_slots=64, segment_len=C))
    cluster = LocalCluster(pool)
    synth = SyntheticModel(SHAPE, seed=1)
    cases = default_cases(dops=(1, 2), max_len=128, num_prefill=6)
    rows = measure_rows(pool, lambda p, c: run_iteration(cluster, p, c, synth), cases, repeats=2)
    assert [(r.phase, r.dop, r.lengths) for r in rows] == cases
    assert all(r.seconds > 0 for r in rows)
    assert not pool.requests
    model = fit_latency_model(rows)
    assert sorted(model.prefill) == [1, 2]
    assert model.predict(PREFILL, [128]) > 0 and model.predict(DECODE, [1]) > 0


def test_admits_fewer_requests_when_the_pool_is_full():
    """8 slots in all, one kept free (watermark); three 40-token prompts with 2 output tokens
    need 3 slots each: the scheduler admits the two that fit, the third when one finished."""
    pool = tl.Pool(tl.PoolConfig(SHAPE, 2, num_slots=4, segment_len=C))
    cluster = LocalCluster(pool)
    synth = SyntheticModel(SHAPE, seed=1)
    sched = ElasticScheduler(SchedulerConfig(2, C, chunk_len=4 * C), LATENCY, pool)
    for i in range(3):
        sched.add_request(i, tokens(40 + i, 40), 2)
    admitted = []
    while sched.has_work:
        it = sched.step()
        chunks = {c.request_id: c for c in it.decision.chunks}
        admitted.append(sum(c.start == 0 for c in chunks.values()))
        for r in run_iteration(cluster, it.plans, chunks, synth):
            o, _ = synth.reference(chunks[r.request_id].token_ids, r.first, r.end, r.layer)
            assert float((o - r.o).abs().max()) <= 1e-5
        sched.complete(it)
        pool.check_invariants()
    assert admitted[0] == 2 and sum(admitted) == 3 and not pool.requests
