"""The wall-clock router bench's pure parts, each against an independent reference: the
workloads (deterministic per seed, prefix sharing as documented), the text encoding (one
character, one token of the byte-level tokenizer), the SLO and attainment (brute force), the
metrics deltas, the alternating goodput searches (the simulator's bisection, called
directly); and one short run of the real router, skipped where it is not installed."""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import threading

import numpy as np
import pytest

from tokenlake.benchmarks.sim.metrics import bisect_goodput
from tokenlake.benchmarks.wallclock import measure, report, sweep
from tokenlake.benchmarks.wallclock.client import ALPHABET, Record, prompt_text
from tokenlake.benchmarks.wallclock.run import parse_args
from tokenlake.benchmarks.wallclock.workloads import WORKLOADS, build_workload

V = len(ALPHABET)


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_is_deterministic_per_seed(name):
    a = build_workload(name, seed=1, num_requests=30, vocab_size=V)
    b = build_workload(name, seed=1, num_requests=30, vocab_size=V)
    c = build_workload(name, seed=2, num_requests=30, vocab_size=V)
    assert a == b and a != c and len(a) == 30
    assert len({r.request_id for r in a}) == 30
    times = [r.arrival_s for r in a]
    assert times == sorted(times) and times[0] == 0.0
    assert all(0 <= t < V for r in a for t in r.prompt_ids)
    assert all(r.max_tokens >= 1 for r in a)


def _lcp(x, y) -> int:
    n = 0
    for p, q in zip(x, y, strict=False):
        if p != q:
            break
        n += 1
    return n


def test_long_document_requests_share_whole_documents():
    reqs = build_workload("long-document", seed=0, num_requests=60, vocab_size=V)
    doc_len = 448  # the real-cluster bench's documents, each request adds a 24-token question
    assert {len(r.prompt_ids) for r in reqs} == {doc_len + 24}
    docs = {r.prompt_ids[:doc_len] for r in reqs}
    assert len(docs) <= 12 < len(reqs)
    for i, r in enumerate(reqs):  # brute force: a repeated document is a 448-token shared prefix
        seen = any(q.prompt_ids[:doc_len] == r.prompt_ids[:doc_len] for q in reqs[:i])
        best = max((_lcp(q.prompt_ids, r.prompt_ids) for q in reqs[:i]), default=0)
        assert (best >= doc_len) == seen
        assert best < doc_len + 24  # the question is fresh
    gaps = np.diff([r.arrival_s for r in build_workload("long-document", seed=0,
                                                        num_requests=400, vocab_size=V)])  # fmt: skip
    assert 0.8 < gaps.mean() < 1.25  # Poisson at 1 req/s


