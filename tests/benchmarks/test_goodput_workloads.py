"""Workload generators match their target statistics; trace replay scales, jitters, re-blocks
and scopes ids as configured."""

import dataclasses
import gzip
import json

import numpy as np
import pytest

from tokenlake.benchmarks.sim.step_timer import ClusterSpec
from tokenlake.benchmarks.workloads import GENERATORS, GeneratorConfig, TraceConfig, trace_workload
from tokenlake.benchmarks.workloads.request import prompt_tokens
from tokenlake.benchmarks.workloads.traces import conversation_trace

CONVERSATION_TRACE = conversation_trace(1000)  # the shared trace, or the bundled excerpt


def stats(name, n=400):
    w = GENERATORS[name](GeneratorConfig(num_requests=n, rate=2.0, seed=1))
    lens = np.array([r.input_len for r in w.requests])
    outs = np.array([r.output_len for r in w.requests])
    return w, lens, outs


def test_every_request_starts_with_the_shared_system_prompt():
    for name in GENERATORS:
        w, _, _ = stats(name, 60)
        heads = {r.block_ids[:8] for r in w.requests}
        assert len(heads) == 1, name  # 4096-token system prompt = 8 blocks


def test_loogle_and_sharegpt_lengths():
    _, lens, _ = stats("loogle")
    assert 20_000 < lens.mean() < 28_000
    w, lens, outs = stats("sharegpt")
    assert ((lens - 4096) + outs < 2400).all()


def test_scbench_sessions():
    w, lens, _ = stats("scbench")
    assert 190_000 < lens.mean() < 265_000
    sessions = np.bincount([r.session for r in w.requests])
    assert 4 < sessions.mean() < 6


def test_agentic_sessions():
    w, lens, outs = stats("agentic", 1500)
    turns = np.bincount([r.session for r in w.requests])
    assert 25 < np.median(turns) < 45
    assert 90 < lens.sum() / outs.sum() < 180  # input:output about 131:1
    by_session = {}
    for r in w.requests:
        by_session.setdefault(r.session, []).append(r)
    growth = [
        np.diff([r.input_len for r in rs]).mean() for rs in by_session.values() if len(rs) > 2
    ]
    assert 1_500 < np.mean(growth) < 3_200  # ~2.2K tokens per turn
    delays = np.array([r.delay_s for r in w.requests if r.after >= 0])
    assert 4.0 < np.median(delays) < 6.5
    for rs in by_session.values():  # a turn extends the previous turn's whole blocks
        for prev, cur in zip(rs, rs[1:], strict=False):
            k = prev.input_len // 512
            assert cur.after == prev.rid and cur.block_ids[:k] == prev.block_ids[:k]


@pytest.mark.parametrize("name", ["scbench", "agentic"])
def test_think_scale_scales_only_the_think_time(name):
    base = GENERATORS[name](GeneratorConfig(num_requests=200, rate=2.0, seed=3))
    for scale in (0.0, 2.5):
        cfg = GeneratorConfig(num_requests=200, rate=2.0, seed=3, think_scale=scale)
        w = GENERATORS[name](cfg)
        assert len(w.requests) == len(base.requests)
        for a, b in zip(base.requests, w.requests, strict=True):
            assert b.delay_s == pytest.approx(scale * a.delay_s)
            assert dataclasses.replace(b, delay_s=a.delay_s) == a  # same arrivals, lengths, blocks
        assert any(r.delay_s > 0 for r in base.requests)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="think_scale"):
            GeneratorConfig(think_scale=bad)


def test_cli_think_scale_reaches_the_workload_and_is_validated(capsys):
    from tokenlake.benchmarks.goodput.harness import make_workload, parse_args

    args = parse_args(["--workload", "scbench", "--requests", "40", "--think-scale", "0"])
    w = make_workload(args, 0.5, 0)
    assert all(r.delay_s == 0 for r in w.requests) and "think time x0" in w.note
    default = make_workload(parse_args(["--workload", "scbench", "--requests", "40"]), 0.5, 0)
    assert any(r.delay_s > 0 for r in default.requests) and "think" not in default.note
    for argv, message in (
        (["--workload", "sharegpt", "--think-scale", "0"], "--think-scale: only for"),
        (["--workload", "agentic", "--think-scale", "-1"], "expected a number >= 0"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_agentic_long_sessions_outgrow_one_instance():
    """Every tenth session grows LONG_GROWTH times faster; at the harness's 1,000 requests
    (seed 0) some contexts exceed one default instance's KV memory, and only those sessions'."""
    w = GENERATORS["agentic"](GeneratorConfig(num_requests=1000, rate=1.0, seed=0))
    per_instance = ClusterSpec("A100-80G", "LWM-Text-1M", 4, 2).capacity_tokens
    over = [r for r in w.requests if r.input_len + r.output_len > per_instance]
    assert 0 < len(over) < 0.1 * len(w.requests)  # baselines can still reach 90%
    assert {r.session % 10 for r in over} == {9}


def test_prompt_tokens_share_exactly_the_shared_blocks():
    w, _, _ = stats("loogle", 40)
    a, b = w.requests[0], w.requests[1]
    ta, tb = prompt_tokens(a, 512)[: a.input_len], prompt_tokens(b, 512)[: b.input_len]
    common = 0
    for x, y in zip(a.block_ids, b.block_ids, strict=False):
        if x != y:
            break
        common += 1
    n = min(len(ta), len(tb))
    first_diff = np.flatnonzero(ta[:n] != tb[:n])
    assert (first_diff[0] if len(first_diff) else n) == min(common * 512, n)


def test_trace_rate_scaling_jitter_and_reblocking():
    w = trace_workload(TraceConfig(CONVERSATION_TRACE, limit=300, rate=5.0, jitter_s=3.0))
    arr = np.array([r.arrival_s for r in w.requests])
    assert (np.diff(arr) >= 0).all()
    assert w.offered_rate == pytest.approx(5.0, rel=1e-6)
    plain = trace_workload(TraceConfig(CONVERSATION_TRACE, limit=300))
    big = trace_workload(TraceConfig(CONVERSATION_TRACE, limit=300, reblock=2))
    assert big.block_size == 1024
    for p, q in zip(plain.requests, big.requests, strict=True):
        assert len(q.block_ids) == -(-p.input_len // 1024)
    # equal re-blocked ids <=> equal 1024-token prefixes: check against the raw ids
    with gzip.open(CONVERSATION_TRACE, "rt") as f:
        raw = [json.loads(line)["hash_ids"] for _, line in zip(range(300), f, strict=False)]
    seen = {}
    for ids, q in zip(raw, big.requests, strict=True):
        for j, gid in enumerate(q.block_ids):
            key = tuple(ids[: min(2 * j + 2, len(ids))])
            assert seen.setdefault(gid, key) == key


def test_per_session_ids_get_their_own_namespace(tmp_path):
    rows = [
        {
            "timestamp": 0,
            "input_length": 600,
            "output_length": 5,
            "hash_ids": [0, 1],
            "session_id": "a",
        },
        {
            "timestamp": 10,
            "input_length": 600,
            "output_length": 5,
            "hash_ids": [0, 1],
            "session_id": "b",
        },
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shared = trace_workload(TraceConfig(path, block_size=512))
    scoped = trace_workload(TraceConfig(path, block_size=512, per_session_ids=True))
    assert shared.requests[0].block_ids == shared.requests[1].block_ids
    assert set(scoped.requests[0].block_ids).isdisjoint(scoped.requests[1].block_ids)
    assert [r.session for r in scoped.requests] == [0, 1]