def test_conversation_turns_extend_their_session():
    reqs = build_workload("conversation", seed=0, num_requests=40, vocab_size=V)
    gaps = np.diff([r.arrival_s for r in reqs])
    assert math.isclose(gaps.mean(), 1.0)  # rescaled to 1 req/s
    sessions: dict[str, list] = {}
    for r in reqs:
        sessions.setdefault(r.session_id, []).append(r)
    assert all(r.session_id is not None for r in reqs)
    later = [turns for turns in sessions.values() if len(turns) > 1]
    assert later, "a slice of sessions has later turns"
    block = 512 // 16  # the demo's scale: 512-token trace blocks become 32 tokens
    for turns in later:
        for prev, nxt in itertools.pairwise(turns):
            # find_sessions: all but the last (partial) block of the previous turn is reused
            shared = (-(-len(prev.prompt_ids) // block) - 1) * block
            assert _lcp(prev.prompt_ids, nxt.prompt_ids) >= shared > 0
    assert max(len(r.prompt_ids) for r in reqs) <= 2048
    assert max(r.max_tokens for r in reqs) <= 24


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name": "nope", "seed": 0, "num_requests": 4, "vocab_size": V}, "name"),
        ({"name": "conversation", "seed": -1, "num_requests": 4, "vocab_size": V}, "seed"),
        ({"name": "conversation", "seed": 0, "num_requests": 0, "vocab_size": V}, "num_requests"),
        ({"name": "long-document", "seed": 0, "num_requests": 4, "vocab_size": 1}, "vocab_size"),
        ({"name": "conversation", "seed": 0, "num_requests": 10**6, "vocab_size": V}, "num_requests"),
    ],
)  # fmt: skip
def test_bad_workload_arguments_are_named(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        build_workload(name, **kwargs)


def test_text_is_one_token_per_id_and_keeps_sharing():
    from tokenlake.engines.model.tiny import _tokenizer

    tok = _tokenizer()
    a, b = [5, 9, 9, 0, 92, 17], [5, 9, 9, 0, 3, 3]
    for salt in (0, 1, 7):
        ta, tb = prompt_text(a, salt), prompt_text(b, salt)
        ea, eb = tok.encode(ta).ids, tok.encode(tb).ids
        assert len(ea) == len(a) + 1 and ea[0] == 0  # BOS, then one token per id
        assert _lcp(ea, eb) == 1 + _lcp(a, b)
        # the map is a bijection: distinct ids, distinct characters
        assert len({prompt_text([i], salt) for i in range(V)}) == V
    assert prompt_text(a, 1) != prompt_text(a, 2)  # a new salt: new text, nothing cached
    with pytest.raises(ValueError, match="prompt_ids"):
        prompt_text([V], 0)


def _records(rng, n):
    out = []
    for i in range(n):
        k = int(rng.integers(1, 6))
        rec = Record(f"r{i}", 10, k, sent_s=0.0)
        steps = rng.uniform(0.001, 0.05, k)
        rec.token_s = list(np.cumsum(steps)[: int(rng.integers(0, k + 1))])  # some unfinished
        if rng.random() < 0.1:
            rec.error = "HTTP 500"
        out.append(rec)
    return out


def test_attainment_matches_brute_force():
    rng = np.random.default_rng(3)
    records = _records(rng, 200)
    slo = measure.Slo(ttft_s=0.03, tpot_s=0.04)
    met = 0
    for r in records:
        times = [r.sent_s, *r.token_s]
        ok = not r.error and len(r.token_s) == r.max_tokens
        ok = ok and times[1] - times[0] <= 0.03
        ok = ok and all(times[j + 1] - times[j] <= 0.04 for j in range(1, len(times) - 1))
        met += ok
    assert measure.attainment(records, slo) == met / len(records)
    assert 0 < met < len(records)
    assert measure.attainment([], slo) == 0.0
    s = measure.slo_from_solo([0.01, 0.03, 0.02], [0.002, 0.001, 0.004])
    assert s == measure.Slo(10 * 0.02, 10 * 0.002)


def test_p90_and_metrics_deltas():
    assert measure.p90(range(11)) == 9.0
    assert measure.p90([1.0, math.inf]) == math.inf
    before = measure.parse_metrics(
        "# HELP x\ntokenlake:pool_hit_tokens_total 10.0\ntokenlake:pool_prompt_tokens_total 40.0\n"
        'tokenlake:pool_instance_load_tokens_total{tl_instance="1"} 5.0\n'
        'tokenlake:pool_instance_load_tokens_total{tl_instance="0"} 3.0\n'
        "tokenlake:pool_hit_rate 0.25\n"
    )
    after = dict(before)
    after["tokenlake:pool_hit_tokens_total"] = 40.0
    after["tokenlake:pool_prompt_tokens_total"] = 100.0
    after['tokenlake:pool_instance_load_tokens_total{tl_instance="0"}'] = 13.0
    after['tokenlake:pool_instance_load_tokens_total{tl_instance="1"}'] = 35.0
    d = measure.delta(before, after)
    assert d == measure.ServerDelta(30.0, 60.0, (10.0, 30.0))  # instance order, not text order
    other = measure.ServerDelta(0.0, 40.0, (20.0,))
    assert measure.hit_rate([d, other]) == 30.0 / 100.0
    loads = np.array([10.0, 30.0, 20.0])
    assert math.isclose(measure.load_cv([d, other]), loads.std() / loads.mean())


def _fake_attainment(capacity):
    return lambda rate: 1.0 if rate <= capacity else 0.5


def test_alternating_searches_equal_the_bisection_and_never_overlap():
    caps = {"tokenlake": 37.0, "router": 11.0}
    calls, busy, lock = [], [0], threading.Lock()

    def attainment_at(name, rate):
        with lock:
            busy[0] += 1
            assert busy[0] == 1, "two runs at once"
        calls.append(name)
        with lock:
            busy[0] -= 1
        return _fake_attainment(caps[name])(rate)

    got = sweep.search_all(list(caps), attainment_at, lo=8.0, hi=16.0, rel_tol=0.1,
                           max_evals=8, wait_s=30.0)  # fmt: skip
    for name, cap in caps.items():
        ref = bisect_goodput(_fake_attainment(cap), 8.0, 16.0, rel_tol=0.1, max_evals=8)
        assert got[name] == ref
    both = min(calls.count("tokenlake"), calls.count("router"))
    assert all(calls[i] != calls[i + 1] for i in range(2 * both - 1))  # alternating


def test_summary_takes_medians_and_ratios_per_seed():
    lines = []
    for seed, (tl, rt) in enumerate([(3.0, 1.0), (4.0, 2.0), (9.0, 3.0)]):
        for system, g in (("tokenlake", tl), ("router", rt)):
            key = {"model": "m", "workload": "w", "seed": seed, "system": system}
            lines.append({**key, "kind": "point", "hit_rate": 0.1 * (seed + 1), "load_cv": 0.5})
            lines.append({**key, "kind": "goodput", "p90_goodput": g, "slo_missed_in_sweep": True})
    (row,) = report.summarize(lines)
    assert row["tokenlake"]["goodput"] == 4.0 and row["tokenlake"]["range"] == (3.0, 9.0)
    assert row["router"]["goodput"] == 2.0
    assert row["ratio"] == 3.0 and row["ratio_range"] == (2.0, 3.0)  # per-seed ratios 3, 2, 3
    assert math.isclose(row["router"]["hit_rate"], 0.2)
    assert "3.00x" in report.format_table(lines)
    missed = [
        {**ln, "p90_goodput": 0.0, "points": [(4.0, 0.5), (2.0, 0.6)]}
        if ln["kind"] == "goodput" and ln["system"] == "tokenlake"
        else ln
        for ln in lines
    ]
    assert "<2.00" in report.format_table(missed)  # missed at every rate: below the lowest


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--requests", "0"])
    args = parse_args(["--quick"])
    assert args.models == ["tiny-random"] and args.requests == 16


@pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None, reason="sglang-router is not installed"
)
def test_the_real_router_serves_text_prompts_and_every_process_stops(tmp_path):
    from tokenlake.benchmarks.wallclock.client import drive
    from tokenlake.benchmarks.wallclock.processes import Fleet, ServerSettings
    from tokenlake.benchmarks.wallclock.serving_compare import prepare_model

    settings = ServerSettings(prepare_model("tiny-random", tmp_path, 0), "tiny-random")
    reqs = build_workload("long-document", seed=0, num_requests=4, vocab_size=V)
    with Fleet(start_timeout_s=60.0) as fleet:
        (worker,), _ = fleet.serve(settings, 1, 1, 1)
        router, _ = fleet.router([worker])
        records = drive(router, "tiny-random", reqs, 20.0, salt=1, limit_s=60.0)
        after = measure.scrape([worker])[0]
        pids = fleet.pids
    assert len(pids) == 2 and fleet.pids == []
    assert all(r.finished and len(r.token_s) == r.max_tokens for r in records), records
    assert after["tokenlake:pool_prompt_tokens_total"] == sum(len(r.prompt_ids) + 1 for r in reqs)
    for pid in pids:  # stopped and reaped: no such process any more
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_turns_are_refused_after_a_cancel():
    turns = sweep.TurnTaker(["a", "b"], wait_s=5.0)
    assert turns.run("a", lambda: 1.0) == 1.0
    turns.cancel()
    with pytest.raises(RuntimeError, match="cancelled"):
        turns.run("b", lambda: 1.0)
